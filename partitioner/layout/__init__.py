"""The layout planner: how to run a model on N devices (pp x tp x dp, sdp, microbatches, schedule), searched
with the cost model ``smp inspect`` and ``smp simulate`` use.

Owns: ``layout`` (:class:`Layout`, its :class:`Score`, a :class:`Proposal`), ``costs`` (per-op costs at every
microbatch size, tp degree and ep or cp degree from two traces), ``experts`` (a layout's expert parallelism: its
degrees, its experts' gradient average), ``score`` (pricing one layout, its bounds), ``chain`` (the estimate's stage
time: ops cut into contiguous stages), ``headroom`` (the memory a layout may use: the budget less what is kept free
for the allocator), ``rank_state`` (what a pipeline rank holds of its stages, what its optimizer step sweeps),
``sharded`` (a layout's sharded data parallelism: its links, what the gathers add per pass, where it would shard
nothing) and ``search`` (branch and bound over the candidates, context parallelism's degrees among them).

May import: every other folder of the partitioner (``capture``, ``cost``, ``cut``, ``tp``, ``ep``, ``cp``, ``sdp``): it
composes the axes.
"""
