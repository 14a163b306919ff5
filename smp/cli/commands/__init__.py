"""One file per ``smp`` command, each with its ``register(subparsers)``: ``inspect``, ``simulate``, ``demo``,
``launch``, ``report``, ``replan`` and ``calibrate``. A command may import the rest of :mod:`smp.cli` and, when it runs,
anything of smp; nothing imports a command but :mod:`smp.cli.entry`.
"""
