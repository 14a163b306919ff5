"""The layout we promise newcomers: packages import downwards only (smp -> pipeline -> partitioner), the
folders of partitioner and the subpackages of smp import only what their ``__init__`` docstrings allow, each
folder of partitioner names its modules in that docstring, no import cycle between the files of a package
(function-level imports included), at most 8 levels of imports between the files of one package, no library file
over 400 lines, no object reaching into another's private names, and every public name documented."""
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
MAX_LEVELS = 8  # the longest chain of imports between the files of one package (a folder): a newcomer reads it

# What each folder of partitioner may import of partitioner, besides itself and the foundation (the package's own
# files: errors, units, lazy). The order is the flow: capture -> cost -> an axis -> the cut -> sdp -> the planner;
# each folder's __init__ docstring says the same in words. A new axis is a new folder here.
PARTITIONER_FOLDERS = {
    "partitioner.capture": set(),
    "partitioner.cost": {"partitioner.capture"},
    "partitioner.tp": {"partitioner.capture", "partitioner.cost"},
    "partitioner.ep": {"partitioner.capture", "partitioner.cost"},
    "partitioner.cp": {"partitioner.capture", "partitioner.cost", "partitioner.tp"},
    "partitioner.cut": {"partitioner.capture", "partitioner.cost", "partitioner.tp"},
    "partitioner.sdp": {"partitioner.capture", "partitioner.cost", "partitioner.cut"},
    "partitioner.layout": {"partitioner.capture", "partitioner.cost", "partitioner.cut", "partitioner.tp",
                           "partitioner.ep", "partitioner.cp", "partitioner.sdp"},
}

# What each part of smp may import of smp (longest prefix wins; the SMP surface at the top level may import any
# of them but the command line and the test harness). Each subpackage's __init__ docstring says the same in words.
SMP_LAYERS = {
    "smp.runtime": {"smp.runtime"},
    "smp.profiling": {"smp.profiling", "smp.runtime.config"},  # the analysis: reads files, moves no tensors
    "smp.profiling.session": {"smp.profiling", "smp.runtime"},  # the recording
    "smp.engine": {"smp.engine", "smp.runtime", "smp.profiling", "smp.health"},
    "smp.health": {"smp.health", "smp.runtime"},
    "smp.checkpoint": {"smp.checkpoint", "smp.runtime"},
    "smp.testing": {"smp.runtime"},
    "smp.zoo": set(),
    "smp.smddp": {"smp.smddp", "smp.runtime"},  # SageMaker's data-parallel library on torch.distributed
    "smp.cli": {"smp"},
    "smp": {"smp.runtime", "smp.engine", "smp.checkpoint", "smp.profiling", "smp.amp", "smp.optimizers",
            "smp.placement", "smp.ranks", "smp.distributed_model", "smp.distributed_optimizer", "smp.nn", "smp.health",
            "smp.tensor_parallel", "smp.utils", "smp.zoo", "smp.delayed_init"},
}
# Modules that may not import torch.distributed: what reads a profile back cannot move tensors.
NO_COLLECTIVES = ("smp.profiling.measurements", "smp.profiling.rules", "smp.profiling.report", "smp.profiling.replan",
                  "smp.profiling.system_rules", "smp.profiling.system_samples", "smp.profiling.findings")
# Private names of torch, transformers and argparse objects that the engine reads on purpose (documented there).
FOREIGN_PRIVATE = {"_parameters", "_modules", "_non_persistent_buffers_set", "_init_weights", "_is_hf_initialized",
                   "_SubParsersAction", "_use_count"}


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
def test_no_export_is_named_like_a_submodule(package):
    """Importing a submodule sets it as the package's attribute: an export of the same name would be hidden. Only
    a package's own submodules are set on it (``smp.runtime.state`` is set on ``smp.runtime``, not on ``smp``), and
    every package and folder is checked."""
    lazy = importlib.import_module("partitioner.lazy")
    mods = _modules(package)
    for name, path in mods.items():
        if path.name != "__init__.py":
            continue
        exports = {n for n, (module, _) in lazy.type_checking_imports(str(path)).items() if module}
        clash = exports & {m.rpartition(".")[2] for m in mods if m.rpartition(".")[0] == name}
        assert not clash, f"{name} exports {sorted(clash)}, also the names of its submodules: rename the modules"


def _layer(module: str) -> str:
    return max((k for k in SMP_LAYERS if module == k or module.startswith(k + ".")), key=len)


