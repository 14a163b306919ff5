"""``smp inspect`` (:mod:`smp.cli.commands.inspect`), run as a user runs it: the report, the plan JSON and its round
trip, the pictures, ``--measure``, and a ``file.py:factory`` target. GPT-2 is marked slow."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli.helpers import check_dot, check_plan_json, check_png, ok, smp


def test_inspect_zoo_writes_json_graph_and_timeline(tmp_path: Path) -> None:
    result = smp("inspect", "zoo:mlp", "--partitions", "3", "--microbatches", "4",
                 "--json", str(tmp_path / "plan.json"),
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


def test_inspect_and_simulate_a_factory_target(tmp_path: Path, factory_file: Path) -> None:
    out = ok(smp("inspect", f"{factory_file}:build_kwargs", "-p", "3", "-m", "2", "-q",
                 "--json", str(tmp_path / "plan.json"), "--graph", str(tmp_path / "graph.svg")))
    assert "blocks." in out
    data = check_plan_json(tmp_path / "plan.json", 3, 2, "interleaved")
    assert data["target"].endswith("mynet.py:build_kwargs")
    assert (tmp_path / "graph.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    out = ok(smp("simulate", f"{factory_file}:build", "-p", "2", "-m", "4", "--schedules", "1f1b", "-q"))
    assert "a real 2-stage plan" in out and "winner" in out


@pytest.mark.slow
def test_inspect_gpt2_readme_command(tmp_path: Path) -> None:
    out = ok(smp("inspect", "zoo:gpt2", "--partitions", "4", "--microbatches", "8", "--json",
                 str(tmp_path / "plan.json"), "--graph", str(tmp_path / "g.png"),
                 "--timeline", str(tmp_path / "t.png")))
    assert "transformer.wte" in out and "lm_head" in out and "shared parameters" in out
    check_plan_json(tmp_path / "plan.json", 4, 8, "interleaved")
    check_png(tmp_path / "g.png")
    check_png(tmp_path / "t.png")


LLAMA = '''
import torch
import transformers


def build():
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=32, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, (torch.zeros(2, 32, dtype=torch.long),)
'''


def test_inspect_a_meta_llama_for_an_h100_in_bf16(tmp_path: Path, capsys) -> None:
    """Planned for a rented device in mixed precision: the report and the JSON say so, and what each rank
    holds is counted in bf16 (16-bit weights and gradients, fp32 master weights and two fp32 Adam states)."""
    import importlib.util

    from smp.cli import main

    (tmp_path / "llama.py").write_text(LLAMA)
    assert main(["inspect", f"{tmp_path / 'llama.py'}:build", "-p", "3", "-m", "4", "-q", "--device", "h100-80gb",
                 "--dtype", "bf16", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "priced for h100-80gb in bf16 mixed precision; links nvlink4 within a node, infiniband-ndr" in out
    assert "memory per rank (bf16, adam" in out and "master" in out
    data = check_plan_json(tmp_path / "plan.json", 3, 4, "interleaved")
    assert (data["options"]["device"], data["options"]["dtype"]) == ("h100-80gb", "bf16")
    assert data["options"]["device_memory"] == 80e9 and data["rates"]["name"] == "h100-80gb"
    spec = importlib.util.spec_from_file_location("llama_factory", tmp_path / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()[0]
    trained = 2 * sum(p.numel() for p in model.parameters())
    memory = data["memory"]
    assert [m["stage"] for m in memory] == [0, 1, 2]
    # bf16 weights, nothing tied, and the rotary embedding's inv_freq buffer (used by the forward)
    assert sum(m["weights_bytes"] for m in memory) == trained + 2 * model.model.rotary_emb.inv_freq.numel()
    assert sum(m["gradient_bytes"] for m in memory) == trained  # buffers have no gradient or state
    assert sum(m["master_bytes"] for m in memory) == 2 * trained  # fp32 master weights
    assert sum(m["optimizer_bytes"] for m in memory) == 4 * trained  # Adam's two fp32 moments
    for m, s in zip(memory, data["stages"]):
        assert s["param_bytes"] == m["weights_bytes"]
        assert m["in_flight"] == min(3 - m["stage"], 4)  # 1F1B's peak, from the simulated schedule
        assert m["activation_bytes"] == m["in_flight"] * m["activation_bytes_per_microbatch"] > 0
        assert abs(m["total_bytes"] - s["memory_bytes"]) <= 4  # the plan's memory, broken down (rounding)


def test_a_plan_that_eats_into_the_memory_smp_plan_keeps_free_says_so(capsys) -> None:
    # 10.5 MiB: gpt2's cut on 2 stages fits it only at 96%, over the 90% smp plan allows (--memory-headroom 10%)
    from smp.cli import main

    argv = ["inspect", "zoo:gpt2", "-p", "2", "-m", "4", "--device", "h100-80gb", "--dtype", "bf16", "-q"]
    assert main([*argv, "--device-memory", "10.5MiB"]) == 0
    assert ("of the budget, more than the 9.4 MiB smp plan allows: it keeps 10% free for the CUDA allocator and "
            "NCCL, which this estimate omits") in capsys.readouterr().out
    assert main(argv) == 0
    assert "smp plan allows" not in capsys.readouterr().out  # 10 MiB of an 80 GB H100
