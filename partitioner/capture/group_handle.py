"""The handle of the process group a rewritten program's collectives run on.

An axis that rewrites a traced program for one of its ranks (expert parallelism's all-to-alls, context
parallelism's gathers) writes it without any process: the program holds a handle whose degree and rank are fixed
then, as an attribute its ops read, and the runtime gives the handle its process group before a step runs
(:meth:`GroupHandle.bind`). A program run before that stops with an error that says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist

__all__ = ["GroupHandle", "UnboundHandleError"]


class UnboundHandleError(RuntimeError):
    """A rewritten program ran before its group handle was bound to a process group."""


@dataclass(eq=False)
class GroupHandle:
    """The group of ``size`` ranks, in which this program's is ``rank``, that its collectives run on (``group``
    once bound). Subclasses name their axis (``axis``: "expert", ``short``: "ep") and their error."""

    size: int
    rank: int
    group: Any = None
    axis: ClassVar[str] = ""
    short: ClassVar[str] = ""
    unbound: ClassVar[type[UnboundHandleError]] = UnboundHandleError

    def bind(self, group: Any) -> None:
        """Run the collectives on ``group`` (this rank's group of the axis, of ``size`` ranks, in which it is
        ``rank``)."""
        if dist.get_world_size(group) != self.size or dist.get_rank(group) != self.rank:
            raise ValueError(f"the program was written for {self.short} rank {self.rank} of {self.size}, but this "
                             f"process is rank {dist.get_rank(group)} of a {self.short} group of "
                             f"{dist.get_world_size(group)}")
        self.group = group

    def bound_group(self) -> Any:
        """The bound process group (raises :attr:`unbound` before :meth:`bind`)."""
        if self.group is None:
            raise self.unbound(f"a program written for {self.axis} parallelism ({self.short} rank {self.rank} of "
                               f"{self.size}) ran without its process group: run it through the engine's runner, "
                               f"which binds it ({type(self).__name__}.bind)")
        return self.group
