"""Graph capture: a torch model traced into the op graph the partitioner cuts, and the executable modules cut
from it.

Owns: ``tracing`` (torch.export, non-strict, -> :class:`~partitioner.OpGraph`), ``build`` (the exported FX graph
folded into ops), ``program`` (the traced program the stages are cut from), ``group_handle`` (the process group a
rewritten program's collectives run on, bound at run time), ``graph`` (:class:`OpGraph`),
``mutation`` (in-place updates as dependencies), ``flops`` (FLOPs and bytes of one op), ``autograd_saves`` (what
each op keeps for backward), ``save_rules`` (what each op's backward reads), ``saved_activations`` (what autograd
really saves, measured), ``split_points`` (the user's ``pipe_split()`` markers), ``plan_inputs`` (the example inputs
a plan was made from), ``chunk`` (a heavy linear layer cut into column chunks) and ``stage_modules`` (one executable
``GraphModule`` per stage, :func:`split`).

May import: the package's foundation (``partitioner.errors``, ``partitioner.units``) and nothing else of the
partitioner: what a parallel axis adds to a program (its collectives that fold into an op, their prices) it records
on the program (:class:`~partitioner.capture.program.TracedProgram`), so capture needs no axis.
"""
