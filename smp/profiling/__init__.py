"""Record a run and read it back. Recording: :mod:`~smp.profiling.session` (``smp.profile``, ``smp.annotate``,
the config's ``"profile"`` key). Reading: :mod:`~smp.profiling.measurements` (what a profile measured),
:mod:`~smp.profiling.rules` (what it means), :mod:`~smp.profiling.report` (the Markdown report of ``smp report``)
and :mod:`~smp.profiling.replan` (a better plan from measured costs).

The session may import :mod:`smp.runtime`. The analysis modules read files and return plans and findings: they
cannot move tensors, so they import neither :mod:`torch.distributed` nor :mod:`smp.runtime` nor
:mod:`smp.engine` (whoever acts on a new plan, the step, migrates the model itself).
"""
