"""One ``@smp.step`` call from the call to its results: the step function's microbatch threads
(:mod:`~smp.engine.step_function`), the step run as a unit (:mod:`~smp.engine.execution`), the step's values
between ranks (:mod:`~smp.engine.step_values`), one plan for every rank (:mod:`~smp.engine.planning`), each rank
holding only its own weights (:mod:`~smp.engine.materialize`, :mod:`~smp.engine.weights`), mixed precision
(:mod:`~smp.engine.mixed_precision`), gradient norms over ranks (:mod:`~smp.engine.gradnorm`) and moving a model to
a new plan between steps (:mod:`~smp.engine.migrate`).

It may import :mod:`smp.runtime`, the recording half of :mod:`smp.profiling` (the session and the re-partitioning
decision's inputs) and :mod:`smp.health` (the training-health checks around a step), never the SMP surface above
it (``DistributedModel``, ``DistributedOptimizer``) nor :mod:`smp.checkpoint`: what it needs of the model it receives
through :class:`~smp.engine.pipeline_model.PipelineModel`.
"""
