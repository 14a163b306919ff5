"""The ``smp`` command: see how a model would be split, why, and what it would cost, before paying for devices.

    smp inspect TARGET --partitions P [--microbatches M] [--pipeline interleaved|simple] ...
    smp simulate TARGET --partitions P --microbatches M [--ranks-per-node R] ...
    smp demo
    smp launch -n N script.py [args ...]

TARGET is ``zoo:NAME`` (a built-in model from :mod:`smp.zoo`, random weights, nothing downloaded) or
``path/to/file.py:factory``, a function returning ``(model, example_args)`` or ``(model, args, kwargs)`` where
the example inputs are one microbatch.

One file per concern: ``target`` (TARGET), ``options`` (arguments and :class:`~smp.cli.options.Options`),
``limits`` (work guards), ``analysis`` (plan, baselines, simulation), ``report`` (the inspect table),
``graph`` (the module graph), ``drawing`` (PNG/SVG/DOT and timelines), ``pricing`` (stage costs for
simulate), one file per command (``inspect``, ``simulate``, ``demo``, ``launch``, with ``worker`` for the
ranks), and ``entry`` (:func:`main`, error handling). Importing the command imports no torch; each command
imports it when it runs.
"""
from .entry import main

__all__ = ["main"]
