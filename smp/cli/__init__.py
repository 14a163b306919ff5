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

One file per concern: ``entry`` (:func:`main`, the parser of every command, error handling), ``errors``
(:class:`~smp.cli.errors.CLIError`), ``target`` (TARGET), ``options`` (arguments and
:class:`~smp.cli.options.Options`), ``limits`` (work guards), ``analysis`` (plan, baselines, simulation),
``plan_table`` (the table ``smp inspect`` prints), ``graph`` (the module graph), ``drawing`` (PNG/SVG/DOT and
timelines), ``pricing`` (stage costs for simulate), ``text`` (what the commands print) and ``worker`` (what each
rank of ``smp launch`` runs). :mod:`smp.cli.commands` holds one file per command (``inspect``, ``simulate``,
``demo``, ``launch``, ``report``, ``replan``). Importing the command imports no torch; each command imports it
when it runs.
"""
from .entry import main

__all__ = ["main"]
