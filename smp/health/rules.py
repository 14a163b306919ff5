"""The training-health rules: SageMaker Debugger's built-in rules ``loss_not_decreasing``,
``vanishing_gradient``, ``exploding_tensor``, ``weight_update_ratio``, ``overfit`` and
``poor_weight_initialization``, evaluated on the statistics every rank measured (:mod:`smp.health.statistics`).

:func:`aggregate` merges the ranks' statistics into one view of the model (layers and activations in pipeline
order, data-parallel replicas counted once, the loss averaged over the last stages); :class:`HealthRules` keeps what
the rules remember between checks (the loss history, the evaluations) and returns a :class:`Finding` per rule that
fires: which rule, which tensor (by module path), its numbers and what to try. Thresholds and their defaults are
in :mod:`smp.runtime.health_options`. Pure Python over floats: every rank evaluates the same statistics to the
same findings, so every rank takes the same action without another message.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from smp.health.statistics import Layer, RankStatistics
from smp.runtime.health_options import DebugOptions

__all__ = ["Finding", "Model", "aggregate", "HealthRules", "EVAL_LOSS"]

EVAL_LOSS = "eval_loss"  # the name smp.debug.log gives the evaluation loss the Overfit rule reads


@dataclass(frozen=True)
class Finding:
    """A rule that fired at a step: on which tensor, with which numbers, and what to try."""

    rule: str
    step: int
    tensor: str
    numbers: str
    advice: str

    def message(self) -> str:
        """One line for the log: rule, tensor, numbers, advice."""
        return f"{self.rule} at step {self.step}: {self.tensor}: {self.numbers}; {self.advice}"


@dataclass
class Model:
    """The whole model's statistics at one check, merged over ranks."""

    layers: list[Layer] = field(default_factory=list)
    updates: dict[str, float] = field(default_factory=dict)
    activations: list[tuple[str, str, float]] = field(default_factory=list)
    loss: float | None = None
    logged: dict[str, float] = field(default_factory=dict)


def aggregate(stats: list[RankStatistics]) -> Model:
    """One view of the model from every rank's statistics (replicas of a stage give the same layers: the first
    is kept; the losses of every replica's last stage are averaged)."""
    model = Model()
    seen: set[str] = set()
    acts: set[tuple[str, str]] = set()
    logged: dict[str, list[float]] = {}
    losses: list[float] = []
    for s in sorted(stats, key=lambda s: (s.stage, s.rank)):
        for layer in s.layers:
            if layer.path not in seen:
                seen.add(layer.path)
                model.layers.append(layer)
        for path, ratio in s.updates.items():
            model.updates.setdefault(path, ratio)
        for path, kind, var in s.activations:
            if (path, kind) not in acts:
                acts.add((path, kind))
                model.activations.append((path, kind, var))
        losses += s.losses
        for name, value in s.logged.items():
            logged.setdefault(name, []).append(value)
    model.loss = sum(losses) / len(losses) if losses else None
    model.logged = {k: sum(v) / len(v) for k, v in logged.items()}
    return model


def _g(x: float) -> str:
    return f"{x:.3g}"


