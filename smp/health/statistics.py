"""What each rank measures for the training-health rules: cheap statistics of what it holds.

SageMaker Debugger saves tensors and its built-in rules read them back; here each rank reduces what it holds to a
few floats per layer (a layer is a module that holds parameters, named by its module path): the gradient norm and
the weight norm (``torch._foreach_norm``: one kernel per list, no copies), the number of elements (for an RMS),
the ratio ||update|| / ||weight|| of the last optimizer step that followed a check (:class:`UpdateProbe`: the only
statistic that needs a copy, of this rank's weights, on those steps only), the activation variances of
:mod:`smp.health.activations`, and on the last stage the step's microbatch losses. Everything stays on the
device until :func:`measure` reads it back in one transfer, as a plain, picklable :class:`RankStatistics`.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

__all__ = ["RankStatistics", "Layer", "measure", "UpdateProbe", "layer_of"]


@dataclass
class Layer:
    """One layer's numbers on one rank (norms over all its parameters)."""

    path: str
    grad_norm: float
    weight_norm: float | None  # None on checks that do not read the weights (see measure)
    numel: int

    @property
    def grad_rms(self) -> float:
        """Root mean square of the gradient: comparable across layers of different sizes."""
        return self.grad_norm / max(self.numel, 1) ** 0.5


@dataclass
class RankStatistics:
    """What one rank measured at one check (plain floats: gathered to every rank as an object)."""

    rank: int
    stage: int                   # this rank's pipeline position: layers and activations are ordered by it
    layers: list[Layer] = field(default_factory=list)                     # in the model's definition order
    updates: dict[str, float] = field(default_factory=dict)               # layer -> ||update|| / ||weight||
    activations: list[tuple[str, str, float]] = field(default_factory=list)  # (path, "layer"/"boundary", variance)
    losses: list[float] = field(default_factory=list)                     # last stage: per microbatch
    logged: dict[str, float] = field(default_factory=dict)                # smp.debug.log(name, value) since last


def layer_of(name: str) -> str:
    """The module path of parameter ``name`` ("(model)" for a parameter of the root module)."""
    return name.rpartition(".")[0] or "(model)"


def _grouped(named: Iterable[tuple[str, torch.nn.Parameter]]) -> tuple[list[str], list[int], list[torch.nn.Parameter]]:
    paths: list[str] = []
    index: list[int] = []
    params: list[torch.nn.Parameter] = []
    where: dict[str, int] = {}
    for name, p in named:
        if not p.requires_grad:
            continue
        path = layer_of(name)
        if path not in where:
            where[path] = len(paths)
            paths.append(path)
        index.append(where[path])
        params.append(p)
    return paths, index, params


def _per_layer(norms: list[torch.Tensor], index: list[int], layers: int, device: torch.device) -> torch.Tensor:
    """sqrt of the summed squares of parameter norms, per layer (float64: squares of large norms stay finite). The
    norm of a sharded parameter (a DTensor, sharded data parallelism) is put together over its sharding group, a
    collective every replica of the stage makes in the same order."""
    out = torch.zeros(layers, dtype=torch.float64, device=device)
    if norms:
        whole = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        squares = torch.stack([n.to(device, torch.float64) for n in whole]).square()
        out.index_add_(0, torch.tensor(index, device=device), squares)
    return out.sqrt()


def measure(rank: int, stage: int, named: Iterable[tuple[str, torch.nn.Parameter]], losses: list[torch.Tensor],
            activations: list[tuple[str, str, torch.Tensor]], updates: dict[str, float],
            device: torch.device, weights: bool = True) -> RankStatistics:
    """This rank's statistics after a training step. A parameter without a gradient counts as a zero gradient:
    after a backward, only a graph cut (``detach()``) or an unused layer leaves it so. ``weights=False`` skips the
    weight norms (a pass over every weight): weights go bad only through an update, which the gradients and the
    loss of the same check already show."""
    paths, index, params = _grouped(named)
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    grad_norms = torch._foreach_norm([g for g in (params[i].grad for i in with_grad) if g is not None]) \
        if with_grad else []
    weight_norms = torch._foreach_norm([p.detach() for p in params]) if params and weights else []
    parts = [_per_layer(list(grad_norms), [index[i] for i in with_grad], len(paths), device),
             _per_layer(list(weight_norms), index, len(paths), device),
             torch.stack([v.to(device, torch.float64) for _, _, v in activations]) if activations else None,
             torch.stack([loss.to(device, torch.float64).reshape(()) for loss in losses]) if losses else None]
    values = torch.cat([p for p in parts if p is not None]).tolist()  # the check's one device-to-host copy
    n = len(paths)
    numel = [0] * n
    for i, p in zip(index, params):
        numel[i] += p.numel()
    layers = [Layer(path, values[i], values[n + i] if weights else None, numel[i]) for i, path in enumerate(paths)]
    acts = [(path, kind, v) for (path, kind, _), v in zip(activations, values[2 * n:2 * n + len(activations)])]
    return RankStatistics(rank=rank, stage=stage, layers=layers, updates=dict(updates), activations=acts,
                          losses=values[2 * n + len(activations):])


class UpdateProbe:
    """||update|| / ||weight|| per layer over one optimizer step, measured only when asked (a check step)."""

    def __init__(self) -> None:
        self.ratios: dict[str, float] = {}  # from the last measured step, until a check takes them

    @contextmanager
    def around_step(self, named: Iterable[tuple[str, torch.nn.Parameter]], device: torch.device) -> Iterator[None]:
        """Snapshot the weights, let the optimizer step inside the block, keep the per-layer ratios."""
        paths, index, params = _grouped(named)
        before = [p.detach().clone() for p in params]
        yield
        if not params:
            return
        deltas = torch._foreach_sub([p.detach() for p in params], before)
        update = _per_layer(list(torch._foreach_norm(deltas)), index, len(paths), device)
        weight = _per_layer(list(torch._foreach_norm(before)), index, len(paths), device)
        del before, deltas
        ratio = (update / weight.clamp_min(1e-30)).tolist()
        self.ratios = dict(zip(paths, ratio))

    def take(self) -> dict[str, float]:
        """The ratios measured since the last check (and forget them)."""
        ratios, self.ratios = self.ratios, {}
        return ratios
