"""The cost model: seconds, bytes and rates of ops, stages, devices and links.

Owns: ``devices`` (:class:`~partitioner.DeviceRates`, the datasheet profiles, links), ``calibration`` (this CPU's
rates and the runtime's costs, measured and cached), ``precision`` (bytes per training dtype), ``roofline`` (the
roofline cost model, :func:`~partitioner.estimate`), ``collectives`` (what a ring collective costs on a link, for
every axis), ``timing`` (ops and stages timed for real), ``op_times`` (a graph's op times kept on disk),
``throughput`` (samples/s, tokens/s, MFU: the one definition), ``optimizer_step`` (the optimizer's step: the memory
it streams), ``pipelines`` (the pipelines a plan is priced for) and
``runtime_fit`` (the runtime's per-pass and per-step costs fitted to measured steps).

May import: ``partitioner.capture`` and the foundation. Not the cut, nor any axis: an axis's collectives are priced
through what its rewrite records on the program (``TracedProgram.collective_pricing``).
"""
