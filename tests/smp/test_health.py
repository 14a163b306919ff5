"""Training-health rules (smp.health, ``smp.debug``): the rules on synthetic statistics, and real 1-rank runs
with faults that must fire them (and a healthy one that must not); the stop action on 2 ranks (slow)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.health.rules import HealthRules, Model, aggregate
from smp.health.statistics import Layer, RankStatistics
from smp.runtime.config import ConfigError, load_config
from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV, debug_options
from smp.testing import run_ranks


class Net(nn.Module):
    """Four linear layers; ``fault`` scales fc2's gradient by 1e-6, cuts the graph after fc2, or makes the
    weights 100x too large."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.fault = fault
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(a, b) for a, b in ((16, 64), (64, 64), (64, 64), (64, 4)))
        if fault == "init":
            with torch.no_grad():
                for p in self.parameters():
                    p.mul_(100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.relu(self.fc1(x)))
        if self.fault == "scale":  # identity forward, gradient x 1e-6 (a custom autograd.Function's backward is
            x = x * 1e-6 + (x - x * 1e-6).detach()  # not kept by the trace, so the straight-through form)
        elif self.fault == "detach":
            x = x.detach()
        return self.fc4(F.relu(self.fc3(F.relu(x))))


def _train(fault: str | None, lr: float, steps: int, debug: dict, eval_loss: float | None = None) -> list[str]:
    import smp
    from smp.runtime import state

    state.reset()
    smp.init({"pipeline_parallel_degree": 1, "debug": debug})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net(fault))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=g)
    y = torch.tanh(x[:, :4] * 2)  # learnable

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for _ in range(steps):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
        if eval_loss is not None:
            smp.debug.log("eval_loss", eval_loss)
    return [f.message() for f in state.get().health.findings]


def _scenarios(rank: int, world: int) -> dict[str, object]:
    every = {"every_n_steps": 1}
    out: dict[str, object] = {
        "lr1e3": _train(None, 1e3, 6, {**every, "rules": ["ExplodingTensor", "LossNotDecreasing"]}),
        "lr1e-7": _train(None, 1e-7, 8, {**every, "rules": [{"rule": "LossNotDecreasing", "window": 3}]}),
        "scale": _train("scale", 0.05, 2, {**every, "rules": ["VanishingGradient"]}),
        "detach": _train("detach", 0.05, 2, {**every, "rules": ["VanishingGradient"]}),
        "init": _train("init", 1e-9, 2, {**every, "rules": ["PoorWeightInitialization"]}),
        "overfit": _train(None, 0.05, 5, {**every, "rules": ["Overfit"]}, eval_loss=10.0),
        "healthy": _train(None, 0.05, 50, every),
    }
    os.environ[STOP_FILE_ENV] = os.path.join(os.environ["HEALTH_TMP"], "stop")
    try:
        _train(None, 1e3, 10, {**every, "action": "stop", "rules": ["ExplodingTensor"]})
    except SystemExit as exc:
        out["stop"] = (exc.code, str(exc), open(os.environ[STOP_FILE_ENV]).read())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    os.environ["HEALTH_TMP"] = str(tmp_path_factory.mktemp("health"))
    return run_ranks(_scenarios, 1, timeout=180)[0]


def _fired(messages: list[str], rule: str) -> list[str]:
    return [m for m in messages if m.startswith(rule)]


def test_learning_rate_1e3_fires_within_5_steps(runs):
    fired = [m for m in runs["lr1e3"] if m.startswith(("ExplodingTensor", "LossNotDecreasing"))]
    assert fired and int(fired[0].split(" at step ")[1].split(":")[0]) < 5, runs["lr1e3"]


def test_learning_rate_1e_7_fires_loss_not_decreasing(runs):
    assert _fired(runs["lr1e-7"], "LossNotDecreasing"), runs["lr1e-7"]


@pytest.mark.parametrize("fault", ["scale", "detach"])
def test_vanishing_gradient_names_the_layer(runs, fault):
    fired = _fired(runs[fault], "VanishingGradient")
    assert fired and "gradient of fc2:" in fired[0], runs[fault]


