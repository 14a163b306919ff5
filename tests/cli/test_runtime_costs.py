"""The runtime's costs per pass, per step and per collective are measured on real ranks of this machine, fitted
(the fit: ``tests/partitioner/cost/test_runtime_fit.py``), kept, and measured once: never inside a rank, never again
per command after a failure."""
from __future__ import annotations

import json

import pytest

import partitioner.cost.calibration as calibration
from smp.cli import main as smp_main
from smp.cli import runtime_costs
from smp.cli.runtime_costs import ensure_runtime_costs


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A machine with nothing measured yet, as a new process sees it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calibration.RECALIBRATE_ENV, raising=False)
    monkeypatch.setattr(calibration, "_LOADED", {})
    monkeypatch.setattr(runtime_costs, "_TRIED", set())
    return tmp_path


def test_smp_calibrate_measures_on_two_ranks_keeps_and_shows_the_costs(cache_home, capsys) -> None:
    assert smp_main(["calibrate", "--refresh"]) == 0
    out = capsys.readouterr().out
    kept = calibration.recorded_runtime_costs()
    assert kept is not None and "measured on 2 ranks" in out and str(calibration.runtime_costs_file()) in out
    # A pipeline of 8 microbatches pays more passes than one of 2: a fit of nothing would not see that.
    assert kept["measured_s_8"] > kept["measured_s_2"] and kept["worst_error"] < 1.0
    rates = calibration.calibrate()
    assert (rates.pass_overhead_s, rates.step_overhead_s) == (kept["pass_overhead_s"], kept["step_overhead_s"])
    # gloo's all-reduce between two local processes takes hundreds of microseconds beyond a message's latency
    assert rates.collective_overhead_s == kept["collective_overhead_s"] > 5 * rates.link_latency_s
    assert "per collective" in out
    # Shown again without measuring: the same figures, as JSON for scripts.
    assert smp_main(["calibrate", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["runtime_costs"] == kept and shown["rates"]["pass_overhead_s"] == kept["pass_overhead_s"]


def test_measured_once_never_in_a_rank_and_a_failure_is_a_warning(cache_home, monkeypatch, capsys) -> None:
    calls = []

    def failing(*_: object) -> None:
        calls.append(1)
        raise RuntimeError("no free port")

    monkeypatch.setattr(runtime_costs, "measure_runtime_costs", failing)
    monkeypatch.setenv("RANK", "1")
    ensure_runtime_costs()
    assert calls == []  # a rank never measures: its peers would wait on it
    monkeypatch.delenv("RANK")
    ensure_runtime_costs()
    ensure_runtime_costs()
    assert calls == [1]  # a failure is not retried by every command of the process
    err = capsys.readouterr().err
    assert "could not be measured (no free port): predictions use the defaults; `smp calibrate` tries again" in err
    assert calibration.calibrate().pass_overhead_s == calibration.CPU_PASS_OVERHEAD_S
    # Once kept, they are not measured again, unless SMP_RECALIBRATE asks.
    monkeypatch.setattr(runtime_costs, "_TRIED", set())
    calibration.record_runtime_costs(5e-4, 1e-3)
    ensure_runtime_costs()
    assert calls == [1]
    monkeypatch.setenv(calibration.RECALIBRATE_ENV, "1")
    ensure_runtime_costs()
    assert calls == [1, 1]


def test_a_failed_rank_of_the_measurement_is_a_warning_not_a_crash(cache_home, monkeypatch, capsys) -> None:
    import smp.testing

    monkeypatch.setattr(smp.testing, "run_ranks", lambda *a, **k: ["FAILED: Traceback ... gloo: connect refused", None])
    with pytest.raises(RuntimeError, match="on 2 local ranks failed: FAILED: Traceback ... gloo: connect refused"):
        runtime_costs.measure_runtime_costs()
    ensure_runtime_costs()
    assert "could not be measured (measuring the runtime's costs on 2 local ranks failed" in capsys.readouterr().err
    assert calibration.recorded_runtime_costs() is None
