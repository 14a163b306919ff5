"""Tensor parallelism (Megatron's pattern), found on the traced graph: finding, rewriting and pricing.

Owns: ``sharding`` (which ops and parameters split, :func:`~partitioner.find_sharding`), ``shard_rules`` (how one
op carries a shard), ``shard_program`` (one tp rank's program, :func:`~partitioner.shard_graph`), ``rank_values``
(its traced values as its run will have them: views on their bases' storage), ``collectives``
(the ops a sharded graph calls: Megatron's f and g, vocabulary-parallel embedding and loss, and their
sequence-parallel forms), ``sequence`` (Megatron's sequence parallelism: the regions between tp regions on a slice of
the sequence, :func:`~partitioner.tp.sequence.sequence_parallel`), ``token_walk`` (a slice of the sequence followed
through a graph, shared with context parallelism), ``rank_zero`` (tp rank
0's graph, what a plan of one tp rank is made from, and the weights a degree leaves some rank no slice of) and
``pricing`` (the seconds of each collective in a tp rank's graph, and the plan's record).

May import: ``partitioner.capture``, ``partitioner.cost`` and the foundation. A parallel axis is one folder like
this one: it finds its pattern on the captured graph, rewrites the program for one rank, and prices what it adds.
"""
