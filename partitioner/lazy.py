"""Lazy package exports (PEP 562): a package's public names are imported on first use, not with the package.

``import partitioner`` or ``import smp`` used to import every submodule, and with them torch, which takes
seconds; ``smp --help`` and the one-line errors of the ``smp`` command need none of it. A package lists its
public names as the relative imports of an ``if TYPE_CHECKING:`` block, which type checkers and editors read
as usual, and binds ``__getattr__, __dir__ = lazy_exports(__name__)``: that reads the block (as
scientific-python's ``lazy_loader.attach_stub`` reads a stub file) and, the first time ``package.name`` is
read, imports the submodule and keeps the value. A submodule that is not exported (``partitioner.cut.objective``)
is imported on access too, as it was when the package imported everything.

No exported name is also the name of a submodule (the modules are named for concepts, the functions for
actions: ``tracing.trace``, ``portfolio.partition``), so importing a submodule never hides an export.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports", "type_checking_imports"]


def type_checking_imports(path: str) -> dict[str, tuple[str, str]]:
    """Public name -> (submodule, attribute) of the relative imports under ``if TYPE_CHECKING:`` in ``path``;
    the submodule is "" for ``from . import amp`` (the export is the submodule ``amp`` itself)."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.level == 1:
                    found.update({a.asname or a.name: (imp.module or "", a.name) for a in imp.names})
    return found


def lazy_exports(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names are the relative imports of the
    ``if TYPE_CHECKING:`` block of its ``__init__.py``."""
    pkg = sys.modules[package]
    where = type_checking_imports(pkg.__file__ or "")

    def __getattr__(name: str) -> Any:
        if name in where:
            module, attr = where[name]
            value = (importlib.import_module(f"{package}.{attr}") if not module
                     else getattr(importlib.import_module(f"{package}.{module}"), attr))
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(pkg, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(pkg.__dict__) | set(where))

    return __getattr__, __dir__
