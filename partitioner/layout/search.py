"""The layout search: every way to run a model on N devices, pruned with bounds, the best K priced exactly.

The space (:class:`SearchSpace`, enumerated by :func:`candidates`): pp x tp x dp = N with tp dividing the ranks of a
node (and the model's attention heads), dp dividing the global batch; for each, every microbatch size dividing a
replica's batch (the microbatch count follows), every schedule (interleaved with v virtual stages only where the
microbatches fill rounds of pp), activation checkpointing, ZeRO-1 and the placement of the axes where they make a
difference (ZeRO-1 and placement need dp > 1), and the sharded data-parallel degree sdp (every divisor of dp; above 1
only without ZeRO-1, which it subsumes, and only where it shards some parameter: a degree that shards nothing is the
same layout under another name, :mod:`partitioner.layout.sharded`), and for a mixture-of-experts model the
expert-parallel degree ep (every divisor of dp that divides every layer's experts, :mod:`partitioner.layout.experts`;
above 1 only with sdp 1 and without ZeRO-1: the runtime refuses ep with sdp, and ZeRO-1 would shard the optimizer
state over replicas whose experts differ), and for a model whose sequence an embedding of its ids says, the
context-parallel degree cp (every divisor of dp that divides the sequence, by default only for sequences of
:data:`LONG_SEQUENCE` tokens or more: below, attention's share of the activations is small and tp with sequence
parallelism shrinks the rest; above 1 only with sdp and ep 1, as the runtime allows; a cp group runs one replica's
share of the batch, so dp / cp replicas divide it).

:func:`search` is a branch and bound over that list, as Alpa (Zheng et al. OSDI'22) and Aceso (Liu et al.
EuroSys'24) prune theirs: a layout whose lower bound on the largest device's memory exceeds the budget (the device's
less the headroom kept free for the allocator, :mod:`partitioner.layout.headroom`) is dropped unpriced, the rest
are priced (:meth:`partitioner.layout.score.LayoutScorer.score`: partition, simulate) in order of their optimistic
estimate, a layout whose lower bound on the step is no better than the K-th best priced so far is
skipped (before it is partitioned, then again before it is simulated, with the bound its cut stages give:
:meth:`partitioner.layout.score.LayoutScorer.plan_bound`), and the walk stops once the estimate itself reaches
the K-th best (``exhaustive=True`` walks on: the bounds alone are then exact, so the result is the K best of the
whole space); the memory bound comes first, as a layout over the budget needs no estimate. The exposed
communication, a second simulation, is priced for the proposals returned alone. Only layouts that fit are returned.
When none fits, :class:`NoLayoutFitsError` says what would: more devices, checkpointing, ZeRO-1, sharded data
parallelism (the least degree with which the closest layout fits, priced), less headroom, a smaller batch.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import EngineError
from ..units import format_bytes
from .costs import collector_paused
from .experts import ep_choices
from .layout import CHECKPOINTING, PLACEMENTS, Layout, Proposal
from .score import LayoutScorer
from .sharded import shards_nothing

__all__ = ["SearchSpace", "SearchResult", "NoLayoutFitsError", "candidates", "search", "divisors", "tp_choices",
           "cp_choices", "LONG_SEQUENCE"]

LONG_SEQUENCE = 16384  # tokens per sequence from which context parallelism is searched unless asked for


class NoLayoutFitsError(EngineError, ValueError):
    """No layout of the space fits the memory budget; the message gives the closest and what would fit."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def cp_choices(dp: int, sequence: int | None, asked: tuple[int, ...] | None = None) -> list[int]:
    """The context-parallel degrees of ``dp`` replicas for sequences of ``sequence`` tokens (None: the model's are
    unknown, 1 only): the divisors of ``dp`` that divide the sequence, those ``asked`` for, else 1 and, from
    :data:`LONG_SEQUENCE` tokens, every one."""
    if sequence is None:
        return [1]
    return [c for c in divisors(dp) if sequence % c == 0
            and (c in asked if asked is not None else c == 1 or sequence >= LONG_SEQUENCE)]


