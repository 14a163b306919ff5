"""``--cp`` of ``smp inspect`` and ``smp simulate`` (:mod:`smp.cli.context_parallel`): the plan of cp rank 0's half of
every sequence, its activations per rank next to one process's and the gathers printed, nonsense refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.helpers import one_line_error, smp

TARGET = "zoo:gpt2"


def _inspect(capsys, tmp: Path, *args: str) -> tuple[str, dict[str, Any]]:
    from smp.cli import main

    out = tmp / f"plan{len(list(tmp.iterdir()))}.json"
    assert main(["inspect", TARGET, "-q", "--json", str(out), "--estimate", "-p", "1", *args]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_inspect_cp_holds_half_the_tokens_and_prices_the_gathers(capsys, tmp_path: Path) -> None:
    plain, whole = _inspect(capsys, tmp_path)
    text, split = _inspect(capsys, tmp_path, "--cp", "2")
    assert "context parallelism" not in plain
    assert ("context parallelism: degree 2, 16 of each sequence's 32 tokens per rank (chunks balanced for causal "
            "attention), 4 attention(s) reading the group's keys and values") in text
    assert "reads the whole sequence" not in text and "gathers (keys and values" in text
    ratio = split["memory"][0]["activation_bytes"] / whole["memory"][0]["activation_bytes"]
    assert 0.4 < ratio < 0.7, ratio  # the tokens' activations halve; the gathered keys and values stay whole
    assert split["memory"][0]["weights_bytes"] == whole["memory"][0]["weights_bytes"]  # weights whole on every rank
    assert split["stages"][0]["flops"] < 0.6 * whole["stages"][0]["flops"]


@pytest.mark.slow
def test_simulate_takes_cp(tmp_path: Path) -> None:
    got = smp("simulate", TARGET, "-p", "2", "-m", "4", "--cp", "2", "--estimate", "-q", "--json",
              str(tmp_path / "sim.json"))
    assert got.returncode == 0, got.stderr
    assert json.loads((tmp_path / "sim.json").read_text())


@pytest.mark.slow  # each a subprocess; the partitioner's refusals are tested in-process (tests/partitioner/cp)
@pytest.mark.parametrize("target,args,needles", [
    (TARGET, ("--cp", "3"), ("--cp 3", "32 tokens does not split over context_parallel_degree=3")),
    ("zoo:mlp", ("--cp", "2"), ("--cp 2", "no embedding looks up the model's input ids")),
    (TARGET, ("--cp", "2", "--sdp", "2"), ("--cp 2 with --sdp 2", "not combined")),
])
def test_bad_degrees_are_refused_in_one_line(target: str, args: tuple, needles: tuple) -> None:
    one_line_error(smp("inspect", target, "-p", "1", "--estimate", "-q", *args), *needles)
