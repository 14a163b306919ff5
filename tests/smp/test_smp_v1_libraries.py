"""What libraries written for SMP v1 (Hugging Face's ``Trainer``) need of smp, each gap on its own: the config from
SageMaker's environment, ``smp.state``, ``optimizer.local_state_dict(gather_if_shard=...)``, ``smp.save(..., v3=)``,
``StepOutput.detach()``, SMP's ``_smp_is_partial`` marker, and the opt-in ``smdistributed`` alias. The Trainer itself
runs in ``tests/smp/test_hf_trainer.py`` (``-m slow``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from smp.checkpoint.state_dicts import OLD_PARTIAL_KEY, PARTIAL_KEY, unmarked
from smp.runtime import sagemaker_env
from smp.runtime.config import load_config
from smp.testing import run_ranks
from tests.smp.features import loss_and_outputs_step, make_batch, make_net

ROOT = Path(__file__).resolve().parents[2]
SM_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 4, "ddp": True}),
          "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}


def _python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (imports and sys.meta_path as a user's process has them)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          cwd=cwd, timeout=120)


# --- the config from SageMaker's environment ------------------------------------------------------------------

def test_no_argument_reads_sm_hp_mp_parameters(monkeypatch) -> None:
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", SM_ENV["SM_HP_MP_PARAMETERS"])
    cfg = load_config(None)
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.ddp) == (2, 4, True)


def test_the_environment_wins_over_a_passed_config_with_a_warning(monkeypatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", SM_ENV["SM_HP_MP_PARAMETERS"])
    with pytest.warns(UserWarning, match="'microbatches'=2 is overridden by SM_HP_MP_PARAMETERS's 'microbatches'=4"):
        cfg = load_config({"pipeline_parallel_degree": 2, "microbatches": 2, "fp16": False})
    assert (cfg.microbatches, cfg.ddp, cfg.fp16) == (4, True, False)


def test_without_any_config_the_error_names_both_variables(monkeypatch) -> None:
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    with pytest.raises(ValueError, match="SMP_CONFIG.*SM_HP_MP_PARAMETERS"):
        load_config(None)


def test_bad_sagemaker_variables_are_named(monkeypatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", "{partitions: 2")
    with pytest.raises(sagemaker_env.SageMakerEnvError, match="SM_HP_MP_PARAMETERS=.* is not valid JSON"):
        load_config(None)
    monkeypatch.setenv("SM_FRAMEWORK_PARAMS", json.dumps({"sagemaker_mpi_num_of_processes_per_host": 8}))
    with pytest.raises(sagemaker_env.SageMakerEnvError, match="processes_per_host=8, but 2 processes.*smp launch -n 8"):
        sagemaker_env.check_processes_per_host(2)
    sagemaker_env.check_processes_per_host(8)


def _second_init(rank: int, world: int) -> tuple:
    import smp

    first = smp.init()  # as transformers' training_args does, with the config in SM_HP_MP_PARAMETERS
    with pytest.warns(UserWarning, match="already called.*ignored"):
        again = smp.init()
    cfg = smp.state.cfg
    return (first is again, smp.pp_size(), smp.dp_size(), cfg.microbatches, cfg.fp16, cfg.prescaled_batch,
            cfg.shard_optimizer_state, cfg.pipeline, cfg.active_microbatches, cfg.memory_weight,
            smp.state.initialized, smp.state.module_manager.translate_functions)


def test_smp_init_with_no_argument_in_a_sagemaker_job(monkeypatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"partitions": 2, "microbatches": 4, "pipeline": "simple"}))
    got = run_ranks(_second_init, 2)
    assert got[0] == got[1] == (True, 2, 1, 4, False, False, False, "simple", 4, 0.2, True, [])


# --- smp.state --------------------------------------------------------------------------------------------

def test_smp_state_before_init_is_smps() -> None:
    done = _python("""
        import smp
        print(smp.state.initialized, smp.state.cfg, smp.state.module_manager.translate_functions)
        try:
            smp.state.cfg = 1
        except AttributeError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False None []", "smp.state is read-only (setting 'cfg'): smp.init builds the "
                                        "state"]


# --- optimizer, save and load, step outputs, markers ---------------------------------------------------------

