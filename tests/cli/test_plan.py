"""``smp plan`` (:mod:`smp.cli.commands.plan`): the JSON scripts read, the smp config it writes (smp's own parser
takes it; under -m slow it trains on 2 CPU ranks), fixed degrees priced as ``smp simulate`` prices them, and what it
says when nothing fits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.units import format_bytes
from smp.cli import main

H100 = ["--device", "h100-80gb", "--dtype", "bf16"]
KEYS = ("pp", "tp", "dp", "sdp", "microbatch_size", "microbatches", "schedule", "virtual_stages", "checkpointing",
        "step_s", "samples_per_s", "tokens_per_s", "mfu", "memory_bytes")


def test_plan_writes_the_layouts_best_first_and_a_config_smp_init_reads(tmp_path: Path, capsys) -> None:
    from smp.runtime.config import load_config

    out, cfg_path = tmp_path / "plan.json", tmp_path / "smp.json"
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "16", *H100, "--top", "3",
                 "--json", str(out), "--config", str(cfg_path), "-q"]) == 0
    printed = capsys.readouterr().out
    for needle in ("searched", "priced", "samples/s", "MFU", "memory/device", "best:", "smp config:"):
        assert needle in printed, needle
    data = json.loads(out.read_text())
    rows = data["layouts"]
    assert 1 <= len(rows) <= 3 and all(all(k in row for k in KEYS) for row in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["pp"] * r["tp"] * r["dp"] == 4 and r["dp"] * r["microbatches"] * r["microbatch_size"] == 16
               for r in rows)
    assert all(r["memory_bytes"] <= data["budget_bytes"] for r in rows)
    cfg = json.loads(cfg_path.read_text())
    cut = cfg.pop("partition_file", None)  # a pipeline layout's config names the cut smp plan priced, beside it
    assert cfg == rows[0]["smp_config"] and cfg["bf16"] is True
    assert (cut is not None) == (rows[0]["pp"] > 1) and (cut is None or (tmp_path / cut).is_file())
    c = load_config(cfg)
    assert (c.pipeline_parallel_degree, c.tensor_parallel_degree, c.microbatches) == \
           (rows[0]["pp"], rows[0]["tp"], rows[0]["microbatches"])


def test_fixed_degrees_are_priced_as_smp_simulate_prices_them(tmp_path: Path) -> None:
    plan, sim = tmp_path / "plan.json", tmp_path / "sim.json"
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "32", "--tp", "2", "--pp", "2", "--dp", "1",
                 "--microbatch-size", "4", "--schedules", "1f1b", "--checkpointing", "none", *H100,
                 "--json", str(plan), "-q"]) == 0
    # tp layouts are priced with sequence parallelism, as the runtime runs them by default
    assert main(["simulate", "zoo:gpt2", "-p", "2", "-m", "8", "--tp", "2", "--sequence-parallel", *H100,
                 "--schedules", "1f1b", "--json", str(sim), "-q"]) == 0
    (row,) = json.loads(plan.read_text())["layouts"]
    assert (row["pp"], row["tp"], row["dp"], row["microbatches"]) == (2, 2, 1, 8)
    simulated = json.loads(sim.read_text())["predicted_step_s"]  # smp simulate's step: no optimizer step
    assert row["step_s"] - row["optimizer_s"] == pytest.approx(simulated, rel=1e-12)


def test_a_fixed_sdp_is_priced_as_smp_simulate_sdp_and_written_to_the_config(tmp_path: Path) -> None:
    plan, sim, cfg = tmp_path / "plan.json", tmp_path / "sim.json", tmp_path / "smp.json"
    # gpt2's parameters are under SMP's 10^6 elements: a threshold of 1,000 shards its layers
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "32", "--tp", "1", "--pp", "2", "--dp", "2",
                 "--sdp", "2", "--sdp-threshold", "1000", "--microbatch-size", "4", "--schedules", "1f1b",
                 "--checkpointing", "none", *H100, "--json", str(plan), "--config", str(cfg), "-q"]) == 0
    assert main(["simulate", "zoo:gpt2", "-p", "2", "-m", "4", "--sdp", "2", "--sdp-threshold", "1000", *H100,
                 "--schedules", "1f1b", "--json", str(sim), "-q"]) == 0
    (row,) = json.loads(plan.read_text())["layouts"]
    assert (row["pp"], row["dp"], row["sdp"], row["microbatches"]) == (2, 2, 2, 4)
    simulated = json.loads(sim.read_text())["predicted_step_s"]  # smp simulate's step: no optimizer step
    assert row["step_s"] - row["optimizer_s"] == pytest.approx(simulated, rel=1e-12)
    written = json.loads(cfg.read_text())
    assert written["sharded_data_parallel_degree"] == 2 and written["ddp"] is True
    assert written["sdp_param_persistence_threshold"] == 1000  # the run shards what was priced
    assert "shard_optimizer_state" not in written


def test_sharding_that_shards_nothing_is_neither_searched_nor_accepted(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "16", *H100, "--top", "10",
                 "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert ("sdp above 1 left out, where it would shard nothing: none of the model's 52 parameters has 1,000,000 "
            "elements or more (the largest, transformer.wte.weight, has 65,536); lower --sdp-threshold to 65,536 or "
            "less") in err
    rows = json.loads(out.read_text())["layouts"]
    assert len(rows) == 10 and all(r["sdp"] == 1 for r in rows)  # no sdp2 row that is the sdp1 row again
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "16", *H100, "--sdp", "2", "-q"]) == 2
    assert ("smp: error: --sdp 2 would shard nothing: none of the model's 52 parameters has 1,000,000 elements or "
            "more (the largest, transformer.wte.weight, has 65,536)") in capsys.readouterr().err


def test_the_plans_leave_the_memory_headroom_free_and_say_so(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    one_stage = ["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "16", *H100, "--pp", "1", "--top", "3",
                 "--json", str(out), "-q"]
    assert main([*one_stage, "--device-memory", "unlimited"]) == 0
    fastest = json.loads(out.read_text())["layouts"][0]
    budget = fastest["memory_bytes"] / 0.95  # the fastest layout would fill 95% of it
    capsys.readouterr()
    assert main([*one_stage, "--device-memory", str(int(budget))]) == 0
    printed, data = capsys.readouterr().out, json.loads(out.read_text())
    assert (f"memory budget {format_bytes(int(budget))} per device, 10% kept free for the allocator: plans use at "
            f"most {format_bytes(0.9 * int(budget))}") in printed
    assert data["budget_bytes"] == pytest.approx(0.9 * int(budget)) and data["device_memory_bytes"] == int(budget)
    assert all(r["memory_bytes"] <= 0.9 * budget for r in data["layouts"])
    assert data["layouts"][0]["step_s"] > fastest["step_s"]  # the fastest one was too full
    assert main([*one_stage, "--device-memory", str(int(budget)), "--memory-headroom", "0"]) == 0
    assert json.loads(out.read_text())["layouts"][0]["step_s"] == fastest["step_s"]
    assert main([*one_stage, "--memory-headroom", "2"]) == 2
    err = capsys.readouterr().err
    assert "--memory-headroom: memory headroom '2': a fraction must be at least 0 and below 1" in err


def test_on_this_cpu_no_mfu_and_no_negative_zero(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    # --tp 1: which of pp2 and tp2 wins depends on this machine's calibrated rates, not on what is tested here.
    assert main(["plan", "zoo:gpt2", "--devices", "2", "--global-batch", "8", "--dp", "1", "--tp", "1",
                 "--estimate", "--json", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "MFU" not in printed and "-0.0" not in printed  # the cpu profile's rate is measured here: not a peak
    assert all(r["mfu"] is None and r["dp_comm_s"] == 0.0 for r in json.loads(out.read_text())["layouts"])
    assert "(dp 1: no gradient reduction)" in printed and "tp collectives" not in printed


def test_the_options_narrow_the_search(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "zoo:gpt2", "--devices", "16", "--global-batch", "32", *H100, "--ranks-per-node", "4",
                 "--schedules", "gpipe,interleaved-virtual", "--virtual-stages", "2", "--checkpointing", "full",
                 "--zero1", "on", "--placement", "PDT", "--exhaustive", "--top", "4", "--json", str(out), "-q"]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert len(rows) == 4
    for r in rows:
        assert r["schedule"] in ("gpipe", "interleaved-virtual") or r["pp"] == 1, r
        assert r["checkpointing"] == "full" and (r["zero1"] or r["dp"] == 1)
        assert r["placement"] == "PDT" or r["pp"] == 1 or r["dp"] == 1
        assert r["virtual_stages"] == (2 if r["schedule"] == "interleaved-virtual" else 1)
        assert r["smp_config"] is None or r["schedule"] == "gpipe"


def test_nothing_fits_says_what_would(capsys) -> None:
    assert main(["plan", "zoo:gpt2", "--devices", "2", "--global-batch", "4", *H100, "--device-memory", "1MiB",
                 "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("smp: error: no layout fits 921.6 KiB per device (1.0 MiB less 10% kept free for the "
                          "allocator)") and "What would fit: more devices" in err


@pytest.mark.parametrize("argv, message", [
    (["--config", "c.json", "--schedules", "1f1b,zero-bubble"], "drop zero-bubble from --schedules"),
    (["--tp", "3"], "--tp 3 does not divide --ranks-per-node 8"),
    (["--tp", "2", "--pp", "2", "--dp", "4"], "--tp 2 x --pp 2 x --dp 4 = 16 does not make --devices 4"),
    (["--schedules", "1f1b,pipedream"], "--schedules '1f1b,pipedream': choose from"),
    (["--checkpointing", "selective"], "--checkpointing 'selective': choose from none, full"),
    (["--sdp", "2", "--zero1", "on"], "--sdp 2 with --zero1 on"),
    (["--sdp", "2", "--dp", "1"], "--sdp 2 does not divide --dp 1"),
    (["--config", "c.yaml"], "the file name must end in .json"),
])
def test_a_bad_request_says_what_is_wrong(argv: list[str], message: str, capsys) -> None:
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "8", *H100, "-q", *argv]) == 2
    assert message in capsys.readouterr().err


MOE = "benchmarks/expert_parallel.py:mixtral"  # 8 experts a layer
SMALL_MOE = json.dumps({"layers": 2, "expert_width": 256, "batch": 4, "seq": 32})


def test_a_mixture_of_experts_plan_searches_ep_and_writes_it_to_the_config(tmp_path: Path, capsys,
                                                                            monkeypatch) -> None:
    from smp.runtime.config import load_config

    monkeypatch.setenv("SMP_BENCH_DIMS", SMALL_MOE)
    out, cfg_path = tmp_path / "plan.json", tmp_path / "smp.json"
    assert main(["plan", MOE, "--devices", "8", "--global-batch", "16", *H100, "--ep", "4", "--tp", "1",
                 "--checkpointing", "none", "--json", str(out), "--config", str(cfg_path), "-q"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["layouts"]
    assert rows and all(r["ep"] == 4 and r["sdp"] == 1 and not r["zero1"] and r["dp"] % 4 == 0 for r in rows)
    assert " ep " in printed.splitlines()[3] and "expert parallelism: the 8 experts of each of 2" in printed
    assert "ep4 dp" in printed and "expert all-to-alls" in printed
    cfg = json.loads(cfg_path.read_text())
    assert cfg["expert_parallel_degree"] == 4 and load_config(cfg).expert_parallel_degree == 4
    # Unfixed, every degree dividing dp and the experts is considered, never with sdp or ZeRO-1.
    assert main(["plan", MOE, "--devices", "8", "--global-batch", "16", *H100, "--top", "50", "--exhaustive",
                 "--json", str(out), "-q"]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert {r["ep"] for r in rows} > {1} and not any(r["ep"] > 1 and (r["sdp"] > 1 or r["zero1"]) for r in rows)


@pytest.mark.parametrize("target, argv, message", [
    ("zoo:gpt2", ["--ep", "2"], "--ep 2: this model has no mixture-of-experts layer"),
    (MOE, ["--ep", "3", "--dp", "3"], "--ep 3 does not divide the [8] experts"),
    ("zoo:gpt2", ["--ep", "2", "--sdp", "2"], "--ep 2 with --sdp 2"),
    ("zoo:gpt2", ["--ep", "2", "--zero1", "on"], "--ep 2 with --zero1 on"),
    ("zoo:gpt2", ["--cp", "2", "--sdp", "2"], "--cp 2 with --sdp 2"),
])
def test_an_ep_the_model_cannot_take_is_refused(target: str, argv: list[str], message: str, capsys,
                                                monkeypatch) -> None:
    monkeypatch.setenv("SMP_BENCH_DIMS", SMALL_MOE)
    assert main(["plan", target, "--devices", "6", "--global-batch", "6", *H100, "-q", *argv]) in (1, 2)
    assert message in capsys.readouterr().err


def test_a_fixed_cp_splits_the_sequences_and_writes_its_config(tmp_path: Path, capsys) -> None:
    from smp.runtime.config import load_config

    out, cfg_path = tmp_path / "plan.json", tmp_path / "smp.json"
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "2", *H100, "--cp", "2", "--pp", "1",
                 "--json", str(out), "--config", str(cfg_path), "-q"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["layouts"]
    # a cp group of 2 runs one replica's share: dp / 2 replicas divide the global batch of 2
    assert rows and all(r["cp"] == 2 and r["sdp"] == 1 and r["dp"] % 2 == 0 for r in rows)
    assert " cp " in printed.splitlines()[3] and "context gathers" in printed
    assert "context parallelism: each sequence's 32 tokens split over 2" in printed
    cfg = json.loads(cfg_path.read_text())
    assert cfg["context_parallel_degree"] == 2 and load_config(cfg).context_parallel_degree == 2


def test_a_pipelines_config_carries_the_cut_that_was_priced(tmp_path: Path, capsys) -> None:
    from partitioner import PartitionPlan, trace
    from smp import zoo
    from smp.runtime.config import load_config

    out, cfg_path = tmp_path / "plan.json", tmp_path / "smp.json"
    assert main(["plan", "zoo:gpt2", "--devices", "4", "--global-batch", "32", "--pp", "2", "--tp", "1", *H100,
                 "--schedules", "1f1b", "--json", str(out), "--config", str(cfg_path), "-q"]) == 0
    # what the step must pass: the plan binds to a trace of these inputs only (a labels= keyword adds the loss)
    assert ("smp: the plan was traced from model(input_ids); the step must call the model with exactly these "
            "inputs (a labels= keyword traces the loss too") in capsys.readouterr().err
    best = json.loads(out.read_text())["layouts"][0]
    cfg = json.loads(cfg_path.read_text())
    assert cfg == {**best["smp_config"], "partition_file": "smp.plan.json"}
    assert load_config(str(cfg_path)).partition_file == str(tmp_path / "smp.plan.json")
    plan = PartitionPlan.from_json(tmp_path / "smp.plan.json")
    assert plan.num_stages == 2 and plan.inputs["input_ids"]["shape"][0] == best["microbatch_size"]
    # it binds to the run's trace of one microbatch, as smp.DistributedModel binds a partition_file
    z = zoo.build("gpt2", batch=best["microbatch_size"])
    assert plan.bind(trace(z.model, z.args, z.kwargs), "the plan", 2, microbatches=best["microbatches"]).graph


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [[], ["--pp", "2"]])
def test_the_written_config_trains_on_two_cpu_ranks(tmp_path: Path, fixed: list[str]) -> None:
    from smp.testing import run_ranks
    from tests.smp.scripts import train

    cfg_path = tmp_path / "smp.json"
    assert main(["plan", "zoo:gpt2", "--devices", "2", "--global-batch", "8", "--checkpointing", "none",
                 "--config", str(cfg_path), "-q", *fixed]) == 0
    cfg = json.loads(cfg_path.read_text())
    if fixed:  # the cut smp plan priced, beside the config
        assert cfg["pipeline_parallel_degree"] == 2 and cfg["partition_file"] == "smp.plan.json"
        cfg["partition_file"] = str(tmp_path / cfg["partition_file"])  # train() takes the config as a dict
    results = run_ranks(train, 2, cfg, "gpt2", 3, 8, timeout=300)
    for r in results:
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (cfg, r["losses"], r["ref_losses"])
        assert r["param_rel_err"] < 1e-4, (cfg, r["param_rel_err"])
    assert results[0]["losses"][-1] < results[0]["losses"][0]
