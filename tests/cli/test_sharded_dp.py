"""``--sdp`` of ``smp inspect`` and ``smp simulate`` (:mod:`smp.cli.sharded_dp`): the sharded memory per rank and the
gathered units printed and recorded, what the collectives expose in the predicted step, what ``smp plan`` says the
threshold leaves whole, ``--sdp 1`` today's output, and nonsense refused with the numbers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.helpers import check_plan_json

GPT2 = ["zoo:gpt2", "-p", "2", "-m", "4", "-q", "--estimate"]  # the roofline: priced the same in every run


def _run(capsys, *args: str) -> tuple[int, str, str]:
    from smp.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _inspect(capsys, tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    path = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    code, out, err = _run(capsys, "inspect", *GPT2, "--json", str(path), *args)
    assert code == 0, err
    return out, json.loads(path.read_text())


def test_inspect_sdp_2_divides_the_parameter_state_and_prices_the_gathers(capsys, tmp_path: Path) -> None:
    out, plan = _inspect(capsys, tmp_path, "--sdp", "2", "--sdp-threshold", "10000")
    assert "grads at rest" in out and "parameters sharded over 2 replicas" in out
    assert "sharded data parallelism: degree 2 of 2 replicas per stage" in out and "16 of 53 parameters" in out
    # a block whole, copied out of its all-gather's buffers (whole and a half: the output and this rank's input),
    # beside the stage's last block (its four weights more), whole from its first gather to the step's end
    assert ("gathered at the peak of stage(s) 0: 2.6 MiB (transformer.h.0.attn.c_attn.weight, "
            "transformer.h.0.attn.c_proj.weight, transformer.h.0.mlp.c_fc.weight, transformer.h.0.mlp.c_proj.weight, "
            "... 4 more)" in out)
    sdp, memory = plan["sharded_data_parallel"], plan["memory"]
    assert sdp["degree"] == sdp["replicas"] == 2 and sdp["threshold"] == 10_000 and sdp["link"]["name"] == "loopback"
    for r, m in zip(sdp["ranks"], memory):
        assert m["weights_bytes"] / 2 < r["weights_bytes"] < m["weights_bytes"]  # the wte and the norms stay whole
        # whole during the step, with a unit laid out for its reduce-scatter and the reduced shards
        assert r["gradient_peak_bytes"] > m["gradient_bytes"] and r["activation_bytes"] == m["activation_bytes"]
        # the state at rest divides; at the peak two small blocks gathered at once and the reduce-scatter's buffers
        # eat what sharding saves on a model this small
        assert r["optimizer_bytes"] < m["optimizer_bytes"] and r["all_gather_s"] > 0 and r["reduce_scatter_s"] > 0
    assert sdp["predicted_step_s"] > plan["schedule"]["predicted_step_s"]  # the first gathers are not hidden
    check_plan_json(tmp_path / "plan0.json", 2, 4, "interleaved")  # and the plan still round-trips


def test_sdp_1_prints_todays_output(capsys, tmp_path: Path) -> None:
    today, _ = _inspect(capsys, tmp_path)
    assert _inspect(capsys, tmp_path, "--sdp", "1")[0] == today and "sharded" not in today
    _, tiny = _inspect(capsys, tmp_path, "--sdp", "2")  # every parameter under a million elements: only all-reduces
    assert all(r["sharded"] == 0 and r["all_gather_s"] == 0 for r in tiny["sharded_data_parallel"]["ranks"])


def test_simulate_sdp_adds_the_collectives_to_the_step(capsys, tmp_path: Path) -> None:
    steps = []
    for sdp in ("1", "2"):
        path = tmp_path / f"sim{sdp}.json"
        code, out, err = _run(capsys, "simulate", *GPT2, "--schedules", "1f1b", "--sdp", sdp, "--sdp-threshold",
                              "10000", "--json", str(path))
        assert code == 0, err
        steps.append(json.loads(path.read_text()))
    plain, sharded = steps
    assert "sharded_data_parallel" not in plain and "gathered" in out and "per rank on stage" in out
    rec = sharded["sharded_data_parallel"]
    # what the prefetched gathers expose: some, no more than their own seconds
    added = [s - p for s, p in zip(sharded["stage_forward_s"], plain["stage_forward_s"])]
    assert all(0 < a <= r["gather_forward_s"] + 1e-12 for a, r in zip(added, rec["ranks"]))
    assert sharded["predicted_step_s"] > plain["predicted_step_s"]


@pytest.mark.parametrize("args, needles", [
    (["--sdp", "0"], ["argument --sdp", "'0' must be a positive integer"]),
    (["--sdp", "2", "--measure"], ["--measure", "--sdp 2", "measure with --sdp 1"]),
    (["--sdp", "2", "--sdp-threshold", "1000", "--device-memory", "5MiB"],
     ["--sdp 2: the rank of stage(s)", "at its peak", "more than --device-memory 5.0 MiB", "raise --sdp"]),
])
def test_nonsense_is_refused_with_the_values(capsys, args: list[str], needles: list[str]) -> None:
    code, out, err = _run(capsys, "inspect", *GPT2, *args)
    assert code == 2 and not out
    for needle in needles:
        assert needle in err, err


def test_plan_says_what_the_threshold_leaves_whole() -> None:
    import partitioner
    from smp import zoo
    from smp.cli.sharded_dp import whole_line

    z = zoo.build("gpt2")
    graph = partitioner.trace(z.model, z.args, z.kwargs)
    plan = partitioner.partition(graph, 1)
    line = whole_line(graph, plan, 2, 30_000)  # the biases, norms and position embedding: 8.9 % of the elements
    assert line is not None and line.startswith("sdp leaves whole 0.089 of the parameters' elements") and (
        "39 parameters under sdp_param_persistence_threshold=30,000 elements; set it to 1" in line)
    assert whole_line(graph, plan, 2, 1) is None and whole_line(graph, plan, 1, 30_000) is None  # all sharded; none
