"""The SMP v1 names scripts reach through ``import smp`` alone (``smp.nn.FusedLayerNorm`` without importing
``smp.nn``, as ``smdistributed.modelparallel.torch`` allowed), and ``smp.__version__``."""
from __future__ import annotations

import re
from pathlib import Path

import smp


def test_names_reachable_from_the_package():
    assert smp.nn.FusedLayerNorm and smp.optimizers.FusedLAMB is smp.optimizers.FusedLamb
    assert callable(smp.utils.rmsg) and callable(smp.tensor_parallelism)
    assert issubclass(smp.NoEffectWarning, UserWarning)
    for name in ("get_module", "register_post_step_hook", "register_post_partition_hook"):
        assert callable(getattr(smp.DistributedModel, name)), name
    for name in ("clip_master_grads", "step", "local_state_dict"):
        assert callable(getattr(smp.DistributedOptimizer, name)), name
    assert set(smp.__all__) <= set(dir(smp))


def test_version_is_the_package_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", smp.__version__)
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'version = { attr = "smp.__version__" }' in pyproject  # one source of truth
