"""``smp.cli.limits``: work that would not finish in minutes or fit in memory is refused up front, with the
estimate and the flag that raises the limit."""
from __future__ import annotations

import pytest

from smp.cli.errors import CLIError
from smp.cli.limits import DEFAULT_MAX_ACTIONS, check_actions, schedule_actions
from tests.cli.helpers import ok, one_line_error, smp


def test_the_estimate_counts_stages_microbatches_and_passes() -> None:
    assert schedule_actions(4, 8) == 64 and schedule_actions(4, 8, split_backward=True) == 96
    check_actions({"a": 10, "b": 20}, 30)
    with pytest.raises(CLIError, match=r"would simulate 31 schedule actions .*a 11, b 20.* --max-actions 30"):
        check_actions({"a": 11, "b": 20}, 30)


@pytest.mark.parametrize("argv, needles", [
    (["inspect", "zoo:mlp", "-p", "2", "--microbatches", "100000000000"],
     ["1.6e+12 schedule actions", "plan 4e+11, uniform 4e+11, params 4e+11, layers 4e+11",
      "--max-actions 3e+07", "about 90.9 TiB"]),
    (["simulate", "zoo:mlp", "-p", "100000", "-m", "100000"],
     ["1.1e+11", "interleaved-virtual 4e+10", "zero-bubble 3e+10", "--max-actions"]),
    (["simulate", "zoo:mlp", "-p", "10000000", "-m", "1"], ["7e+07", "gpipe 2e+07", "--max-actions"]),
])
def test_huge_runs_are_refused_before_any_work(argv, needles) -> None:
    result = smp(*argv, timeout=120)
    one_line_error(result, *needles)
    assert result.stderr.count("\n") == 1, result.stderr  # no progress line: nothing was built or traced


def test_the_limit_is_a_flag(capsys) -> None:
    from smp.cli import main

    assert main(["simulate", "zoo:mlp", "-p", "2", "-m", "4", "--schedules", "1f1b", "--max-actions", "8",
                 "-q"]) == 2
    assert "--max-actions 8 allows" in capsys.readouterr().err
    out = ok(smp("simulate", "zoo:mlp", "-p", "2", "-m", "4", "--schedules", "1f1b", "--max-actions", "100", "-q"))
    assert "winner" in out
    assert DEFAULT_MAX_ACTIONS >= 23_100_000  # README: the full comparison at 1024 x 2048 runs by default
