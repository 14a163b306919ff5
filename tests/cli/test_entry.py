"""``smp.cli.entry``: the commands' parser, what importing the command costs, and the one rule for errors (one
line, ``smp: error: ...``, no traceback, non-zero exit)."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner.errors import EngineError
from tests.cli.helpers import REPO, ok, one_line_error, smp, smp_env, smp_process


def test_help_lists_the_commands(capsys) -> None:
    from smp.cli import main

    out = ok(smp("--help"))
    for command in ("inspect", "simulate", "demo", "launch"):
        assert command in out
    for command in ("inspect", "simulate", "demo", "launch"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0 and "usage: smp " + command in capsys.readouterr().out


def test_importing_the_command_imports_no_torch() -> None:
    code = "import smp.cli, sys; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=smp_env(), check=True)


def test_help_takes_under_a_second_of_cpu() -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ok(smp("--help"))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 1.0, f"smp --help took {cpu:.2f} s of CPU"


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
    (["inspect", "zoo:mlp", "-p", "2", "--method", "best", "-q"], ["method='best'", "metis"]),
    (["inspect", "zoo:mlp", "-p", "2", "--pipeline", "zb", "-q"], ["pipeline 'zb' is not known", "1f1b"]),
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


def test_an_unknown_option_points_at_the_commands_help() -> None:
    line = one_line_error(smp("inspect", "zoo:mlp", "-p", "2", "--frob"), "unrecognized arguments: --frob")
    assert "see 'smp inspect --help'" in line
    line = one_line_error(smp("simulate", "zoo:mlp", "-p", "2", "-m", "2", "--frob", "x"), "--frob x")
    assert "see 'smp simulate --help'" in line


def _failing(error: Exception):
    def run(ns) -> int:
        raise error
    return run


@pytest.mark.parametrize("error, code, line", [
    (type("BudgetError", (EngineError, RuntimeError), {})("no 2-stage plan fits\n  device_memory=1 GiB"), 1,
     "smp: error: no 2-stage plan fits device_memory=1 GiB"),
    (ValueError("num_stages=50 is too many"), 1, "smp: error: num_stages=50 is too many"),
    (FileNotFoundError(2, "No such file or directory", "plan.json"), 1, "smp: error: FileNotFoundError: "),
    (KeyError("oops"), 1, "smp: error: internal error, KeyError: 'oops' (set SMP_TRACEBACK=1 to see where)"),
])
def test_errors_are_told_apart_by_class(error, code, line, monkeypatch, capsys) -> None:
    """Any EngineError (whatever its name) and any ValueError is the user's: its message alone; anything
    else is a bug and says so."""
    from smp.cli import entry
    from smp.cli.commands import launch

    monkeypatch.setattr(launch, "run", _failing(error))
    monkeypatch.delenv("SMP_TRACEBACK", raising=False)
    assert entry.main(["launch", "-n", "1", "x.py"]) == code
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_traceback_on_request_and_interrupt_status(monkeypatch, capsys) -> None:
    from smp.cli import entry
    from smp.cli.commands import launch

    monkeypatch.setattr(launch, "run", _failing(KeyError("oops")))
    monkeypatch.setenv("SMP_TRACEBACK", "1")
    with pytest.raises(KeyError):
        entry.main(["launch", "-n", "1", "x.py"])
    monkeypatch.setattr(launch, "run", _failing(KeyboardInterrupt()))
    assert entry.main(["launch", "-n", "1", "x.py"]) == 130
    assert capsys.readouterr().err == "smp: interrupted\n"


def test_bad_target_and_bad_sizes_are_one_line() -> None:
    one_line_error(smp("inspect", "zoo:nope", "-p", "2", "-q"), "unknown zoo model", "gpt2")
    one_line_error(smp("inspect", "zoo:mlp", "-p", "2", "--device-memory", "12XB", "-q"), "12XB", "GiB")
    one_line_error(smp("inspect", "zoo:mlp", "-p", "50", "-q"), "num_stages=50", "at most")


def test_version_and_did_you_mean() -> None:
    """Through ``python -m smp.cli`` itself, the entry point a user runs (the other tests fork it: tests.forked)."""
    assert ok(smp_process("--version")).startswith("smp (smp-engine) ")
    one_line_error(smp("inspect", "zoo:mlp", "--partitons", "2"), "(did you mean --partitions?)")
    one_line_error(smp("inspct", "zoo:mlp"), "(did you mean inspect?)")
    one_line_error(smp("inspect", "zoo:mlp", "-p", "2", "--microbaches", "4"), "(did you mean --microbatches?)")
