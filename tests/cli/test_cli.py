"""The ``smp`` command, run as a user runs it: a subprocess per command, on a zoo model and on a
``file.py:factory`` target; plus in-process checks of the pieces (JSON round trip, the module graph).

Default tests use zoo:mlp and a small factory model (a few seconds each); GPT-2 runs, the 1024-stage
simulation and a real torchrun launch are marked slow.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
''')


def smp(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("SMP_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "smp.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


def ok(result: subprocess.CompletedProcess) -> str:
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
        assert needle.lower() in errors[0].lower(), errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target") / "mynet.py"
    path.write_text(FACTORY)
    return path


def check_plan_json(path: Path, stages: int, microbatches: int, pipeline: str) -> dict:
    """Required keys and types of ``smp inspect --json``, and an exact round trip through PartitionPlan."""
    from partitioner.plan import PartitionPlan

    text = path.read_text()
    data = json.loads(text)
    types = {"num_stages": int, "method": str, "balance": float, "lower_bound_s": float, "bottleneck_s": float,
             "cut_bytes": int, "stages": list, "baselines": dict, "schedule": dict, "assignment": dict}
    for key, typ in types.items():
        assert isinstance(data[key], typ), (key, type(data[key]))
    assert data["num_stages"] == len(data["stages"]) == stages
    assert data["method"] in ("dp", "metis")
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
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


def check_dot(path: Path, stages: int) -> None:
    """Parseable Graphviz: a digraph with balanced braces, only node/edge/attribute statements, one cluster
    and one colour per stage, and labelled cut edges."""
    from smp.cli import stage_color

    text = path.read_text()
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    statement = re.compile(r'^\s*(digraph \w+ \{|subgraph cluster_stage\d+ \{|\}|(graph|node|edge) \[.*\];|'
                           r'label=".*"; color="#[0-9a-f]{6}"; penwidth=\d+;|n\d+ \[label=".*", fillcolor="#[0-9a-f]{6}"\];|'
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


# --- the commands on a zoo model ----------------------------------------------------------------------


def test_help_lists_the_commands_and_cli_imports_no_torch(capsys) -> None:
    from smp.cli import main

    out = ok(smp("--help"))
    for command in ("inspect", "simulate", "demo", "launch"):
        assert command in out
    for command in ("inspect", "simulate", "demo", "launch"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0 and "usage: smp " + command in capsys.readouterr().out
    # smp/cli.py itself imports only the standard library (the package __init__ is someone else's).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('c', 'smp/cli.py'); "
            "m = importlib.util.module_from_spec(spec); sys.modules['c'] = m; spec.loader.exec_module(m); "
            "print(sorted(k for k in ('torch', 'partitioner', 'pipeline', 'numpy') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_inspect_zoo_writes_json_graph_and_timeline(tmp_path: Path) -> None:
    result = smp("inspect", "zoo:mlp", "--partitions", "3", "--microbatches", "4", "--json", str(tmp_path / "plan.json"),
                 "--graph", str(tmp_path / "graph.png"), "--timeline", str(tmp_path / "timeline.png"))
    out = ok(result)
    for needle in ("stage", "modules", "total", "lower bound", "balance", "predicted step", "bubble",
                   "baselines", "uniform", "params", "layers"):
        assert needle in out, needle
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(rows) == 3, out
    assert "smp: [" in result.stderr and "tracing" in result.stderr  # progress goes to stderr
    data = check_plan_json(tmp_path / "plan.json", 3, 4, "interleaved")
    assert data["target"] == "zoo:mlp"
    assert all(s["measured_s"] is None for s in data["stages"])
    check_png(tmp_path / "graph.png")
    check_png(tmp_path / "timeline.png")


def test_inspect_measure_dot_and_chrome_trace(tmp_path: Path, capsys) -> None:
    from smp.cli import main  # in process, to keep the suite fast; the subprocess runs are above

    assert main(["inspect", "zoo:mlp", "-p", "2", "-m", "3", "--pipeline", "simple", "--method", "metis",
                 "--optimizer", "sgd", "--memory-weight", "0.5", "--measure", "--quiet",
                 "--json", str(tmp_path / "plan.json"), "--graph", str(tmp_path / "graph.dot"),
                 "--timeline", str(tmp_path / "trace.json")]) == 0
    out = capsys.readouterr().out
    assert "meas fwd" in out and "with measured stage times" in out and "simple (GPipe)" in out
    data = check_plan_json(tmp_path / "plan.json", 2, 3, "simple")
    assert data["method"] == "metis" and data["options"]["optimizer"] == "sgd"
    assert data["options"]["memory_weight"] == 0.5 and data["options"]["pipeline"] == "gpipe"
    assert all(s["measured_s"] > 0 for s in data["stages"])
    assert len(data["measured"]["forward_s"]) == 2
    check_dot(tmp_path / "graph.dot", 2)
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 2 * 3  # F and B of 3 microbatches on 2 stages
    assert {e["tid"] for e in spans} == {0, 1}


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
    # 8 nodes of 8 ranks: 7 slower inter-node hops; still within 3x of the compute-only formula.
    T = (data["stage_forward_s"][0] + data["stage_backward_s"][0]) * 64
    formula = (64 + 64 - 1) * T / 64
    assert formula < data["predicted_step_s"] < 3 * formula + 64 * 4 * 1e-3


# --- the commands on a file.py:factory target ---------------------------------------------------------


def test_inspect_and_simulate_a_factory_target(tmp_path: Path, factory_file: Path) -> None:
    out = ok(smp("inspect", f"{factory_file}:build_kwargs", "-p", "3", "-m", "2", "-q",
                 "--json", str(tmp_path / "plan.json"), "--graph", str(tmp_path / "graph.svg")))
    assert "blocks." in out
    data = check_plan_json(tmp_path / "plan.json", 3, 2, "interleaved")
    assert data["target"].endswith("mynet.py:build_kwargs")
    assert (tmp_path / "graph.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    out = ok(smp("simulate", f"{factory_file}:build", "-p", "2", "-m", "4", "--schedules", "1f1b", "-q"))
    assert "a real 2-stage plan" in out and "winner" in out


def test_factory_may_return_a_bare_tensor(factory_file: Path, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", f"{factory_file}:single_tensor", "-p", "2", "-q"]) == 0
    assert "lower bound" in capsys.readouterr().out


# --- errors: one line, no traceback, non-zero exit ----------------------------------------------------


def test_bad_target_and_bad_sizes_are_one_line() -> None:
    one_line_error(smp("inspect", "zoo:nope", "-p", "2", "-q"), "unknown zoo model", "gpt2")
    one_line_error(smp("inspect", "zoo:mlp", "-p", "2", "--device-memory", "12XB", "-q"), "12XB", "GiB")
    one_line_error(smp("inspect", "zoo:mlp", "-p", "50", "-q"), "num_stages=50", "at most")


@pytest.mark.parametrize("argv, needles", [
    (["inspect", "no/such/file.py:build", "-p", "2", "-q"], ["no such file"]),
    (["inspect", "{f}:nope", "-p", "2", "-q"], ["has no function 'nope'", "build"]),
    (["inspect", "zoo:mlp", "-p", "0", "-q"], ["positive integer"]),
    (["inspect", "zoo:mlp", "-p", "2", "--device-memory=-3GiB", "-q"], ["memory size"]),
    (["inspect", "zoo:mlp", "-p", "2", "--device-memory", "1MB", "-q"], ["device_memory", "stages"]),
    (["inspect", "{f}:broken", "-p", "2", "-q"], ["raised RuntimeError", "no weights here"]),
    (["inspect", "{f}:wrong", "-p", "2", "-q"], ["returned int", "(model, example_args)"]),
    (["inspect", "{f}", "-p", "2", "-q"], ["names no factory"]),
    (["inspect", "gpt2", "-p", "2", "-q"], ["zoo:gpt2"]),
    (["inspect", "zoo:mlp", "-q"], ["--partitions"]),
    (["inspect", "zoo:mlp", "-p", "2", "--memory-weight", "2", "-q"], ["between 0 and 1"]),
    (["inspect", "zoo:mlp", "-p", "2", "--graph", "g.gif", "-q"], [".png", ".dot"]),
    (["simulate", "zoo:mlp", "-p", "2", "-q"], ["--microbatches"]),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--schedules", "fast", "-q"], ["--schedules"]),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--inter-node-latency", "soon", "-q"], ["duration"]),
    (["launch", "-n", "2", "no_such_script.py"], ["no such script"]),
    (["frobnicate"], ["invalid choice"]),
])
def test_user_errors_in_process(argv, needles, factory_file: Path, capsys) -> None:
    """The same rule for every user error, checked in-process (main() returns the exit code)."""
    from smp.cli import main

    code = main([a.replace("{f}", str(factory_file)) for a in argv])
    err = capsys.readouterr().err
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("smp: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


# --- launch -------------------------------------------------------------------------------------------


def test_launch_builds_torchrun_arguments(tmp_path: Path, capsys) -> None:
    from smp.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = ok(smp("launch", "-n", "4", "--dry-run", str(script), "--lr", "0.1"))
    assert out.split() == ["torchrun", "--nproc-per-node", "4", "--standalone", str(script), "--lr", "0.1"]

    def dry(*argv: str) -> list[str]:
        assert main(["launch", *argv]) == 0
        return capsys.readouterr().out.split()

    assert dry("-n", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500", "--dry-run",
               str(script)) == ["torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                                "--rdzv-endpoint", "head:29500", str(script)]
    out = " ".join(dry("-n", "2", "--master-addr", "10.0.0.1", "--master-port", "1234", "--nnodes", "2",
                       "--dry-run", str(script)))
    assert "--standalone" not in out and "--master-addr 10.0.0.1" in out and "--master-port 1234" in out


@pytest.mark.slow
def test_launch_runs_the_script_on_n_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write("
                      "os.environ['WORLD_SIZE'] + ' ' + ' '.join(sys.argv[2:]))\n")
    ok(smp("launch", "-n", "2", str(script), str(tmp_path), "--flag", "x"))
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "2 --flag x"
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    one_line_error(smp("launch", "-n", "2", str(bad)), "failed on local rank(s) 1")


# --- pieces, in process -------------------------------------------------------------------------------


def test_plan_round_trips_in_process() -> None:
    from partitioner import trace
    from partitioner.plan import PartitionPlan
    from smp import zoo
    from smp.cli import Options, Target, analyse

    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    plan, sim = analyse(graph, Options(partitions=3, microbatches=6), target=Target("zoo:mlp", z.model, z.args, z.kwargs))
    assert plan.extra["schedule"]["predicted_step_s"] == sim.step_s
    back = PartitionPlan.from_json(plan.to_json())
    assert back == plan and back.to_json() == plan.to_json()
    # Same inputs, same plan, byte for byte (calibration is cached within a process).
    again, _ = analyse(graph, Options(partitions=3, microbatches=6), target=Target("zoo:mlp", z.model, z.args, z.kwargs))
    assert again.to_json() == plan.to_json()


def test_module_graph_collapses_blocks_and_labels_cuts() -> None:
    from partitioner import partition, trace
    from smp import zoo
    from smp.cli import _group_ops, module_graph

    # Container ops between children join their neighbours; blocks collapse to their number.
    assert _group_ops(["transformer", "transformer.wte", "transformer", "transformer.wpe",
                       "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.0",
                       "transformer.h.1.mlp", "transformer.ln_f", "lm_head", ""]) == [
        "transformer.wte", "transformer.wte", "transformer.wte", "transformer.wpe", "transformer.h.0",
        "transformer.h.0", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head", "lm_head"]
    z = zoo.build("unet")
    graph = trace(z.model, z.args, z.kwargs)
    plan = partition(graph, 3)
    nodes, edges = module_graph(plan, graph)
    assert len(nodes) <= 12  # 7 blocks + head, some split across two stages
    assert {n["stage"] for n in nodes} == {0, 1, 2}
    assert sum(n["ops"] for n in nodes) == graph.num_nodes
    cut = [e for e in edges if e["cut"]]
    assert cut and all(e["bytes"] > 0 for e in cut)
    assert all(nodes[e["src"]]["stage"] <= nodes[e["dst"]]["stage"] for e in edges)
    # UNet's skip connections cross from the down path to the up path.
    names = {n["id"]: n["module"] for n in nodes}
    assert any(names[e["src"]] == "blocks.0" and names[e["dst"]] == "blocks.6" for e in edges)


def test_scaling_formula_is_what_the_simulator_gives_for_equal_stages() -> None:
    """The formula `smp simulate` prints for large cells: equal stages, free communication."""
    from smp.cli import simulate_stages

    for name in ("gpipe", "1f1b"):
        for p, m in ((4, 8), (8, 3), (16, 32)):
            T = 0.024
            sim = simulate_stages(name, m, [T / 3 / p] * p, [2 * T / 3 / p] * p)
            assert sim.step_s == pytest.approx((m + p - 1) * T / p)
            assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


# --- GPT-2, the demo, 1024 stages (slow) --------------------------------------------------------------


@pytest.mark.slow
def test_inspect_gpt2_readme_command(tmp_path: Path) -> None:
    out = ok(smp("inspect", "zoo:gpt2", "--partitions", "4", "--microbatches", "8", "--json",
                 str(tmp_path / "plan.json"), "--graph", str(tmp_path / "g.png"), "--timeline", str(tmp_path / "t.png")))
    assert "transformer.wte" in out and "lm_head" in out and "shared parameters" in out
    check_plan_json(tmp_path / "plan.json", 4, 8, "interleaved")
    check_png(tmp_path / "g.png")
    check_png(tmp_path / "t.png")


@pytest.mark.slow
def test_demo_prints_plan_schedule_and_trains() -> None:
    out = ok(smp("demo", timeout=600))
    assert "GPT-2" in out and "lower bound" in out and "simulated schedule" in out
    assert re.search(r"rank  0 \|[0-9a-j.]+\|", out) and re.search(r"rank  1 \|[0-9a-j.]+\|", out)
    losses = [float(x) for x in re.findall(r"step\s+\d+/\d+\s+loss ([0-9.]+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out


@pytest.mark.slow
def test_simulate_1024_stages() -> None:
    out = ok(smp("simulate", "zoo:gpt2", "--partitions", "1024", "--microbatches", "2048", "--schedules",
                 "1f1b,gpipe", "-q", timeout=900))
    assert "1024 stages on 128 node(s)" in out and "no real plan exists" in out and "winner" in out
