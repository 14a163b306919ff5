"""The layout we promise newcomers: packages import downwards only (smp -> pipeline -> partitioner), no import
cycle between the files of a package (function-level imports included), no library file over 400 lines, and
every public name documented."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("partitioner", "pipeline", "smp")
ORDER = {name: i for i, name in enumerate(PACKAGES)}  # a package may import only those before it
MAX_LINES = 400


def _modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in base.rglob("*.py")}


def _imports(module: str, path: Path) -> set[str]:
    """Every module named by an import anywhere in the file, resolved to absolute names."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_files_of_a_package(package):
    mods = _modules(package)
    graph = {m: {i for i in _imports(m, p) if i in mods and i != m and i != package} for m, p in mods.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_downwards_only(package):
    for module, path in _modules(package).items():
        for target in _imports(module, path):
            top = target.split(".")[0]
            if top in ORDER:
                assert ORDER[top] <= ORDER[package], \
                    f"{module} imports {target}: arrows go smp -> pipeline -> partitioner"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_library_file_over_the_limit(package):
    long = {m: n for m, p in _modules(package).items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_a_docstring(package):
    missing = []
    for module in sorted(_modules(package)):
        mod = importlib.import_module(module)
        if not (mod.__doc__ or "").strip():
            missing.append(f"{module} (module)")
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module:
                if not (obj.__doc__ or "").strip():
                    missing.append(f"{module}.{name}")
                if inspect.isclass(obj):
                    for attr, member in vars(obj).items():
                        fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                        if not attr.startswith("_") and inspect.isfunction(fn) and not (fn.__doc__ or "").strip():
                            missing.append(f"{module}.{name}.{attr}")
    assert not missing, f"{len(missing)} public definitions without a docstring: {missing}"
