"""Expert parallelism (mixtures of experts), found on the traced graph: finding, rewriting and pricing.

Owns: ``experts`` (the routing pattern: which layers' experts split, :func:`~partitioner.ep.experts.find_experts`),
``dispatch`` (the op an expert-parallel program calls: rows to their experts' ranks and back by all-to-all),
``expert_program`` (one ep rank's program, :func:`~partitioner.ep.expert_program.expert_parallel_graph`) and
``pricing`` (the seconds of the all-to-alls).

May import: ``partitioner.capture``, ``partitioner.cost`` and the foundation, as every parallel axis.
"""