class HealthRules:
    """The configured rules and their memory across checks."""

    def __init__(self, options: DebugOptions) -> None:
        self.options = options
        self.losses: list[float] = []   # the training loss at each check
        self.overfit_streak = 0         # consecutive evaluations above the training loss by the ratio
        self.checks: dict[str, Callable[[int, Model, dict[str, float]], Finding | None]] = {
            "ExplodingTensor": self.exploding_tensor, "LossNotDecreasing": self.loss_not_decreasing,
            "VanishingGradient": self.vanishing_gradient, "WeightUpdateRatio": self.weight_update_ratio,
            "Overfit": self.overfit, "PoorWeightInitialization": self.poor_weight_initialization}

    def evaluate(self, step: int, model: Model) -> list[Finding]:
        """The findings of every configured rule at ``step`` (0-based training step)."""
        found = [self.checks[name](step, model, t) for name, t in self.options.rules.items()]
        if model.loss is not None:
            self.losses.append(model.loss)
        return [f for f in found if f is not None]

    def exploding_tensor(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """NaN/Inf (or an RMS above ``max_rms``) in the loss, an activation, a gradient or a weight; the first in
        forward order names where it starts."""
        advice = ("lower the learning rate, clip gradients (optimizer.clip_master_grads or "
                  "torch.nn.utils.clip_grad_norm_), or look for a division by zero / log of zero there")
        def bad(rms: float) -> bool:
            return not math.isfinite(rms) or rms > t["max_rms"]

        for path, kind, var in m.activations:
            if bad(math.sqrt(var) if var >= 0 else var):  # NaN compares False: stays NaN
                return Finding("ExplodingTensor", step, f"{'output' if kind == 'layer' else 'activation'} of {path}",
                               f"variance {_g(var)}", advice)
        if m.loss is not None and not math.isfinite(m.loss):
            return Finding("ExplodingTensor", step, "loss", f"loss {_g(m.loss)}", advice)
        for what, value in (("gradient", lambda x: x.grad_rms),
                            ("weight", lambda x: x.weight_norm / x.numel ** 0.5 if x.weight_norm is not None else 0.0)):
            for layer in m.layers:
                if bad(value(layer)):
                    norm = layer.grad_norm if what == "gradient" else layer.weight_norm or 0.0
                    return Finding("ExplodingTensor", step, f"{what} of {layer.path}", f"RMS {_g(value(layer))} "
                                   f"(norm {_g(norm)})", advice)
        return None

    def loss_not_decreasing(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """The mean loss of the last ``window`` checks is not ``min_decrease`` (relative) below the window before."""
        w = int(t["window"])
        losses = self.losses + ([m.loss] if m.loss is not None else [])
        if len(losses) < 2 * w:
            return None
        before, now = sum(losses[-2 * w:-w]) / w, sum(losses[-w:]) / w
        if math.isfinite(before) and math.isfinite(now) and now <= before - t["min_decrease"] * abs(before):
            return None
        return Finding("LossNotDecreasing", step, "loss", f"mean of the last {w} checks {_g(now)} vs {_g(before)} "
                       f"before (a decrease of at least {t['min_decrease']:.3%} expected)",
                       "if it stalls, raise the learning rate or check that the optimizer steps the model's "
                       "parameters; if it grows, lower the learning rate")

    def vanishing_gradient(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """A layer's gradient RMS below ``threshold``; the last such layer in forward order is where the gradient
        stops flowing back (every layer before it is starved too)."""
        low = [layer for layer in m.layers if layer.grad_rms < t["threshold"]]
        if not low:
            return None
        at = low[-1]
        also = f" ({len(low) - 1} earlier layer(s) too)" if len(low) > 1 else ""
        return Finding("VanishingGradient", step, f"gradient of {at.path}",
                       f"RMS {_g(at.grad_rms)} < {_g(t['threshold'])}{also}",
                       "look for a detach(), a saturated activation or a tiny scale at that layer; use residual "
                       "connections, normalisation or a better initialisation")

    def weight_update_ratio(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """||update|| / ||weight|| of a layer outside [``small``, ``large``] on the last measured optimizer step
        (layers without a gradient are VanishingGradient's)."""
        grads = {layer.path: layer.grad_norm for layer in m.layers}
        for path, ratio in m.updates.items():
            if grads.get(path, 1.0) == 0.0:
                continue
            if not (t["small"] <= ratio <= t["large"]):  # NaN fails both
                side = "large" if not ratio < t["large"] else "small"
                return Finding("WeightUpdateRatio", step, f"weights of {path}",
                               f"||update|| / ||weight|| = {_g(ratio)} outside [{_g(t['small'])}, {_g(t['large'])}]",
                               f"the update is too {side}: {'lower' if side == 'large' else 'raise'} the learning "
                               "rate (or check the learning-rate schedule and the gradient scale)")
        return None

    def overfit(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """The evaluation loss logged with ``smp.debug.log("eval_loss", v)`` above the recent training loss by more
        than ``ratio`` (relative) for ``patience`` evaluations in a row."""
        ev = m.logged.get(EVAL_LOSS)
        recent = (self.losses + ([m.loss] if m.loss is not None else []))[-10:]
        if ev is None or not recent:
            return None
        train = sum(recent) / len(recent)
        gap = (ev - train) / abs(train) if train else math.inf
        self.overfit_streak = self.overfit_streak + 1 if gap > t["ratio"] else 0
        if self.overfit_streak < t["patience"]:
            return None
        return Finding("Overfit", step, "evaluation loss", f"{_g(ev)} vs training loss {_g(train)} ({gap:+.1%}, "
                       f"{self.overfit_streak} evaluations in a row above {t['ratio']:.0%})",
                       "stop early (keep the best checkpoint), add regularisation (weight decay, dropout) or data")

    def poor_weight_initialization(self, step: int, m: Model, t: dict[str, float]) -> Finding | None:
        """In the first ``steps`` steps, layer outputs whose variance changes by more than ``max_growth``x per layer
        on average (a least-squares slope of log variance over the layers in forward order)."""
        var = [(path, v) for path, kind, v in m.activations if kind == "layer" and math.isfinite(v)]
        if step >= t["steps"] or len(var) < 3:
            return None
        logs = [math.log10(max(v, 1e-30)) for _, v in var]
        n = len(logs)
        mean_i, mean_l = (n - 1) / 2, sum(logs) / n
        slope = sum((i - mean_i) * (v - mean_l) for i, v in enumerate(logs)) / sum((i - mean_i) ** 2 for i in range(n))
        if abs(slope) <= math.log10(t["max_growth"]):
            return None
        way = "grows" if slope > 0 else "collapses"
        return Finding("PoorWeightInitialization", step, f"outputs of {var[0][0]} .. {var[-1][0]}",
                       f"activation variance {way} {10 ** abs(slope):.3g}x per layer on average ({_g(var[0][1])} "
                       f"at the first layer, {_g(var[-1][1])} at the last; limit {_g(t['max_growth'])}x)",
                       "initialise weights with a fan-in scale (torch.nn.init.kaiming_normal_ / xavier_normal_, "
                       "or the model's own init) or add normalisation layers")
