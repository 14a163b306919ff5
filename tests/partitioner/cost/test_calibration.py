"""The CPU profile is measured once per machine and cached on disk, so plans do not move with the load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import partitioner.cost.calibration as calibrate_mod
from partitioner import DeviceRates, calibrate

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """A fresh cache directory, and a process that has not loaded a profile from it yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calibrate_mod.RECALIBRATE_ENV, raising=False)
    monkeypatch.setattr(calibrate_mod, "_LOADED", {})
    return tmp_path


def _forget(monkeypatch):
    """As a new process would start: nothing loaded in memory."""
    monkeypatch.setattr(calibrate_mod, "_LOADED", {})


FAKE = 1.23e9  # a FLOP rate no measurement gives: seeing it means the cache file was read


def _calibrate_then_fake_the_cache(cpu: str | None = None) -> Path:
    """Calibrate, then write FAKE (and another CPU model, if given) into the cache file; returns its path."""
    calibrate()
    path = calibrate_mod.cache_file()
    data = json.loads(path.read_text())
    data["rates"]["flops_per_s"] = FAKE
    data["key"]["cpu"] = cpu or data["key"]["cpu"]
    path.write_text(json.dumps(data))
    return path


def test_profile_is_measured_once_and_cached_per_machine(cache_home, monkeypatch):
    rates = calibrate()
    path = calibrate_mod.cache_file()
    assert path.parent == cache_home / "smp-engine" and path.exists()
    data = json.loads(path.read_text())
    assert data["key"] == {"cpu": calibrate_mod._cpu_model(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "profile": calibrate_mod._PROFILE_VERSION}
    assert DeviceRates.from_dict(data["rates"]) == rates and rates.name == "cpu"
    # A later process reads the file instead of measuring: changed figures there are what it gets.
    _calibrate_then_fake_the_cache()
    _forget(monkeypatch)
    assert calibrate().flops_per_s == FAKE
    assert calibrate() is calibrate()  # and it reads the file once


def test_refresh_measures_again_and_replaces_the_cache(cache_home, monkeypatch):
    path = _calibrate_then_fake_the_cache()
    assert calibrate(refresh=True).flops_per_s != FAKE
    assert json.loads(path.read_text())["rates"]["flops_per_s"] != FAKE


def test_environment_variable_refreshes_once_per_process(cache_home, monkeypatch):
    _calibrate_then_fake_the_cache()
    _forget(monkeypatch)
    monkeypatch.setenv(calibrate_mod.RECALIBRATE_ENV, "1")
    first = calibrate()
    assert first.flops_per_s != FAKE and calibrate() is first


def test_another_machine_or_a_broken_file_is_measured_again(cache_home, monkeypatch):
    path = _calibrate_then_fake_the_cache(cpu="some other CPU")
    _forget(monkeypatch)
    assert calibrate().flops_per_s != FAKE
    path.write_text("{not json")
    _forget(monkeypatch)
    assert calibrate().name == "cpu" and json.loads(path.read_text())["key"]["cpu"] == calibrate_mod._cpu_model()


def test_runtime_costs_stand_in_until_measured_then_every_process_prices_with_them(cache_home, monkeypatch):
    before = calibrate()
    assert (before.pass_overhead_s, before.step_overhead_s) == (calibrate_mod.CPU_PASS_OVERHEAD_S,
                                                                calibrate_mod.CPU_STEP_OVERHEAD_S)
    assert calibrate_mod.recorded_runtime_costs() is None
    kept = calibrate_mod.record_runtime_costs(4.2e-4, 7.5e-3, worst_error=0.05)
    assert (kept.pass_overhead_s, kept.step_overhead_s) == (4.2e-4, 7.5e-3) and kept.flops_per_s == before.flops_per_s
    assert calibrate() == kept  # this process at once
    _forget(monkeypatch)
    assert (calibrate().pass_overhead_s, calibrate().step_overhead_s) == (4.2e-4, 7.5e-3)  # and the next one
    # Measuring the microbenchmarks again keeps them, and so does another thread count (ranks run with one).
    assert calibrate(refresh=True).pass_overhead_s == 4.2e-4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert calibrate().step_overhead_s == 7.5e-3
    finally:
        torch.set_num_threads(threads)
    assert calibrate_mod.recorded_runtime_costs()["worst_error"] == 0.05


def test_runtime_costs_of_another_torch_or_a_broken_file_are_not_used(cache_home, monkeypatch):
    calibrate_mod.record_runtime_costs(4.2e-4, 7.5e-3)
    path = calibrate_mod.runtime_costs_file()
    data = json.loads(path.read_text())
    data["key"]["torch"] = "0.0.1"
    path.write_text(json.dumps(data))
    _forget(monkeypatch)
    assert calibrate().pass_overhead_s == calibrate_mod.CPU_PASS_OVERHEAD_S
    for broken in ("{not json", json.dumps({**data, "key": calibrate_mod._runtime_key(), "costs": {
            "pass_overhead_s": -1.0, "step_overhead_s": 0.0}})):
        path.write_text(broken)
        assert calibrate_mod.recorded_runtime_costs() is None
    with pytest.raises(ValueError, match="pass_overhead_s must be a non-negative number of seconds, got -0.001"):
        calibrate_mod.record_runtime_costs(-1e-3, 0.0)


def test_the_cache_is_keyed_by_thread_count(cache_home):
    threads = torch.get_num_threads()
    try:
        first = calibrate_mod.cache_file()
        torch.set_num_threads(threads + 1)
        assert calibrate_mod.cache_file() != first
    finally:
        torch.set_num_threads(threads)


def test_an_unwritable_cache_still_gives_rates(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(calibrate_mod, "_LOADED", {})
    assert calibrate().flops_per_s > 0


@pytest.mark.slow  # the portfolio's two-process test (tests/partitioner/cut/test_portfolio.py) runs by default
def test_two_processes_make_the_same_plan(tmp_path):
    """The same model and options give the same plan JSON from one process to the next (the second process
    reads the profile the first one measured)."""
    script = textwrap.dedent("""
        import torch, partitioner
        torch.manual_seed(0)
        layers = []
        for width in (256, 512, 128, 384, 256, 512, 64, 256):
            layers += [torch.nn.Linear(layers[-2].out_features if layers else 256, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(256))
        print(partitioner.partition(model, 3, example_inputs=(torch.randn(32, 256),), microbatches=4).to_json())
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(calibrate_mod.RECALIBRATE_ENV, None)
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout
    plan = json.loads(runs[0].stdout)
    assert plan["rates"]["name"] == "cpu" and plan["options"]["device"] == "cpu"

