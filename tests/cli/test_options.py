"""``smp.cli.options``: arguments become one Options object that maps onto partitioner.PartitionOptions, and
sizes, durations and budgets that are negative, NaN or infinite are refused before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner import PartitionOptions
from smp.cli.errors import CLIError
from smp.cli.options import Options


def test_options_map_onto_partition_options() -> None:
    opts = Options(4, "simple", microbatches=8, memory_weight=0.0, device_memory="16GiB", optimizer="sgd")
    assert opts.partition == PartitionOptions(microbatches=8, pipeline="gpipe", memory_weight=0.0,
                                              device_memory=16 * 2**30, optimizer="sgd")
    assert (opts.partitions, opts.microbatches, opts.schedule, opts.pipeline) == (4, 8, "gpipe", "simple")
    assert Options(2).partition == PartitionOptions()  # the partitioner's defaults, not copies of them
    with pytest.raises(CLIError, match=r"unknown partition option\(s\) \['microbatch'\]"):
        Options(2, microbatch=3)
    with pytest.raises(CLIError, match="memory_weight must be in"):
        Options(2, memory_weight=3.0)


def test_arguments_pass_through_by_name(capsys, tmp_path: Path) -> None:
    """An option given on the command line reaches the plan; one left out takes the partitioner's default."""
    from smp.cli import main

    assert main(["inspect", "zoo:mlp", "-p", "2", "--optimizer", "adamw", "--seed", "3", "-q",
                 "--json", str(tmp_path / "plan.json")]) == 0
    options = json.loads((tmp_path / "plan.json").read_text())["options"]
    defaults = PartitionOptions()
    assert options["optimizer"] == "adamw" and options["seed"] == 3
    assert options["memory_weight"] == defaults.memory_weight and options["device_memory"] is None
    capsys.readouterr()


@pytest.mark.parametrize("flag", [["--device-memory", "-1GB"], ["--device-memory=-1GB"], ["--device-memory", "-.5GB"]])
def test_a_negative_memory_size_must_be_positive(flag, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", "zoo:mlp", "-p", "2", "-q", *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith("smp: error: argument --device-memory: cannot read memory size '-") and "positive" in err


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "zoo:mlp", "-p", "2", "--device-memory", "nan"], "memory size 'nan'"),
    (["inspect", "zoo:mlp", "-p", "2", "--device-memory", "inf"], "memory size 'inf'"),
    (["inspect", "zoo:mlp", "-p", "2", "--device-memory", "1e400GB"], "finite"),
    (["inspect", "zoo:mlp", "-p", "2", "--memory-weight", "nan"], "between 0 and 1"),
    (["inspect", "zoo:mlp", "-p", "2", "--max-actions", "inf"], "'inf' is not an integer"),
    (["inspect", "zoo:mlp", "-p", "2", "--max-actions", "2.5e0"], "'2.5e0' is not an integer"),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--inter-node-bandwidth", "inf"], "memory size 'inf'"),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--inter-node-latency", "1e999"], "duration '1e999'"),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--inter-node-latency", "nan"], "duration 'nan'"),
    (["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--inter-node-latency", "-1ms"], "non-negative"),
])
def test_budgets_that_are_not_finite_are_errors(argv, needle, capsys) -> None:
    """NaN and infinity never reach the plan or its JSON: the argument is refused with its value."""
    from smp.cli import main

    assert main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("smp: error: argument --") and needle in err and err.count("\n") == 1, err


def test_device_dtype_and_links_reach_the_partition_options() -> None:
    from smp.cli.entry import build_parser

    ns = build_parser().parse_args(["inspect", "zoo:mlp", "-p", "2", "--device", "h100-80gb", "--dtype", "bf16",
                                    "--link", "pcie5", "--inter-node-link", "efa-p5", "--device-memory", "unlimited"])
    assert Options.from_args(ns).partition == PartitionOptions(device="h100-80gb", dtype="bf16", link="pcie5",
                                                               inter_node_link="efa-p5", device_memory="unlimited")
    ns = build_parser().parse_args(["simulate", "zoo:mlp", "-p", "2", "-m", "2", "--device", "a100-40gb"])
    rates = Options.from_args(ns).partition.resolve_rates()
    assert Options.from_args(ns).partition.budget(rates) == 40e9  # --device-memory defaults to the device's


@pytest.mark.parametrize("flag, value, known", [("--device", "h100", "h100-80gb"), ("--dtype", "int8", "bf16"),
                                                ("--link", "nvlink", "nvlink4"),
                                                ("--inter-node-link", "ib", "infiniband-ndr")])
def test_unknown_device_dtype_or_link_lists_the_known_ones(flag, value, known, capsys) -> None:
    from partitioner import DEVICES, LINKS
    from smp.cli import main

    assert main(["inspect", "zoo:mlp", "-p", "2", "-q", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"smp: error: argument {flag}: invalid choice: '{value}'") and known in err, err
    names = DEVICES if flag == "--device" else LINKS if "link" in flag else ()
    assert all(name in err for name in names), err
