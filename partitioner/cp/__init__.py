"""Context parallelism: every sequence split across a group of ranks, attention included.

Owns: ``comm`` (the ops a context-parallel program calls: :class:`~partitioner.cp.comm.CPComm`, this rank's
load-balanced tokens, the gathered keys and values, the causal mask of this rank's queries, the group's
cross-entropy), ``mask_rows`` (an attention mask's rows made where the mask is, not cut from it whole),
``context_program`` (:func:`~partitioner.cp.context_program.context_parallel_graph`: a traced program rewritten for
one cp rank, on the walk of :mod:`partitioner.tp.token_walk`) and ``pricing`` (what its collectives cost).

May import: ``partitioner.capture``, ``partitioner.cost`` and ``partitioner.tp`` (its collectives, which a
context-parallel program runs on each rank's tokens, and the walk along the sequence), with the foundation.
"""
