"""``--ep`` of ``smp inspect`` and ``smp simulate`` (:mod:`smp.cli.expert_parallel`): the plan of ep rank 0's
experts, its weights, gradients and optimizer state per rank and the all-to-alls printed, nonsense refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.helpers import one_line_error, smp

TARGET = "benchmarks/expert_parallel.py:mixtral"
SMALL = json.dumps({"layers": 2, "expert_width": 256, "batch": 4, "seq": 32})
PARAM_STATE = ("weights_bytes", "gradient_bytes", "optimizer_bytes")


@pytest.fixture(autouse=True)
def small_model(monkeypatch) -> None:
    monkeypatch.setenv("SMP_BENCH_DIMS", SMALL)


def _inspect(capsys, tmp: Path, *args: str) -> tuple[str, dict[str, Any]]:
    from smp.cli import main

    out = tmp / f"plan{len(list(tmp.iterdir()))}.json"
    assert main(["inspect", TARGET, "-q", "--json", str(out), "--device", "h100-80gb", "--dtype", "bf16", *args]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_inspect_ep_holds_a_share_of_the_experts_and_prices_the_all_to_alls(capsys, tmp_path: Path) -> None:
    plain, whole = _inspect(capsys, tmp_path, "-p", "1")
    text, split = _inspect(capsys, tmp_path, "-p", "1", "--ep", "4")
    assert "expert parallelism" not in plain
    assert "expert parallelism: degree 4, 2 mixture-of-experts layer(s) split (8 experts, top-2, 2 per rank)" in text
    assert "all-to-alls" in text and " per step" in text
    experts = 2 * 8 * (2 * 256 * 128 + 128 * 256) * 2  # 2 layers of 8 experts (gate_up, down) in bf16
    assert whole["memory"][0]["weights_bytes"] - split["memory"][0]["weights_bytes"] == experts * 3 // 4
    for key in PARAM_STATE:  # the experts, most of the weights, at a quarter; the embedding and head whole
        ratio = split["memory"][0][key] / whole["memory"][0][key]
        assert 0.25 < ratio < 0.5, (key, ratio)
    assert split["stages"][0]["cost_s"] > whole["stages"][0]["cost_s"]  # the same compute and the all-to-alls


@pytest.mark.slow
def test_simulate_takes_ep(tmp_path: Path) -> None:
    got = smp("simulate", TARGET, "-p", "2", "-m", "4", "--ep", "2", "--device", "h100-80gb", "--dtype", "bf16",
              "-q", "--json", str(tmp_path / "sim.json"))
    assert got.returncode == 0, got.stderr
    assert json.loads((tmp_path / "sim.json").read_text())


@pytest.mark.slow  # each a subprocess; smp plan's ep refusals run in-process (tests/cli/test_plan.py)
@pytest.mark.parametrize("args,needles", [
    (("--ep", "3"), ("--ep 3", "does not divide the [8] experts")),
    (("--ep", "0"), ("--ep",)),
])
def test_bad_degrees_are_refused_in_one_line(args: tuple, needles: tuple) -> None:
    one_line_error(smp("inspect", TARGET, "-p", "1", "--estimate", "-q", *args), *needles)


@pytest.mark.slow
def test_a_model_without_experts_is_refused_with_the_reason() -> None:
    one_line_error(smp("inspect", "zoo:gpt2", "-p", "1", "--ep", "2", "--estimate", "-q"),
                   "--ep 2", "no mixture-of-experts layer")
