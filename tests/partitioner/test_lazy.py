"""``partitioner.lazy``: ``import partitioner`` and ``import smp`` load nothing heavy, every public name still
resolves, and an exported function (``partitioner.partition``, ``smp.step``) stays the function
whatever is imported first. Each check runs in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


def test_packages_import_without_torch() -> None:
    _python("import sys, partitioner, smp, partitioner.errors, partitioner.units\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert {'partition', 'PartitionPlan'} <= set(dir(partitioner)) and 'DistributedModel' in dir(smp)")


@pytest.mark.parametrize("first", [pytest.param("import partitioner.cut.portfolio", marks=pytest.mark.slow),
                                   "from partitioner.cut.portfolio import make_problem",
                                   "import partitioner.cost.timing, partitioner.capture.tracing, "
                                   "partitioner.capture.stage_modules", pytest.param("", marks=pytest.mark.slow)])
def test_exported_functions_win_over_their_submodules(first: str) -> None:
    _python(f"{first}\nimport inspect, partitioner\n"
            "for name in ('partition', 'trace', 'measure', 'split', 'calibrate'):\n"
            "    value = getattr(partitioner, name)\n"
            "    assert callable(value) and not inspect.ismodule(value), name\n"
            "assert partitioner.cut.objective.stage_crossings  # a submodule that is not exported loads on access\n"
            "for name in partitioner.__all__:\n"
            "    getattr(partitioner, name)")


@pytest.mark.parametrize("first", ["from smp.engine.step_function import StepOutput",
                                   pytest.param("import smp.distributed_model", marks=pytest.mark.slow),
                                   pytest.param("import smp.engine.step_function", marks=pytest.mark.slow), ""])
def test_smp_step_is_the_decorator_whatever_is_imported_first(first: str) -> None:
    _python(f"{first}\nimport inspect, smp, smp.distributed_model\n"
            "assert inspect.isfunction(smp.step) and smp.step.__module__ == 'smp.engine.step_function'\n"
            "assert smp.amp.__name__ == 'smp.amp'\n"
            "assert [n for n in smp.__all__ if getattr(smp, n) is None] == []")


def test_an_unknown_name_is_an_attribute_error() -> None:
    _python("import smp\ntry:\n    smp.nope\nexcept AttributeError as exc:\n"
            "    assert str(exc) == \"module 'smp' has no attribute 'nope'\"\nelse:\n    raise SystemExit(1)")