def _checkpoint_surface(rank: int, world: int, path: str) -> dict:
    import smp

    smp.init({"pipeline_parallel_degree": 1, "microbatches": 2, "ddp": True, "shard_optimizer_state": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(make_net())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    train_step = loss_and_outputs_step()
    x, y = make_batch(0)
    loss, out = train_step(model, x.chunk(2)[smp.dp_rank()], y.chunk(2)[smp.dp_rank()])
    opt.step()
    detached = out.detach()
    shard = opt.local_state_dict(gather_if_shard=False)  # what the Trainer saves
    whole = opt.local_state_dict(gather_if_shard=True)
    smp.save(shard, os.path.join(path, "optimizer.pt"), partial=True, v3=smp.state.cfg.shard_optimizer_state)
    loaded = smp.load(os.path.join(path, "optimizer.pt"), partial=True, back_compat=True)
    opt.load_state_dict(loaded)
    opt.load_state_dict(whole)  # a gathered stage state loads into every shard
    local = model.local_state_dict()
    full_marked = {**model.state_dict(), PARTIAL_KEY: False}  # as the Trainer's resume marks a full dict
    model.load_state_dict(full_marked, strict=True)
    return {"detached": type(detached).__name__, "requires_grad": any(o.requires_grad for o in detached.outputs),
            "concat": tuple(detached.concat().shape), "shard": sorted(shard["state"]), "whole": sorted(whole["state"]),
            "files": sorted(os.listdir(path)), "marker": local.get(PARTIAL_KEY), "old": OLD_PARTIAL_KEY in local,
            "loaded": sorted(loaded["state"]) == sorted(shard["state"])}


def test_the_trainer_facing_checkpoint_calls(tmp_path: Path) -> None:
    a, b = run_ranks(_checkpoint_surface, 2, str(tmp_path))
    assert a["detached"] == "StepOutput" and not a["requires_grad"]
    assert a["concat"][0] == 4  # the replica's half of the batch
    assert a["shard"] and b["shard"] and not set(a["shard"]) & set(b["shard"])  # each replica its own shard
    assert a["whole"] == b["whole"] == sorted(a["shard"] + b["shard"])          # gathered: the stage's whole state
    assert a["files"] == ["optimizer.pt.manifest.json", "optimizer.pt_0_0", "optimizer.pt_0_1"]
    assert a["marker"] is True and not a["old"] and a["loaded"] and b["loaded"]


def test_markers_ours_and_smps_are_read_and_unmarked_full_dicts_are_translated() -> None:
    w = torch.zeros(1)
    assert unmarked({"a": w, PARTIAL_KEY: True, "_smp_load_info": {}}) == ({"a": w}, True)
    assert unmarked({"a": w, OLD_PARTIAL_KEY: True}) == ({"a": w}, True)
    pairs = [(lambda sd: sd, lambda sd: {f"smp.{k}": v for k, v in sd.items()})]
    assert unmarked({"a": w}, translators=pairs) == ({"smp.a": w}, False)  # SMP: an unmarked full dict may be HF's
    assert unmarked({"a": w, PARTIAL_KEY: False}, translators=pairs) == ({"a": w}, False)  # marked: already ours
    assert unmarked({"a": w}, lambda sd: {"b": sd["a"]}, pairs) == ({"b": w}, False)


# --- the smdistributed alias ------------------------------------------------------------------------------------

def test_the_alias_imports_smp_as_smdistributed() -> None:
    done = _python("""
        import importlib.util, sys
        import smp
        assert importlib.util.find_spec("smdistributed") is None
        smp.alias_smdistributed()
        assert importlib.util.find_spec("smdistributed") is not None
        import smdistributed.modelparallel.torch as smp2
        from smdistributed.modelparallel import __version__
        from smdistributed.modelparallel.torch.model import DistributedModel
        import smdistributed.modelparallel.torch.nn as nn2
        import smp.nn
        print(smp2 is smp, nn2 is smp.nn, DistributedModel is smp.DistributedModel, __version__,
              smp.__spec__.name, smp.nn.__spec__.name)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "1.10.0", "smp", "smp.nn"]


def test_the_alias_refuses_to_hide_a_real_smdistributed(tmp_path: Path) -> None:
    (tmp_path / "smdistributed").mkdir()
    (tmp_path / "smdistributed" / "__init__.py").write_text("REAL = True\n")
    done = _python("""
        import smp
        try:
            smp.alias_smdistributed()
        except smp.smdistributed_alias.SmdistributedAliasError as exc:
            print("refused:", exc)
        smp.alias_smdistributed(force=True)
        import smdistributed.modelparallel.torch as smp2
        print(smp2 is smp)
    """, cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr
    refused, forced = done.stdout.splitlines()
    assert "a real smdistributed is installed" in refused and "force=True" in refused and forced == "True"


def test_smp_launch_as_smdistributed(tmp_path: Path) -> None:
    script = tmp_path / "lib_user.py"
    script.write_text("import smdistributed.modelparallel.torch as smp\n"
                      "from smdistributed.modelparallel import __version__\n"
                      "print('aliased', smp.__name__, __version__)\n")
    done = subprocess.run([sys.executable, "-m", "smp.cli", "launch", "-n", "1", "--log-dir", str(tmp_path / "logs"),
                           "--as-smdistributed", str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "aliased smp 1.10.0" in done.stdout
    dry = subprocess.run([sys.executable, "-m", "smp.cli", "launch", "-n", "2", "--dry-run", "--as-smdistributed",
                          str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "SMP_AS_SMDISTRIBUTED=1 " in dry.stdout, dry.stdout + dry.stderr
    (tmp_path / "smdistributed").mkdir()
    (tmp_path / "smdistributed" / "__init__.py").write_text("")
    refused = subprocess.run([sys.executable, "-m", "smp.cli", "launch", "-n", "1", "--as-smdistributed", str(script)],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert refused.returncode == 2 and "--shadow-smdistributed" in refused.stderr, refused.stderr
