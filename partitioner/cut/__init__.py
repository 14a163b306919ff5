"""The cut: an op graph partitioned into balanced, acyclic pipeline stages, and the plan that records it.

Owns: ``options`` (:class:`~partitioner.PartitionOptions`), ``objective`` (scoring an assignment: the one place a
plan's numbers come from), ``dp`` (the exact chain DP) and ``segments`` (what it cuts: prefix sums, live values,
candidate positions, the communication of every segment), ``metis`` (METIS k-way, repaired into acyclic stages),
``refine`` (boundary refinement), ``baselines`` (uniform, params, layers), ``portfolio``
(:func:`~partitioner.partition`: keep the best), ``plan`` (:class:`~partitioner.PartitionPlan` and its JSON),
``memory`` (what each stage's rank holds) and ``respecialise`` (a plan re-bound to a trace at other input shapes).

May import: ``partitioner.capture``, ``partitioner.cost``, ``partitioner.tp`` (a plan records its tensor-parallel
degree and collectives) and the foundation.
"""
