"""Helpers of the ``smp`` command's tests: run it as a user does (a process of its own), read its one-line errors,
and check the files it writes (plan JSON, PNG, DOT)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import forked

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FACTORY = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 64)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6))
            self.head = nn.Linear(64, 4)

        def forward(self, x, scale=None):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            if scale is not None:
                x = x * scale
            return self.head(x)


    def build():
        torch.manual_seed(0)
        return Net(), (torch.randn(8, 16),)


    def build_kwargs():
        torch.manual_seed(0)
        return Net(), (torch.randn(8, 16),), {"scale": torch.tensor(2.0)}


    def single_tensor():
        return Net(), torch.randn(8, 16)


    def broken():
        raise RuntimeError("no weights here")


    def wrong():
        return 42


    def exits():
        import sys
        sys.exit(3)
''')


def smp_env() -> dict[str, str]:
    """The environment of a subprocess: this checkout first on the path, no SMP_TRACEBACK."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("SMP_TRACEBACK", None)
    return env


def smp(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``smp ARGS`` to the end, as ``python -m smp.cli`` does, in a process of its own forked with its imports
    done (:mod:`tests.forked`)."""
    return forked.run((forked.smp_cli, list(args)), cwd=cwd or REPO, env=smp_env(), timeout=timeout)


def smp_process(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m smp.cli ARGS`` to the end: the command a user runs, its interpreter and imports its own."""
    return subprocess.run([sys.executable, "-m", "smp.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=smp_env())


def ok(result: subprocess.CompletedProcess) -> str:
    """The stdout of a run that succeeded without a traceback."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """A user error: non-zero exit, no traceback, exactly one ``smp: error:`` line (stderr is that line when
    the command ran with --quiet), mentioning every needle."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("smp: error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle.lower() in errors[0].lower(), result.stderr
    return errors[0]


def check_plan_json(path: Path, stages: int, microbatches: int, pipeline: str) -> dict:
    """Required keys and types of ``smp inspect --json``, and an exact round trip through PartitionPlan."""
    from partitioner.cut.baselines import BASELINES
    from partitioner.cut.plan import PartitionPlan

    text = path.read_text()
    data = json.loads(text)
    types = {"num_stages": int, "method": str, "balance": float, "lower_bound_s": float, "bottleneck_s": float,
             "cut_bytes": int, "stages": list, "baselines": dict, "schedule": dict, "assignment": dict}
    for key, typ in types.items():
        assert isinstance(data[key], typ), (key, type(data[key]))
    assert data["num_stages"] == len(data["stages"]) == stages
    assert data["method"] in ("dp", "metis", *BASELINES)  # under auto a baseline's cut can win
    assert data["balance"] >= 1.0 - 1e-9
    assert data["bottleneck_s"] >= data["lower_bound_s"] > 0
    for i, s in enumerate(data["stages"]):
        assert s["index"] == i
        for key, typ in {"nodes": int, "flops": float, "param_bytes": int, "memory_bytes": int, "cost_s": float,
                         "modules": list, "inputs_from": list, "outputs_to": list}.items():
            assert isinstance(s[key], typ), (i, key, s[key])
        assert "measured_s" in s
        assert all(j < i for j in s["inputs_from"]) and all(j > i for j in s["outputs_to"])
    assert sum(s["nodes"] for s in data["stages"]) == len(data["assignment"])
    assert set(data["baselines"]) == {"uniform", "params", "layers"}
    for b in data["baselines"].values():
        assert isinstance(b["balance"], float) and isinstance(b["cut_bytes"], int)
    sched = data["schedule"]
    assert sched["microbatches"] == microbatches and sched["pipeline"] == pipeline
    assert sched["predicted_step_s"] > 0 and 0.0 <= sched["bubble"] < 1.0

    plan = PartitionPlan.from_json(str(path))
    assert plan.extra["baselines"] == data["baselines"] and plan.extra["schedule"] == data["schedule"]
    assert plan.to_json() == text.rstrip("\n")           # byte for byte
    assert PartitionPlan.from_json(plan.to_json()) == plan  # and into an equal plan
    return data


def check_png(path: Path) -> None:
    """A real PNG of some size."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


def check_dot(path: Path, stages: int) -> None:
    """Parseable Graphviz: a digraph with balanced braces, only node/edge/attribute statements, one cluster
    and one colour per stage, and labelled cut edges."""
    from smp.cli.graph import stage_color

    text = path.read_text()
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    statement = re.compile(r'^\s*(digraph \w+ \{|subgraph cluster_stage\d+ \{|\}|(graph|node|edge) \[.*\];|'
                           r'label=".*"; color="#[0-9a-f]{6}"; penwidth=\d+;|'
                           r'n\d+ \[label=".*", fillcolor="#[0-9a-f]{6}"\];|'
                           r'n\d+ -> n\d+( \[label="[^"]+", color=black, penwidth=[\d.]+\])?;)$')
    for line in text.splitlines():
        assert statement.match(line), f"unexpected DOT line: {line!r}"
    for s in range(stages):
        assert f"subgraph cluster_stage{s} " in text
        assert f'"{stage_color(s, stages)}"' in text, f"stage {s} colour missing"
    if stages > 1:
        assert re.search(r'-> n\d+ \[label="[\d.]+ (B|KiB|MiB|GiB)"', text), "cut edges must carry their bytes"
    # Every edge joins declared nodes.
    declared = set(re.findall(r"^\s*(n\d+) \[", text, re.M))
    for a, b in re.findall(r"(n\d+) -> (n\d+)", text):
        assert a in declared and b in declared
