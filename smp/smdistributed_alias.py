"""``smp.alias_smdistributed()``: make ``import smdistributed.modelparallel.torch`` import this ``smp``, and
``import smdistributed.dataparallel.torch`` its data-parallel twin :mod:`smp.smddp`, for code that cannot be edited
(a library such as Hugging Face's ``Trainer``, or a training script written for SageMaker).

The alias is opt-in: call it before the library is imported, or launch with ``smp launch --as-smdistributed``,
which sets :data:`ALIAS_ENV` so that every rank calls it before the script runs (:mod:`smp.cli.worker`,
:func:`alias_from_environment`). It puts a finder first on ``sys.meta_path`` that answers for these names and
everything under the two packages it maps:

- ``smdistributed``, ``smdistributed.modelparallel`` and ``smdistributed.dataparallel``: empty packages; the
  latter two's ``__version__`` are :data:`SMP_V1_VERSION`, the SMP v1 release whose behaviour this engine matches
  (libraries gate their SMP code paths on it, as ``transformers`` does on ``>= 1.10``), and
  :data:`SMDDP_V1_VERSION`, the data-parallel release whose API :mod:`smp.smddp` has;
- ``smdistributed.modelparallel.torch[.<x>]`` and ``smdistributed.dataparallel.torch[.<x>]``: the very modules
  ``smp[.<x>]`` and ``smp.smddp[.<x>]`` (one module object under two names, so there is one state), so that
  ``import smdistributed.modelparallel.torch as smp``, ``from smdistributed.modelparallel.torch.nn import ...``,
  ``import smdistributed.dataparallel.torch.distributed as dist`` and ``import
  smdistributed.dataparallel.torch.torch_smddp`` work, and ``importlib.util.find_spec("smdistributed")`` finds it;
- ``smdistributed.modelparallel.test.torch.utils``, SMP's own test helpers, which SageMaker's published BERT script
  imports (and never calls): :mod:`smp.v1_test_utils`.

Where a real ``smdistributed`` is importable the alias would hide it, so it is refused unless ``force=True``
(``smp launch --shadow-smdistributed``).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Sequence

__all__ = ["alias_smdistributed", "alias_from_environment", "check_no_real_smdistributed", "SMP_V1_VERSION",
           "SMDDP_V1_VERSION", "ALIAS_ENV", "SmdistributedAliasError"]

# transformers' SMP branch needs >= 1.10 (tagged checkpoints, fp16 from the config) and gates nothing on later
# releases; the sharded data parallelism of 1.11 is here too (sharded_data_parallel_degree), but the version a library
# reads stays the one whose behaviour that library was tested against here.
SMP_V1_VERSION = "1.10.0"
# The data-parallel release with both of its PyTorch APIs: smdistributed.dataparallel.torch.distributed and its
# DistributedDataParallel (deprecated there, still shipped) and the torch.distributed backend "smddp" (new there).
SMDDP_V1_VERSION = "1.4.0"
ALIAS_ENV = "SMP_AS_SMDISTRIBUTED"  # set by smp launch for its ranks (smp.cli.worker reads it)
_ROOT = "smdistributed"
_PACKAGES = {"smdistributed.modelparallel": SMP_V1_VERSION, "smdistributed.dataparallel": SMDDP_V1_VERSION}
_MAPPED = {"smdistributed.modelparallel.torch": "smp", "smdistributed.dataparallel.torch": "smp.smddp",
           "smdistributed.modelparallel.test.torch.utils": "smp.v1_test_utils"}
_EMPTY = {"smdistributed.modelparallel.test", "smdistributed.modelparallel.test.torch"}  # parents of a mapped name


def _target(fullname: str) -> str | None:
    """The ``smp`` module an aliased name stands for (None for a name the alias does not map)."""
    for alias, target in _MAPPED.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return target + fullname[len(alias):]
    return None


class SmdistributedAliasError(RuntimeError):
    """A real ``smdistributed`` is installed, which the alias would hide."""


class _Loader(importlib.abc.Loader):
    """Makes the empty parent packages, or hands back the ``smp`` module an aliased name stands for."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # smp module name -> its own spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = _target(spec.name)
        if target is None:
            module = types.ModuleType(spec.name, f"stands for SageMaker's {spec.name}: the alias of "
                                                 "smp.alias_smdistributed()")
            module.__path__ = []
            if spec.name in _PACKAGES:
                module.__version__ = _PACKAGES[spec.name]  # type: ignore[attr-defined]
            return module
        module = importlib.import_module(target)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is complete (an empty package, or an ``smp`` module already imported). An
        ``smp`` module gets back its own ``__spec__``, which the import system has just set to the alias's."""
        if module.__name__ in self._specs:
            module.__spec__ = self._specs[module.__name__]


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for ``smdistributed``, its two packages and the names under them that it maps."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == _ROOT or fullname in _PACKAGES or fullname in _EMPTY:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
        mapped = _target(fullname)
        if mapped is None:
            return None
        real = importlib.util.find_spec(mapped)
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=real.submodule_search_locations is not None)


_LOADER = _Loader()


def _installed() -> _Finder | None:
    return next((f for f in sys.meta_path if isinstance(f, _Finder)), None)


def _real_smdistributed() -> Any:
    """Where a real ``smdistributed`` would be imported from (None when there is none)."""
    try:
        return importlib.util.find_spec(_ROOT)
    except (ImportError, ValueError):
        return None


def check_no_real_smdistributed(fix: str = "pass force=True to use smp in its place anyway") -> None:
    """Raise :class:`SmdistributedAliasError`, whose message ends with ``fix``, when a real ``smdistributed`` is
    importable (or imported) in this process."""
    if _installed() is not None:
        return
    real = _real_smdistributed()
    if real is not None:
        where = real.origin or ", ".join(real.submodule_search_locations or []) or "sys.modules"
        raise SmdistributedAliasError(f"a real smdistributed is installed ({where}); aliasing "
                                      "smdistributed.modelparallel.torch to smp would hide it in this process: "
                                      f"uninstall it or use another environment, or {fix}")


def alias_smdistributed(force: bool = False) -> None:
    """Make ``import smdistributed.modelparallel.torch`` import ``smp``, and ``import smdistributed.dataparallel.torch``
    import :mod:`smp.smddp`, in this process (see the module docstring).
    Call it before importing the library that imports ``smdistributed``; calling it again changes nothing.

    Raises :class:`SmdistributedAliasError` when a real ``smdistributed`` is importable (or already imported),
    unless ``force`` (then this process uses ``smp`` in its place)."""
    if _installed() is not None:
        return
    if not force:
        check_no_real_smdistributed()
    for name in [n for n in sys.modules if n == _ROOT or n.startswith(_ROOT + ".")]:
        del sys.modules[name]  # force: the real one was imported already; it is replaced from here on
    sys.meta_path.insert(0, _Finder())


def alias_from_environment() -> None:
    """Install the alias when :data:`ALIAS_ENV` asks for it (``smp launch --as-smdistributed`` sets it to ``1``,
    ``--shadow-smdistributed`` to ``force``); anything else but unset or empty is an error naming the values."""
    mode = os.environ.get(ALIAS_ENV, "")
    if mode not in ("", "0", "1", "force"):
        raise SmdistributedAliasError(f"{ALIAS_ENV}={mode!r} is not valid: 1 (alias smdistributed to smp), force "
                                      "(also over a real smdistributed), or 0 / unset (no alias)")
    if mode in ("1", "force"):
        alias_smdistributed(force=mode == "force")
