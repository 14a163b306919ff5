"""Sharded data parallelism (ZeRO-3, SMP's ``sharded_data_parallel_degree``): what it shards and what it costs.

Owns: ``shards`` (which parameters are sharded, what each pipeline rank holds and spends,
:func:`~partitioner.sharded_dp`), ``overlap`` (the exposed seconds of FSDP's prefetched all-gathers and
reduce-scatters) and ``group`` (a stage's sharding group as a pipeline is priced with it: its link, the options its
stages are cut with, its ranks held to the budget and recorded).

May import: ``partitioner.capture``, ``partitioner.cost``, ``partitioner.cut`` and the foundation.
"""
