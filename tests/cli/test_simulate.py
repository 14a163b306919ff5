"""``smp simulate`` (:mod:`smp.cli.commands.simulate`, :mod:`smp.cli.pricing`): the schedule comparison, stages past the
model's ops, the scaling table and its formula. 1024 stages x 2048 microbatches is marked slow."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.helpers import ok, smp


def test_simulate_zoo_compares_schedules(tmp_path: Path) -> None:
    out = ok(smp("simulate", "zoo:mlp", "--partitions", "4", "--microbatches", "8", "--ranks-per-node", "2",
                 "--json", str(tmp_path / "sim.json"), "-q"))
    for needle in ("predicted step", "throughput", "bubble", "gpipe", "1f1b", "interleaved-virtual",
                   "zero-bubble", "fastest", "winner", "how it scales"):
        assert needle in out, needle
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["partitions"] == 4 and data["microbatches"] == 8 and data["exact"] is True
    assert data["winner"] in data["schedules"]
    steps = {k: r["predicted_step_s"] for k, r in data["schedules"].items()}
    assert len(steps) == 4 and min(steps.values()) == steps[data["winner"]]
    assert data["predicted_step_s"] == data["schedules"]["1f1b"]["predicted_step_s"]
    assert {(r["p"], r["m"]) for r in data["scaling"]} == {(p, m) for p in (1, 2, 4) for m in (2, 4, 8)}


def test_simulate_past_the_model_scales_stage_times(tmp_path: Path, capsys) -> None:
    from smp.cli import main

    # zoo:mlp has 10 ops: 64 stages cannot be a real plan, so stages get total / 64.
    assert main(["simulate", "zoo:mlp", "-p", "64", "-m", "64", "--pipeline", "simple",
                 "--schedules", "gpipe,zero-bubble", "--json", str(tmp_path / "sim.json"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "no real plan exists" in out and "total/P" in out
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["exact"] is False and data["schedule"] == "gpipe"
    assert set(data["schedules"]) == {"gpipe", "zero-bubble (ZB-H1)"}
    # 8 nodes of 8 ranks: 7 slower inter-node hops; still within 3x of the formula without links,
    # (m + p - 1) * (T/p + 2 o) + s, whose per-pass o and per-step s are this machine's measured runtime costs.
    T = (data["stage_forward_s"][0] + data["stage_backward_s"][0]) * 64
    rates = data["rates"]
    formula = (64 + 64 - 1) * (T / 64 + 2 * rates["pass_overhead_s"]) + rates["step_overhead_s"]
    assert formula < data["predicted_step_s"] < 3 * formula + 64 * 4 * 1e-3


@pytest.mark.slow
def test_simulate_1024_stages() -> None:
    out = ok(smp("simulate", "zoo:gpt2", "--partitions", "1024", "--microbatches", "2048", "--schedules",
                 "1f1b,gpipe", "-q", timeout=900))
    assert "1024 stages on 128 node(s)" in out and "no real plan exists" in out and "winner" in out