def test_smp_subpackages_import_only_their_layers():
    mods = _modules("smp")
    for module, path in mods.items():
        allowed = SMP_LAYERS[_layer(module)]
        for target in _imports(module, path):
            if target in mods and target != "smp" and not target.startswith(_layer(module) + "."):
                assert any(target == a or target.startswith(a + ".") for a in allowed), \
                    f"{module} imports {target}: {_layer(module)} may import only {sorted(allowed)}"


def _folder(module: str) -> str | None:
    return next((f for f in PARTITIONER_FOLDERS if module == f or module.startswith(f + ".")), None)


def test_partitioner_folders_import_only_their_layers():
    mods = _modules("partitioner")
    folders = {f for m in mods if (f := _folder(m))}
    assert folders == set(PARTITIONER_FOLDERS), \
        f"partitioner's folders {sorted(folders)}: give each one its arrows in PARTITIONER_FOLDERS"
    for module, path in mods.items():
        folder = _folder(module)
        if folder is None:  # the foundation and the package's front door
            assert module == "partitioner" or not {t for t in _imports(module, path) if _folder(t)}, \
                f"{module} is the foundation: it imports no folder"
            continue
        for target in _imports(module, path):
            there = _folder(target)
            if target in mods and there not in (None, folder):
                assert there in PARTITIONER_FOLDERS[folder], \
                    f"{module} imports {target}: {folder} may import only {sorted(PARTITIONER_FOLDERS[folder])}"


def test_each_partitioner_folder_names_its_modules():
    for folder in PARTITIONER_FOLDERS:
        base = ROOT / folder.replace(".", "/")
        doc = ast.get_docstring(ast.parse((base / "__init__.py").read_text())) or ""
        unnamed = [p.stem for p in sorted(base.glob("*.py")) if p.name != "__init__.py" and f"``{p.stem}``" not in doc]
        assert "May import" in doc and not unnamed, \
            f"{folder}'s docstring must say what it may import and name each module: missing {unnamed}"


def _packages(package: str) -> dict[str, dict[str, Path]]:
    """Each package (a folder with ``__init__.py``) -> its own files (not its subpackages'), by module name."""
    found: dict[str, dict[str, Path]] = {}
    for module, path in _modules(package).items():
        if path.name != "__init__.py":
            found.setdefault(module.rpartition(".")[0], {})[module] = path
    return found


def import_levels(files: dict[str, Path]) -> int:
    """The longest chain of imports between ``files`` (module -> path), counted in files: 1 when none imports
    another."""
    graph = {m: {i for i in _imports(m, p) if i in files and i != m} for m, p in files.items()}
    depth: dict[str, int] = {}

    def level(m: str) -> int:
        if m not in depth:
            depth[m] = 1 + max((level(n) for n in graph[m]), default=0)
        return depth[m]

    return max((level(m) for m in files), default=0)


@pytest.mark.parametrize("package", PACKAGES)
def test_few_levels_of_imports_inside_each_package(package):
    deep = {name: n for name, files in _packages(package).items() if (n := import_levels(files)) > MAX_LEVELS}
    assert not deep, f"packages with more than {MAX_LEVELS} levels of imports between their files: {deep}"


def test_profile_analysis_moves_no_tensors():
    for module in NO_COLLECTIVES:
        path = _modules("smp")[module]
        found = {t for t in _imports(module, path) if t.startswith("torch.distributed")}
        assert not found, f"{module} imports {sorted(found)}: reading a profile back must not communicate"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_object_reaches_into_another_objects_private_names(package):
    reaches = []
    for module, path in _modules(package).items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in FOREIGN_PRIVATE and isinstance(node.value, (ast.Name, ast.Attribute))):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                owner = ast.unparse(node.value)
                if owner in ("self", "cls") or (isinstance(base, ast.Name) and base.id in ("torch", "np", "dist")):
                    continue
                if isinstance(node.value, ast.Name) and node.value.id[:1].isupper():
                    continue  # a class's own constant, read through the class
                reaches.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert not reaches, f"private names read across objects (give them a public name): {reaches}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_folder_of_a_package_is_a_package(package):
    """pyproject.toml installs the packages setuptools finds: a folder without ``__init__.py`` would be left out."""
    folders = [d for d in (ROOT / package).rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert not [d for d in folders if not (d / "__init__.py").exists()]


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