def test_weights_100x_too_large_fire_poor_weight_initialization(runs):
    fired = _fired(runs["init"], "PoorWeightInitialization")
    assert fired and "grows" in fired[0], runs["init"]


def test_overfit_from_the_logged_evaluation_loss(runs):
    assert _fired(runs["overfit"], "Overfit"), runs["overfit"]


def test_healthy_run_fires_nothing_over_50_steps(runs):
    assert runs["healthy"] == []


def test_stop_exits_with_the_documented_status_and_leaves_the_reason(runs):
    code, text, marker = runs["stop"]
    assert code == STOP_EXIT_STATUS and "ExplodingTensor" in text and "ExplodingTensor" in marker


def _stats(rank: int, stage: int, grads: list[float], acts: list[float], loss: float | None) -> RankStatistics:
    return RankStatistics(rank=rank, stage=stage,
                          layers=[Layer(f"s{stage}.l{i}", g, 1.0, 100) for i, g in enumerate(grads)],
                          activations=[(f"s{stage}.l{i}", "layer", v) for i, v in enumerate(acts)],
                          losses=[] if loss is None else [loss])


def test_rules_on_synthetic_statistics():
    rules = HealthRules(debug_options({"rules": ["VanishingGradient", "ExplodingTensor", "PoorWeightInitialization",
                                                 {"rule": "WeightUpdateRatio", "large": 1.0}]}))
    healthy = aggregate([_stats(1, 1, [1e-2, 1e-2], [1.0, 2.0], 0.5), _stats(0, 0, [1e-2, 1e-2], [1.0, 1.0], None)])
    assert [layer.path for layer in healthy.layers] == ["s0.l0", "s0.l1", "s1.l0", "s1.l1"]  # pipeline order
    assert rules.evaluate(0, healthy) == []
    nan = aggregate([_stats(0, 0, [1e-2], [1.0, float("nan"), 1.0], 1.0)])
    assert [f.tensor for f in rules.evaluate(1, nan)] == ["output of s0.l1"]
    growing = Model(activations=[(f"l{i}", "layer", 100.0 ** i) for i in range(4)])
    assert [f.rule for f in rules.evaluate(2, growing)] == ["PoorWeightInitialization"]
    assert [f.rule for f in rules.evaluate(20, growing)] == []  # only at the start of training
    big = Model(layers=[Layer("a", 1.0, 1.0, 1)], updates={"a": 5.0})
    assert [f.tensor for f in rules.evaluate(3, big)] == ["weights of a"]


def test_debug_config_errors_name_the_fix():
    assert load_config({"partitions": 1, "debug": {"action": "stop"}}).debug_options.action == "stop"
    for bad, says in (({"rules": ["LossNotDecreasin"]}, "names"), ({"action": "halt"}, "'stop'"),
                      ({"rules": [{"rule": "Overfit", "patiense": 2}]}, "thresholds ['patience', 'ratio']"),
                      ({"every_n_steps": 0}, "positive integer")):
        with pytest.raises(ConfigError, match="debug") as info:
            load_config({"partitions": 1, "debug": bad})
        assert says in str(info.value)


def _stop_on_two_ranks(rank: int, world: int) -> object:
    import smp

    smp.init({"pipeline_parallel_degree": 2, "timeout_s": 20,
              "debug": {"every_n_steps": 1, "action": "stop", "rules": ["ExplodingTensor"]}})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e3))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    try:
        for _ in range(20):
            opt.zero_grad()
            train_step(model, x, torch.tanh(x[:, :4]))
            opt.step()
    except SystemExit as exc:
        return exc.code, str(exc)
    return None


@pytest.mark.slow
def test_stop_ends_every_rank_with_the_rules_message():
    results = run_ranks(_stop_on_two_ranks, 2, timeout=120)
    assert all(r is not None and r[0] == STOP_EXIT_STATUS and "ExplodingTensor" in r[1] for r in results), results
