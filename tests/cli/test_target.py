"""``smp.cli.target``: TARGET as ``zoo:NAME`` or ``file.py:factory``, and every way a factory can go wrong as one
error line that names the file and the factory."""
from __future__ import annotations

from pathlib import Path

from tests.cli.helpers import one_line_error, smp


def test_factory_may_return_a_bare_tensor(factory_file: Path, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", f"{factory_file}:single_tensor", "-p", "2", "-q"]) == 0
    assert "lower bound" in capsys.readouterr().out


def test_a_factory_that_exits_is_named(factory_file: Path) -> None:
    line = one_line_error(smp("inspect", f"{factory_file}:exits", "-p", "2", "-q"), "exits()", "sys.exit(3)")
    assert str(factory_file) in line and "(model, example_args)" in line


def test_a_file_that_exits_on_import_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit('usage: train.py DATA')\n")
    one_line_error(smp("inspect", f"{script}:build", "-p", "2", "-q"), f"cannot import {script}",
                   "sys.exit('usage: train.py DATA')", "__name__ == '__main__'")


def test_the_missing_factory_hint_lists_classes_as_classes(factory_file: Path, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", f"{factory_file}:Build", "-p", "2", "-q"]) == 2
    line = capsys.readouterr().err
    functions, classes = line.split("functions defined there: ")[1].split(" (classes, not factories: ")
    assert functions.split(", ") == ["broken", "build", "build_kwargs", "exits", "single_tensor", "wrong"]
    assert classes.startswith("Net)")


META_MLP = '''
import torch


def build():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    return model, (torch.zeros(4, 8),)
'''


def test_on_this_cpu_the_ops_are_timed_unless_estimate_is_asked(tmp_path: Path, capsys) -> None:
    """`--device cpu` (the default) prices the plan from the ops timed here; `--estimate` from the roofline; a meta
    model cannot be timed: the roofline prices it, with a warning, as --estimate does without one."""
    import json

    from smp.cli import main

    for extra, timed in (([], True), (["--estimate"], False)):
        out = tmp_path / f"plan{len(extra)}.json"
        assert main(["inspect", "zoo:mlp", "-p", "2", "-m", "2", "-q", "--json", str(out), *extra]) == 0
        assert json.loads(out.read_text())["options"]["measured"] is timed
    (tmp_path / "meta.py").write_text(META_MLP)
    target = f"{tmp_path / 'meta.py'}:build"
    assert main(["inspect", target, "-p", "2", "-q", "--json", str(tmp_path / "meta.json")]) == 0
    err = capsys.readouterr().err
    assert "on the meta device, so its ops cannot be timed" in err and "--estimate" in err
    assert json.loads((tmp_path / "meta.json").read_text())["options"]["measured"] is False
    assert main(["inspect", target, "-p", "2", "-q", "--estimate"]) == 0
    assert "meta device" not in capsys.readouterr().err


def test_a_cpu_pipeline_is_priced_with_one_thread_per_rank_as_smp_launch_runs_it() -> None:
    import torch

    from smp.cli.target import pricing_threads

    before = torch.get_num_threads()
    with pricing_threads("cpu", 2):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pricing_threads("cpu", 1), pricing_threads("h100-80gb", 2):
        assert torch.get_num_threads() == before  # one rank, or another device: this process's threads
