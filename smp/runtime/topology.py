"""The rank grid pp x tp x rdp, with SageMaker model parallelism v1's semantics.

Tensor parallelism is carved out of the data-parallel ranks: with ``world`` ranks, ``pp`` pipeline stages and
tensor-parallel degree ``tp``, there are ``rdp = world // (pp * tp)`` reduced-data-parallel replicas, the
data-parallel degree is ``dp = tp * rdp`` and the model-parallel degree ``mp = pp * tp``. Each rank has one
coordinate per axis: ``pp_rank`` (P), ``tp_rank`` (T) and ``rdp_rank`` (D).

``placement`` orders the axes over consecutive global ranks: a permutation of the letters D, P and T whose
right-most letter varies fastest. ``"cluster"`` is ``"DPT"`` (a tp group on adjacent ranks, then a replica's
stages, so both stay inside a node), ``"spread"`` is ``"TPD"`` (the replicas of a stage on adjacent ranks). With
tp = 1 they are SMP's two placements without tensor parallelism: for 8 ranks and pp = 2, "cluster" makes the
pipelines ``[0, 1], [2, 3], ...`` and "spread" ``[0, 4], [1, 5], ...``.

The groups, each a list of global ranks in ascending order (the order of a torch process group):

========================  ===============  ===================================================================
group                     axes that vary   ranks sharing
========================  ===============  ===================================================================
pipeline (SMP PP_GROUP)   P                tp_rank and rdp_rank: one pipeline, in stage order
tensor (TP_GROUP)         T                pp_rank and rdp_rank
reduced data (RDP_GROUP)  D                pp_rank and tp_rank: the replicas of one shard of one stage
data (DP_GROUP)           D, T             pp_rank: tp x rdp ranks
model (MP_GROUP)          P, T             rdp_rank: pp x tp ranks that together hold one model replica
========================  ===============  ===================================================================

A rank's rank in a group is its index there: ``pp_rank``, ``tp_rank`` and ``rdp_rank`` are its coordinates,
``dp_rank`` and ``mp_rank`` its index in its data / model group. For ``mp_rank`` that is ``pp_rank * tp + tp_rank``
when P is left of T in the placement ("cluster"), ``tp_rank * pp + pp_rank`` otherwise ("spread"; the table of
AWS's "Ranking Mechanism" page, placement "DTP", shows the same), and ``pp_rank`` when tp = 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

__all__ = ["Topology", "axis_order", "PLACEMENT_ALIASES"]

PLACEMENT_ALIASES = {"cluster": "DPT", "spread": "TPD"}  # SMP v1's names for two orders of the axes


def axis_order(placement: str) -> str:
    """``placement`` as a permutation of "D", "P", "T", slowest-varying axis first ("cluster" -> "DPT")."""
    order = PLACEMENT_ALIASES.get(placement, placement) if isinstance(placement, str) else placement
    if not isinstance(order, str) or sorted(order) != ["D", "P", "T"]:
        raise ValueError(f"placement_strategy={placement!r} is not valid: 'cluster' (= 'DPT'), 'spread' (= 'TPD') "
                         "or a permutation of the letters 'D' (reduced data parallelism), 'P' (pipeline) and 'T' "
                         "(tensor parallelism), the right-most varying fastest over consecutive ranks")
    return order


@dataclass(frozen=True)
class Topology:
    """The rank grid of ``world`` ranks: ``pp`` pipeline stages x ``tp`` tensor-parallel ranks x ``rdp`` replicas,
    laid out over global ranks as ``placement`` says (see the module docstring)."""

    world: int
    pp: int
    tp: int = 1
    placement: str = "cluster"

    def __post_init__(self) -> None:
        for name in ("world", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                hint = "; pass placement by keyword: Topology(world, pp, placement=...)" if name == "tp" else ""
                raise ValueError(f"Topology {name}={value!r} is not valid: a positive integer{hint}")
        axis_order(self.placement)
        if self.world % (self.pp * self.tp) and self.tp == 1:
            raise ValueError(f"{self.world} processes cannot form pipelines of {self.pp} stages: launch a multiple "
                             f"of pipeline_parallel_degree={self.pp} processes")
        if self.world % (self.pp * self.tp):
            raise ValueError(f"{self.world} processes cannot form a grid of pipeline_parallel_degree={self.pp} x "
                             f"tensor_parallel_degree={self.tp}: launch a multiple of pipeline_parallel_degree x "
                             f"tensor_parallel_degree = {self.pp * self.tp} processes")

    @property
    def rdp(self) -> int:
        """The reduced-data-parallel degree: how many replicas of each shard of each stage run."""
        return self.world // (self.pp * self.tp)

    @property
    def dp(self) -> int:
        """The data-parallel degree, SMP's ``dp_size``: tp x rdp (tp is carved out of the data-parallel ranks)."""
        return self.tp * self.rdp

    @property
    def mp(self) -> int:
        """The model-parallel degree, SMP's ``mp_size``: pp x tp."""
        return self.pp * self.tp

    @property
    def order(self) -> str:
        """The placement as a permutation of "D", "P", "T", slowest-varying first."""
        return axis_order(self.placement)

    def _sizes(self) -> dict[str, int]:
        return {"D": self.rdp, "P": self.pp, "T": self.tp}

    def _strides(self) -> dict[str, int]:
        sizes, strides, step = self._sizes(), {}, 1
        for axis in reversed(self.order):
            strides[axis] = step
            step *= sizes[axis]
        return strides

    def _check(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is not in this grid of {self.world} ranks: use 0 .. {self.world - 1}")

    def coordinate(self, rank: int, axis: str) -> int:
        """Global ``rank``'s index along ``axis`` ("P": pp_rank, "T": tp_rank, "D": rdp_rank)."""
        self._check(rank)
        return rank // self._strides()[axis] % self._sizes()[axis]

    def rank_at(self, pp_rank: int = 0, tp_rank: int = 0, rdp_rank: int = 0) -> int:
        """The global rank at these coordinates."""
        coords = {"P": pp_rank, "T": tp_rank, "D": rdp_rank}
        sizes = self._sizes()
        bad = {a: c for a, c in coords.items() if not 0 <= c < sizes[a]}
        if bad:
            raise ValueError(f"coordinates pp_rank={pp_rank}, tp_rank={tp_rank}, rdp_rank={rdp_rank} are not in "
                             f"the grid pp={self.pp} x tp={self.tp} x rdp={self.rdp}")
        strides = self._strides()
        return sum(coords[a] * strides[a] for a in "DPT")

    def _offsets(self, axes: str) -> list[int]:
        """What moving along ``axes`` adds to a rank: the group of rank 0 along them, ascending."""
        sizes, strides = self._sizes(), self._strides()
        varying = [a for a in "DPT" if a in axes]
        return sorted(sum(v * strides[a] for a, v in zip(varying, values))
                      for values in product(*(range(sizes[a]) for a in varying)))

    def group_of(self, rank: int, axes: str) -> list[int]:
        """The global ranks that share every coordinate of ``rank`` but those along ``axes`` (a subset of
        "DPT"), in ascending order."""
        self._check(rank)
        strides = self._strides()
        base = rank - sum(self.coordinate(rank, a) * strides[a] for a in "DPT" if a in axes)
        return [base + o for o in self._offsets(axes)]

    def groups(self, axes: str) -> list[list[int]]:
        """Every group along ``axes`` (see :meth:`group_of`), ordered by their first rank."""
        offsets = self._offsets(axes)
        bases = self._offsets("".join(a for a in "DPT" if a not in axes))
        return sorted([b + o for o in offsets] for b in bases)

    def pipelines(self) -> list[list[int]]:
        """One list per (tp_rank, rdp_rank): the global ranks of that pipeline, in stage order (SMP's
        PP_GROUPs; what a :class:`pipeline.runner.PipelineRunner` takes as ``pipelines``)."""
        return self.groups("P")

    pp_groups = pipelines

    def mp_groups(self) -> list[list[int]]:
        """SMP's MP_GROUPs: the pp x tp ranks holding one model replica, ordered by ``mp_rank``. With tp = 1 these
        are the pipelines, in stage order."""
        return self.groups("PT")

    def tp_groups(self) -> list[list[int]]:
        """SMP's TP_GROUPs: the ranks sharing a stage and a replica, ordered by ``tp_rank``."""
        return self.groups("T")

    def rdp_groups(self) -> list[list[int]]:
        """SMP's RDP_GROUPs: the ranks holding the same shard of the same stage, ordered by ``rdp_rank``."""
        return self.groups("D")

    def dp_groups(self) -> list[list[int]]:
        """SMP's DP_GROUPs, one per stage: the tp x rdp ranks holding that stage, ordered by ``dp_rank``. With
        tp = 1 these are the ranks holding that stage in every replica."""
        return self.groups("DT")

    def sdp_grid(self, sdp: int) -> list[list[list[int]]]:
        """Sharded data parallelism of degree ``sdp``: each reduced-data-parallel group as a grid of
        ``rdp / sdp`` rows (replicas of a whole shard set, SMP's hybrid case when more than one) by ``sdp`` columns
        (a sharding group: consecutive ``rdp_rank``, which share a node's links under the default placement)."""
        return self._replica_rows(sdp, "sharded_data_parallel_degree")

    def ep_grid(self, ep: int) -> list[list[list[int]]]:
        """Expert parallelism of degree ``ep``: each reduced-data-parallel group as rows of ``ep`` consecutive
        ``rdp_rank`` (an ep group: its ranks split every expert layer's experts) over ``rdp / ep`` rows (each column:
        the ranks holding the same experts, which average their gradients)."""
        return self._replica_rows(ep, "expert_parallel_degree")

    def cp_grid(self, cp: int) -> list[list[list[int]]]:
        """Context parallelism of degree ``cp``: each reduced-data-parallel group as rows of ``cp`` consecutive
        ``rdp_rank`` (a cp group: its ranks split every sequence of the batch they share)."""
        return self._replica_rows(cp, "context_parallel_degree")

    def _replica_rows(self, degree: int, key: str) -> list[list[list[int]]]:
        if degree < 1 or self.rdp % degree:
            raise ValueError(f"{key}={degree} must divide the {self.rdp} data-parallel replicas of each stage"
                             f"{' and tensor-parallel shard' if self.tp > 1 else ''} (world {self.world} / "
                             f"(pipeline_parallel_degree={self.pp} x tensor_parallel_degree={self.tp})): launch a "
                             "multiple of the degrees' product or choose a divisor")
        return [[g[i:i + degree] for i in range(0, len(g), degree)] for g in self.rdp_groups()]

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of global ``rank`` (its index in its pipeline)."""
        return self.coordinate(rank, "P")

    def tp_rank(self, rank: int) -> int:
        """Global ``rank``'s index in its tensor-parallel group."""
        return self.coordinate(rank, "T")

    def rdp_rank(self, rank: int) -> int:
        """Which replica of its stage (and tensor-parallel shard) global ``rank`` belongs to."""
        return self.coordinate(rank, "D")

    def dp_rank(self, rank: int) -> int:
        """Global ``rank``'s index in its data-parallel group (``rdp_rank`` when tp = 1)."""
        return self.group_of(rank, "DT").index(rank)

    def mp_rank(self, rank: int) -> int:
        """Global ``rank``'s index in its model-parallel group (``pp_rank`` when tp = 1; see the module docstring)."""
        return self.group_of(rank, "PT").index(rank)
