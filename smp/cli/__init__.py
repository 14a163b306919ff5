"""The ``smp`` command: see how a model would be split, why, and what it would cost, before paying for devices.

    smp inspect TARGET --partitions P [--microbatches M] [--pipeline interleaved|simple] ...
    smp simulate TARGET --partitions P --microbatches M [--ranks-per-node R] ...
    smp demo
    smp launch -n N script.py [args ...]
    smp report DIR
    smp replan DIR -o plan.json

TARGET is ``zoo:NAME`` (a built-in model from :mod:`smp.zoo`, random weights, nothing downloaded) or
``path/to/file.py:factory``, a function returning ``(model, example_args)`` or ``(model, args, kwargs)`` where
the example inputs are one microbatch.

The command line parses and prints; what it prints is computed by the library (the plan, its baselines and
simulation by :mod:`pipeline.plan_analysis`, a pipeline's stage costs and schedules by :mod:`pipeline.stage_pricing`,
sharded data parallelism by :mod:`partitioner.sdp.group` and :mod:`pipeline.sharded_step`, tp rank 0's graph by
:mod:`partitioner.tp.rank_zero`, the layout search by :mod:`partitioner.layout`). One file per concern: ``entry``
(:func:`main`, the parser of every command, error handling), ``errors`` (:class:`~smp.cli.errors.CLIError`),
``target`` (TARGET), ``options`` (arguments and :class:`~smp.cli.options.Options`), ``limits`` (work guards),
``analysis`` (the options handed to the plan's analysis), ``plan_table`` (the table ``smp inspect`` prints),
``graph`` (the module graph), ``drawing`` (PNG/SVG/DOT and timelines), ``tensor_parallel`` and ``sharded_dp``
(what ``--tp`` and ``--sdp`` print and refuse), ``runtime_costs`` (this machine's runtime costs, measured on two
ranks), ``text`` (what the commands print) and ``worker`` (what each rank of ``smp launch`` runs).
:mod:`smp.cli.commands` holds one file per command (``inspect``, ``simulate``, ``plan``, ``demo``, ``launch``,
``report``, ``replan``, ``calibrate``). Importing the command imports no torch; each command imports it when it runs.
"""
from .entry import main

__all__ = ["main"]
