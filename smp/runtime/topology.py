"""The rank grid: pipeline (model) parallel x data parallel, placed "cluster" or "spread".

With ``world = pp * dp`` ranks, "cluster" puts a model replica's stages on consecutive ranks (mp groups
``[0, 1], [2, 3], ...`` for pp = 2), so pipeline traffic stays inside a node; "spread" puts the data
parallel replicas of one stage on consecutive ranks (mp groups ``[0, 4], [1, 5], ...`` for 8 ranks), so
gradient all-reduce stays inside a node. Same layout as SageMaker model parallelism's
``placement_strategy``.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    world: int
    pp: int
    placement: str = "cluster"

    def __post_init__(self) -> None:
        if self.world % self.pp:
            raise ValueError(f"{self.world} processes cannot form pipelines of {self.pp} stages: launch a multiple "
                             f"of pipeline_parallel_degree={self.pp} processes")

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many replicas of the pipeline run."""
        return self.world // self.pp

    def mp_groups(self) -> list[list[int]]:
        """One list per model replica, in stage order."""
        if self.placement == "cluster":
            return [[d * self.pp + s for s in range(self.pp)] for d in range(self.dp)]
        return [[s * self.dp + d for s in range(self.pp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """One list per stage: the ranks holding that stage in every replica."""
        mp = self.mp_groups()
        return [[group[s] for group in mp] for s in range(self.pp)]

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage index of global ``rank`` within its model replica."""
        return next(g.index(rank) for g in self.mp_groups() if rank in g)

    def dp_rank(self, rank: int) -> int:
        """Which model replica global ``rank`` belongs to."""
        return next(g.index(rank) for g in self.dp_groups() if rank in g)
