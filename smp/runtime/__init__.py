"""What ``smp.init`` builds and every step runs on: the config (:mod:`~smp.runtime.config`, with the SMP v1
options that change nothing here, :mod:`~smp.runtime.compat`), the rank grid (:mod:`~smp.runtime.topology`),
the one global :class:`~smp.runtime.state.State` with smp's process groups, the checks that every rank enters the
same collective call (:mod:`~smp.runtime.call_log`), the threads that run a step's microbatches
(:mod:`~smp.runtime.workers`), the environment a rank's process starts with (:mod:`~smp.runtime.rank_env`), a
SageMaker job's environment (:mod:`~smp.runtime.sagemaker_env`) and ``smp.state``, SMP's read-only view of the state
(:mod:`~smp.runtime.state_view`).

It may import :mod:`partitioner` and :mod:`pipeline`, and nothing else of :mod:`smp`: every other part of smp
builds on it.
"""
