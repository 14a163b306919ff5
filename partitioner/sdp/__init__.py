"""Sharded data parallelism (ZeRO-3, SMP's ``sharded_data_parallel_degree``): what it shards and what it costs.

Owns: ``shards`` (which parameters are sharded, what each pipeline rank holds and spends,
:func:`~partitioner.sharded_dp`), ``units`` (the units gathered and reduced by one collective each, the grouping the
runtime gathers by, and what the gathering holds at once), ``overlap`` (the exposed seconds of the prefetched
all-gathers and reduce-scatters, as the runtime and FSDP run them) and ``group`` (a stage's sharding group as a
pipeline is priced with it: its link, the options its stages are cut with, its ranks held to the budget and
recorded).

May import: ``partitioner.capture``, ``partitioner.cost``, ``partitioner.cut`` and the foundation.
"""