def tp_choices(devices: int, ranks_per_node: int, heads: Iterable[int] = ()) -> list[int]:
    """The tp degrees to try: dividing the devices and the ranks of a node (a tp group shares a node's links, as
    ``smp simulate --tp`` requires) and every head count in ``heads``."""
    return [t for t in divisors(ranks_per_node) if devices % t == 0 and all(h % t == 0 for h in heads)]


@dataclass(frozen=True)
class SearchSpace:
    """What to search: ``devices`` and the ``global_batch`` (samples per step), with ``ranks_per_node``. Each tuple
    lists the values to try; ``tp``, ``pp``, ``dp``, ``microbatch_size``, ``sdp`` and ``ep`` None: every value that
    divides (:func:`candidates`; sdp and ep divide dp, ep the experts); ``cp`` None: :func:`cp_choices`'
    default. ``max_stages``: the most stages the model can be cut into (its ops)."""

    devices: int
    global_batch: int
    ranks_per_node: int
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    microbatch_size: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    virtual_stages: tuple[int, ...] = (2,)
    checkpointing: tuple[str, ...] = CHECKPOINTING
    zero1: tuple[bool, ...] = (False, True)
    placements: tuple[str, ...] = PLACEMENTS
    sdp: tuple[int, ...] | None = None
    max_stages: int | None = None
    ep: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("devices", "global_batch", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SearchSpace.{name} must be a positive integer, got {value!r}")


def _allowed(values: tuple[int, ...] | None, x: int) -> bool:
    return values is None or x in values


def candidates(space: SearchSpace, tp_degrees: Iterable[int], unsharded: Collection[int] = (),
               experts: Sequence[int] = (), sequence: int | None = None) -> Iterator[Layout]:
    """Every layout of ``space`` with a tp degree of ``tp_degrees`` (those the model can shard), in a fixed order;
    with a tp degree of ``unsharded`` (where sdp would shard nothing: :func:`partitioner.layout.sharded.unsharded_tps`)
    only sdp 1; ``experts``: of each mixture-of-experts layer (:attr:`partitioner.layout.costs.LayoutCosts.experts`;
    none: ep 1 only); ``sequence``: the tokens per sequence context parallelism splits (None: cp 1 only)."""
    n, batch = space.devices, space.global_batch
    most = space.max_stages or n
    for tp in sorted(t for t in set(tp_degrees) if _allowed(space.tp, t) and n % t == 0):
        for pp in (p for p in divisors(n // tp) if _allowed(space.pp, p) and p <= most):
            dp = n // (tp * pp)
            if not _allowed(space.dp, dp):
                continue
            for cp in (c for c in cp_choices(dp, sequence, space.cp) if batch % (dp // c) == 0):
                groups = dp // cp  # the replicas with a batch of their own
                for size in (s for s in divisors(batch // groups) if _allowed(space.microbatch_size, s)):
                    for ep in (e for e in ep_choices(dp, experts) if _allowed(space.ep, e) and (cp == 1 or e == 1)):
                        yield from _variants(space, pp, tp, dp, size, batch // groups // size, most, tp in unsharded,
                                             ep, cp)


def _variants(space: SearchSpace, pp: int, tp: int, dp: int, size: int, m: int, most: int,
              unsharded: bool = False, ep: int = 1, cp: int = 1) -> Iterator[Layout]:
    """The schedule, checkpointing, ZeRO-1, placement and sdp variants of one grid and microbatching, those that
    differ: with one stage, 1F1B, GPipe and ZB-H1 are one schedule (with one microbatch, 1F1B and GPipe are), and
    interleaving needs stages to interleave; ZeRO-1 needs dp > 1, the
    placement pp > 1, dp > 1 and more than one node."""
    same = {"1f1b", "gpipe", "zero-bubble"} if pp == 1 else {"1f1b", "gpipe"} if m == 1 else set()
    schedules: list[str] = []
    for name in space.schedules:  # the first of the schedules that are the same stands for them all
        if not (name in same and same & set(schedules)) and not (pp == 1 and name == "interleaved-virtual"):
            schedules.append(name)
    placements = space.placements if pp > 1 and dp > 1 and space.devices > space.ranks_per_node \
        else space.placements[:1]
    for schedule in schedules:
        vs = ([v for v in space.virtual_stages if v > 1 and pp * v <= most and m % pp == 0]
              if schedule == "interleaved-virtual" else [1])
        for v in vs:
            for ckpt in space.checkpointing:
                for zero1 in (z for z in (space.zero1 if dp > 1 else (False,)) if not (z and ep > 1)):
                    for placement in placements:
                        for sdp in (s for s in divisors(dp) if _allowed(space.sdp, s)
                                    and not ((zero1 or unsharded or ep > 1 or cp > 1) and s > 1)):
                            yield Layout(pp=pp, tp=tp, dp=dp, microbatch_size=size, microbatches=m, schedule=schedule,
                                         virtual_stages=v, checkpointing=ckpt, zero1=zero1, placement=placement,
                                         sdp=sdp, ep=ep, cp=cp)


@dataclass
class SearchResult:
    """The best layouts that fit (best first), and what the search did: layouts ``enumerated``, dropped by the
    memory bound (``memory_pruned``), skipped by the step bound or the estimate (``bound_pruned``), dropped because
    their sdp would shard nothing with their cut (``unsharded``: their sdp 1 twin under another name), ``scored``
    exactly, and the stage partitions made (``partitions``)."""

    proposals: list[Proposal] = field(default_factory=list)
    enumerated: int = 0
    memory_pruned: int = 0
    bound_pruned: int = 0
    scored: int = 0
    partitions: int = 0
    unsharded: int = 0


def _order(lay: Layout) -> tuple:
    """A fixed order of layouts, for ties."""
    return (lay.pp, lay.tp, lay.dp, lay.microbatch_size, lay.schedule, lay.virtual_stages, lay.checkpointing,
            lay.zero1, lay.placement, lay.sdp, lay.ep, lay.cp)


def _key(p: Proposal) -> tuple:
    """Best first: the shortest step, then the least memory, then :func:`_order`."""
    return (p.score.step_s, p.score.memory_bytes, *_order(p.layout))


def search(layouts: Iterable[Layout], scorer: LayoutScorer, top: int = 5, *, exhaustive: bool = False) -> SearchResult:
    """The ``top`` best layouts among ``layouts`` that fit ``scorer``'s budget (module docstring); raises
    :class:`NoLayoutFitsError` when none does."""
    if top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    with collector_paused():  # thousands of layouts' bounds and plans, and hardly a reference cycle among them
        return _search(layouts, scorer, top, exhaustive)


def _search(layouts: Iterable[Layout], scorer: LayoutScorer, top: int, exhaustive: bool) -> SearchResult:
    """:func:`search`, its ``top`` checked."""
    budget = scorer.budget
    result = SearchResult()
    queue = []
    least: tuple[float, Layout] | None = None  # the lowest memory bound of any layout: what no layout beats
    tried: set[object] = set()  # checkpointing, ZeRO-1 and sdp settings the space has
    for lay in layouts:
        result.enumerated += 1
        tried.update((lay.checkpointing, lay.zero1, ("sdp", lay.sdp)))
        memory = scorer.memory_bound(lay)  # first: the estimate of a layout over the budget is not needed
        if least is None or memory < least[0]:
            least = (memory, lay)
        if budget is not None and memory > budget:
            result.memory_pruned += 1
            continue
        b = scorer.bound(lay)
        queue.append((b.estimate_s, b.step_s, lay))
    queue.sort(key=lambda q: (q[0], q[1], _order(q[2])))
    best: list[Proposal] = []
    closest: Proposal | None = None  # priced but too big: the one nearest to fitting
    for i, (estimate, bound, lay) in enumerate(queue):
        kth = best[top - 1].score.step_s if len(best) >= top else math.inf
        if not exhaustive and estimate >= kth < math.inf:
            result.bound_pruned += len(queue) - i
            break
        if bound >= kth:
            result.bound_pruned += 1
            continue
        if lay.sdp > 1 and shards_nothing(lay, scorer.plan(lay), scorer.costs.graph(lay.tp, lay.microbatch_size),
                                          scorer.pricing.sdp_threshold):
            result.unsharded += 1
            continue
        if kth < math.inf and scorer.plan_bound(lay) >= kth:  # its stages, cut, cannot beat the K-th best
            result.bound_pruned += 1
            continue
        score = scorer.score(lay, exposed=False)  # what only the proposals print is added to them alone
        result.scored += 1
        if not score.fits:
            if closest is None or score.memory_bytes < closest.score.memory_bytes:
                closest = Proposal(lay, score)
            continue
        best = sorted([*best, Proposal(lay, score)], key=_key)[:top]
    result.proposals, result.partitions = [Proposal(p.layout, scorer.exposed(p.layout, p.score)) for p in best], \
        scorer.partitions
    if not best:
        raise NoLayoutFitsError(_no_fit(budget, least, closest, tried, scorer))
    return result


def _no_fit(budget: float | None, least: tuple[float, Layout] | None, closest: Proposal | None,
            tried: set[object], scorer: LayoutScorer) -> str:
    """What to say when nothing fits: the closest layout, its memory by kind, and what would fit (what the space
    did not try among them; sharded data parallelism only with a degree that makes the closest layout fit)."""
    if least is None:
        return ("no layout to search: no grid pp x tp x dp of these devices divides the global batch and the model; "
                "change --devices, --global-batch or the fixed degrees")
    cap = f"{format_bytes(budget or 0)} per device"
    device, headroom = scorer.device_budget, scorer.pricing.headroom
    if device is not None and budget is not None and device > budget:
        cap += f" ({format_bytes(device)} less {headroom.describe()} kept free for the allocator)"
    if closest is not None:
        lay, s = closest.layout, closest.score
        need = (f"the closest, {lay.describe()}, needs {_size(s.memory_bytes)} (parameter state "
                f"{_size(s.parameter_bytes)}, activations {_size(s.activation_bytes)})")
        ratio = s.memory_bytes / (budget or 1)
        acts = s.activation_bytes > s.parameter_bytes
    else:
        lay = least[1]
        need = f"every layout needs at least {_size(least[0])} on its largest device ({lay.describe()})"
        ratio, acts = least[0] / (budget or 1), False
    devices = lay.devices * 2 ** math.ceil(math.log2(max(ratio, 1.0) * 1.05))
    ideas = [f"more devices (about {devices}: more pipeline stages and tensor parallelism share the parameters)"]
    if "full" not in tried:
        ideas.append("activation checkpointing")
    if True not in tried:
        ideas.append("ZeRO-1 (the optimizer state sharded over the dp replicas)")
    sdp = _sdp_that_fits(lay, tried, scorer)
    if sdp is not None:
        ideas.append(f"sharded data parallelism of degree {sdp.layout.sdp} (sharded_data_parallel_degree: "
                     f"{sdp.layout.describe()} needs {_size(sdp.score.memory_bytes)})")
    need_bytes = closest.score.memory_bytes if closest is not None else least[0]
    if device is not None and budget is not None and need_bytes <= device:
        ideas.append(f"less memory headroom: it would leave {100 * (1 - need_bytes / device):.0f}% of the device's "
                     f"{format_bytes(device)} free, where {headroom.describe()} is kept (at the risk of running out "
                     "of memory)")
    ideas.append("a smaller global batch or microbatch" + (" (activations are most of it)" if acts else ""))
    ideas.append("a cheaper optimizer (sgd) or a device with more memory")
    return f"no layout fits {cap}: {need}. What would fit: " + "; ".join(ideas)


def _sdp_that_fits(lay: Layout, tried: set[object], scorer: LayoutScorer) -> Proposal | None:
    """``lay`` with the least sharded data-parallel degree the space did not try that makes it fit, priced; None
    when none does."""
    for d in divisors(lay.dp)[1:] if lay.cp == 1 else []:  # the runtime refuses cp with sdp
        if ("sdp", d) not in tried:
            sharded = dataclasses.replace(lay, sdp=d, zero1=False, ep=1)  # the runtime refuses ep with sdp
            if shards_nothing(sharded, scorer.plan(sharded), scorer.costs.graph(lay.tp, lay.microbatch_size),
                              scorer.pricing.sdp_threshold):
                return None
            score = scorer.score(sharded)
            if score.fits:
                return Proposal(sharded, score)
    return None


def _size(x: float) -> str:
    return format_bytes(x, digits=3)
