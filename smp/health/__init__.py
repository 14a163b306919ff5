"""Training health while training runs: SageMaker Debugger's built-in rules (``LossNotDecreasing``,
``VanishingGradient``, ``ExplodingTensor``, ``WeightUpdateRatio``, ``Overfit``, ``PoorWeightInitialization``)
checked every ``every_n_steps`` training steps. What each rank measures (:mod:`~smp.health.statistics`, with the
activation taps inside its stages, :mod:`~smp.health.activations`), what the rules conclude
(:mod:`~smp.health.rules`) and the session that gathers, evaluates and warns or stops (:mod:`~smp.health.session`:
``smp.debug`` and the config's ``"debug"`` key). ``docs/health.md`` documents the rules, thresholds and exit status.

It may import :mod:`smp.runtime` (the state, the options and their defaults), never the SMP surface above it nor
:mod:`smp.engine`: the step hands it the model and the step's run, the optimizer its parameters.
"""
