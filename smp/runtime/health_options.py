"""What a user may set of the training-health rules (the config's ``"debug"`` key and ``smp.debug(...)``).

The rules are SageMaker Debugger's built-in rules for training health (``loss_not_decreasing``,
``vanishing_gradient``, ``exploding_tensor``, ``weight_update_ratio``, ``overfit``,
``poor_weight_initialization``); :mod:`smp.health.rules` evaluates them. This module only names them, holds their
default thresholds and checks a configuration, so that a typo fails at ``smp.init`` with the valid names:

    "debug": {"rules": ["LossNotDecreasing", {"rule": "VanishingGradient", "threshold": 1e-8}],
              "every_n_steps": 1, "action": "stop"}

A rule given by name keeps its defaults; given as a dict, the keys other than ``"rule"`` override them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RULE_DEFAULTS", "ACTIONS", "DebugOptions", "debug_options", "STOP_EXIT_STATUS", "STOP_FILE_ENV"]

# The exit status of every rank of a job that a rule with "action": "stop" ended (docs/health.md). `smp launch`
# does not restart such a job: each rank also writes its reason to the file STOP_FILE_ENV names, when set.
STOP_EXIT_STATUS = 79
STOP_FILE_ENV = "SMP_HEALTH_STOP_FILE"

# Rule -> its thresholds and their defaults (docs/health.md says what each one measures).
RULE_DEFAULTS: dict[str, dict[str, float]] = {
    # the mean loss of the last `window` checks is not below that of the `window` before by `min_decrease` (relative)
    "LossNotDecreasing": {"window": 10, "min_decrease": 0.001},
    # a layer's gradient RMS (norm / sqrt(numel)) below `threshold` (SageMaker's default, 1e-7)
    "VanishingGradient": {"threshold": 1e-7},
    # NaN or Inf in the loss, a layer's activations, gradient or weights; or a value's RMS above `max_rms`
    "ExplodingTensor": {"max_rms": 1e8},
    # ||update|| / ||weight|| of a layer outside [small, large] (SageMaker's 1e-8 and 10)
    # measured on the optimizer step after one check in `every`: a measurement copies the weights (a pass over
    # them, a few % of a step), and the ratio moves slowly (SageMaker saves the tensors every 500 steps)
    "WeightUpdateRatio": {"small": 1e-8, "large": 10.0, "every": 10},
    # (evaluation loss - training loss) / training loss above `ratio` for `patience` logged evaluations
    "Overfit": {"ratio": 0.1, "patience": 3},
    # activation variance changing by more than `max_growth`x per layer (either way) in the first `steps` steps
    "PoorWeightInitialization": {"max_growth": 10.0, "steps": 10},
}
ACTIONS = ("warn", "stop")
_INTEGER = {"window", "patience", "steps", "every"}


@dataclass(frozen=True)
class DebugOptions:
    """Checked training-health options: the rules (name -> thresholds), how often, and what a finding does."""

    rules: dict[str, dict[str, float]] = field(default_factory=lambda: {k: dict(v) for k, v in RULE_DEFAULTS.items()})
    every_n_steps: int = 1
    action: str = "warn"


def _fail(what: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{what}={value!r} is not valid: {allowed}")


def _rule(spec: Any) -> tuple[str, dict[str, float]]:
    given = {"rule": spec} if isinstance(spec, str) else spec
    if not isinstance(given, dict) or given.get("rule") not in RULE_DEFAULTS:
        _fail("rule", spec, f"a rule name or a dict {{'rule': NAME, THRESHOLD: VALUE, ...}}; names: "
                            f"{sorted(RULE_DEFAULTS)}")
    name: str = given["rule"]
    thresholds = dict(RULE_DEFAULTS[name])
    for key, value in given.items():
        if key == "rule":
            continue
        if key not in thresholds:
            _fail(f"{name} threshold {key!r}", value, f"{name} has thresholds {sorted(thresholds)}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        if not ok or (key in _INTEGER and (int(value) != value or value < 1)):
            _fail(f"{name} threshold {key!r}", value, "a positive integer" if key in _INTEGER else "a number >= 0")
        thresholds[key] = float(value)
    return name, thresholds


def debug_options(value: dict | None) -> DebugOptions | None:
    """The ``"debug"`` key (or ``smp.debug``'s arguments) as :class:`DebugOptions`; ValueError names what is wrong.
    ``"rules"`` defaults to all six rules."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"rules", "every_n_steps", "action"}:
        _fail("'debug'", value, "a dict with keys 'rules', 'every_n_steps', 'action', such as "
                                '{"rules": ["LossNotDecreasing"], "every_n_steps": 1, "action": "warn"}')
    specs = value.get("rules", list(RULE_DEFAULTS))
    if not isinstance(specs, (list, tuple)) or not specs:
        _fail("'rules'", specs, f"a non-empty list of rule names or dicts; names: {sorted(RULE_DEFAULTS)}")
    every = value.get("every_n_steps", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        _fail("'every_n_steps'", every, "a positive integer: check the rules every N training steps")
    action = value.get("action", "warn")
    if action not in ACTIONS:
        _fail("'action'", action, f"one of {ACTIONS}: 'stop' ends the job on every rank when a rule fires")
    return DebugOptions(rules=dict(_rule(s) for s in specs), every_n_steps=every, action=action)
