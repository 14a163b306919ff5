"""The documentation is true: every fenced block of README.md and docs/*.md runs or parses, and every name it uses
exists (the conventions are in docs/README.md).

A ``python`` block runs in a fresh interpreter (this one's executable, from an empty folder, with the repository on
PYTHONPATH and one OpenMP thread). An HTML comment on the line right before its fence changes that:
``<!-- no-run: reason -->`` compiles it and executes only its imports; ``<!-- slow -->`` runs it only under
``-m slow``; ``<!-- launch -n N -->`` runs it as a script of N ranks through ``smp launch`` (under ``-m slow``).
A ``console`` block marked ``<!-- output -->`` shows what deterministic commands print (a GPU profile's prices, one-line
errors): each ``$ smp ...`` line runs, and its output must be the lines shown under it, wall-clock seconds and progress
lines masked and a ``...`` line standing for any lines; ``SMP_UPDATE_DOCS=1`` writes a fresh run's output into the
block instead (keeping its ``...`` line, with as many lines before and after it).
In ``bash`` blocks every ``smp ...`` line, in ``console`` blocks every ``$ smp ...`` line, must parse with the real
parser, and a line it refuses must be followed by the parser's own message. The ``<!-- synopsis -->`` block names
only real options, docs/cli.md names every option, and the module paths, public names and links of the text exist.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120
README_MAX_LINES = 200  # a front page: what the engine is, how to start, where to read on
PACKAGES = ("partitioner", "pipeline", "smp")
COMMAND_LANGS = ("bash", "console")
KNOWN_MARKS = re.compile(r"no-run: \S.*|slow|launch -n [1-9]\d*|synopsis|output")

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
_PATH = re.compile(r"(?<![\w./-])((?:%s|examples|benchmarks|tests|docs)/[\w./-]*\w)(?:::(\w+))?" % "|".join(PACKAGES))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text (dedented to its fence) and the HTML comments
    on the lines right before the fence."""

    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marks: tuple[str, ...]

    def mark(self, name: str) -> str | None:
        """The mark named ``name`` (``no-run``, ``slow``, ``launch``, ``synopsis``) with its argument, or None."""
        return next((m for m in self.marks if m == name or m.startswith((name + ":", name + " "))), None)


def _read_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and its lines with every block's lines blanked (the prose)."""
    lines = path.read_text().splitlines()
    prose = list(lines)
    blocks = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: the block is not closed"
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        marks = []
        k = i - 1
        while k >= 0 and (comment := _MARK.match(lines[k])):
            marks.insert(0, comment.group(1))
            k -= 1
        blocks.append(Block(str(path.relative_to(ROOT)), i + 1, lang, "\n".join(body) + "\n", tuple(marks)))
        prose[i:end + 1] = [""] * (end + 1 - i)
        i = end + 1
    return blocks, prose


BLOCKS = [b for doc in DOCS for b in _read_blocks(doc)[0]]


def _param(block: Block) -> object:
    runs_long = block.lang == "python" and not block.mark("no-run") and bool(block.mark("slow") or block.mark("launch"))
    runs_long = runs_long or (block.lang == "console" and bool(block.mark("output") and block.mark("slow")))
    return pytest.param(block, id=f"{block.doc}:{block.line}", marks=[pytest.mark.slow] if runs_long else [])


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block(block: Block, tmp_path: Path) -> None:
    where = f"{block.doc}:{block.line}"
    assert block.lang, f"{where}: give the block a language (python, bash, console or text)"
    unknown = [m for m in block.marks if not KNOWN_MARKS.fullmatch(m)]
    assert not unknown, f"{where}: unknown marks {unknown} (see docs/README.md)"
    if block.lang == "python":
        _check_python(block, tmp_path)
    elif block.lang in COMMAND_LANGS:
        _check_command_lines(block)
        if block.mark("output"):
            _check_output(block)
    elif block.mark("synopsis"):
        _check_synopsis(block)
    else:
        hidden = [line for line in block.text.splitlines() if line.startswith("$ smp")]
        assert not hidden, f"{where}: command lines belong in a console block, where they are checked: {hidden}"


# --- python blocks -----------------------------------------------------------------------------------------------


def _check_python(block: Block, tmp_path: Path) -> None:
    where = f"{block.doc}:{block.line}"
    tree = compile(block.text, where, "exec", flags=ast.PyCF_ONLY_AST)
    if block.mark("no-run"):
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), where, "exec"), {})
        return
    script = tmp_path / "block.py"
    script.write_text(block.text)
    argv = [sys.executable, str(script)]
    launch = block.mark("launch")
    if launch:
        argv = [sys.executable, "-m", "smp.cli", "launch", *launch.split()[1:], str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout ends the ranks too
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{where} did not finish within {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{where} exited with {proc.returncode}:\n{out[-4000:]}"


# --- smp command lines -------------------------------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from smp.cli.entry import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _command_lines(block: Block) -> list[tuple[int, list[str], str]]:
    """``(line, argv after "smp", the next line)`` of every ``smp`` command line of a bash or console block:
    ``$ `` prompts (console), ``\\`` continuations, ``# comments`` and leading ``VAR=value`` assignments allowed."""
    lines = block.text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        i += 1
        if block.lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        tokens = shlex.split(line, comments=True)
        while tokens and _ENV_ASSIGNMENT.fullmatch(tokens[0]):
            tokens.pop(0)
        if tokens[:1] == ["smp"]:
            found.append((block.line + 1 + start, tokens[1:], lines[i] if i < len(lines) else ""))
    return found


def _up_to_the_script(argv: list[str]) -> list[str]:
    """``smp launch`` passes everything after the script to it: parse only up to the script."""
    if argv[:1] == ["launch"]:
        script = next((k for k, token in enumerate(argv) if token.endswith(".py")), len(argv) - 1)
        return argv[:script + 1]
    return argv


def _parse_error(argv: list[str]) -> str | None:
    """None when ``smp ARGV`` parses; else the one line ``smp`` prints for it (``smp.cli.entry.main`` stops at
    the parse and runs nothing)."""
    from smp.cli.entry import build_parser, main
    from smp.cli.errors import CLIError

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _, unknown = build_parser().parse_known_args(argv)
        if not unknown:
            return None
    except CLIError:
        pass
    except SystemExit as exc:  # --help, --version
        return None if exc.code in (0, None) else f"exit {exc.code}"
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    assert status == 2, f"`smp {' '.join(argv)}` does not parse, yet smp exited with {status}"
    return printed.getvalue().strip()


def _check_command_lines(block: Block) -> None:
    for line, argv, following in _command_lines(block):
        error = _parse_error(_up_to_the_script(argv))
        if error is not None:
            assert following.strip() == error, (
                f"{block.doc}:{line}: `smp {' '.join(argv)}` does not parse: {error}"
                + ("" if block.lang == "bash" else f"\n(the block shows: {following.strip()!r})"))


# The progress lines a command prints on stderr as it goes ("smp: [   1.4s] traced ..."): wall-clock, not shown.
_PROGRESS = re.compile(r"smp: \[\s*\d+(?:\.\d+)?s\] ")
# Wall-clock seconds a deterministic command still prints ("searched 2072 layouts in 40.9 s").
_WALL = re.compile(r"\bin \d+(?:\.\d+)? s\b")


def _same(shown: list[str], printed: list[str]) -> bool:
    """``printed`` is what ``shown`` shows: line for line, wall-clock seconds masked, a ``...`` line standing for
    any lines (none included)."""
    if not shown:
        return not printed
    if shown[0].strip() == "...":
        return any(_same(shown[1:], printed[k:]) for k in range(len(printed) + 1))
    return bool(printed) and _WALL.sub("in _ s", shown[0].rstrip()) == _WALL.sub("in _ s", printed[0].rstrip()) \
        and _same(shown[1:], printed[1:])


def _kept_elisions(shown: list[str], printed: list[str]) -> list[str]:
    """``printed`` with the block's one ``...`` line kept: as many lines before and after it as ``shown`` has (a
    fresh run written into a block keeps what the block chose to elide)."""
    marks = [k for k, s in enumerate(shown) if s.strip() == "..."]
    if len(marks) != 1 or len(printed) < len(shown) - 1:
        return printed
    before, after = marks[0], len(shown) - marks[0] - 1
    return printed[:before] + ["..."] + printed[len(printed) - after:]


def _run_smp(argv: list[str]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "COLUMNS": "200"}
    done = forked.run((forked.smp_cli, argv), cwd=ROOT, env=env, timeout=TIMEOUT_S * 5)
    printed = (done.stdout + done.stderr).rstrip("\n").splitlines()
    return [line for line in printed if not _PROGRESS.match(line)]


def _check_output(block: Block) -> None:
    """Each ``$ smp ...`` line of ``block`` prints what the block shows under it (see the module docstring)."""
    lines = block.text.rstrip("\n").splitlines()
    starts = [k for k, line in enumerate(lines) if line.startswith("$ ")]
    fresh, wrong = list(lines), []
    for k, end in reversed(list(zip(starts, starts[1:] + [len(lines)]))):
        command = lines[k][2:]
        while command.rstrip().endswith("\\"):
            k += 1
            command = command.rstrip()[:-1] + " " + lines[k].strip()
        argv = shlex.split(command, comments=True)
        assert argv[:1] == ["smp"], f"{block.doc}:{block.line}: an output block runs smp commands only: {command}"
        shown, printed = lines[k + 1:end], _run_smp(argv[1:])
        if not _same(shown, printed):
            wrong.append(f"$ {command}\n" + "\n".join(printed))
            fresh[k + 1:end] = _kept_elisions(shown, printed)
    if wrong and os.environ.get("SMP_UPDATE_DOCS") == "1":
        path = ROOT / block.doc
        text = path.read_text().splitlines()
        old = block.text.rstrip("\n").splitlines()
        # the fence's line (1-based) now: an earlier block written in this run may have moved it
        at = min((b.line for b in _read_blocks(path)[0] if b.text == block.text), key=lambda n: abs(n - block.line))
        indent = re.match(r"\s*", text[at - 1]).group(0)
        assert [line[len(indent):] for line in text[at:at + len(old)]] == old, f"{block.doc}:{block.line} moved"
        text[at:at + len(old)] = [indent + line if line else line for line in fresh]
        path.write_text("\n".join(text) + "\n")
        return
    assert not wrong, (f"{block.doc}:{block.line}: the block shows another output than a fresh run prints "
                       "(SMP_UPDATE_DOCS=1 writes the fresh one in):\n" + "\n\n".join(wrong))


def _check_synopsis(block: Block) -> None:
    parsers = _subparsers()
    where = f"{block.doc}:{block.line}"
    command = None
    for line in block.text.splitlines():
        head = re.match(r"smp (\w+)", line)
        if head:
            command = head.group(1)
            assert command in parsers, f"{where}: `smp {command}` is not a command: {sorted(parsers)}"
        assert command is not None, f"{where}: the synopsis must start with an `smp COMMAND` line"
        known = {o for action in parsers[command]._actions for o in action.option_strings}
        named = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", line)
        wrong = [flag for flag in named if flag not in known]
        assert not wrong, f"{where}: `smp {command}` has no option(s) {wrong}"
    shown = set(re.findall(r"^smp (\w+)", block.text, re.M))
    assert shown == set(parsers), f"{where}: the synopsis must show every command: missing {set(parsers) - shown}"


def test_the_synopsis_is_there() -> None:
    assert [b for b in BLOCKS if b.mark("synopsis")], "docs/cli.md's synopsis block is marked <!-- synopsis -->"


def test_every_cli_option_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = []
    for name, parser in _subparsers().items():
        assert f"smp {name}" in text, f"docs/cli.md does not describe `smp {name}`"
        for action in parser._actions:
            if not action.option_strings or "--help" in action.option_strings or action.help == argparse.SUPPRESS:
                continue  # positionals, --help and hidden options
            if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in action.option_strings):
                missing.append(f"smp {name} {action.option_strings[-1]}")
    assert not missing, f"docs/cli.md does not mention: {missing}"


# --- names, paths and links --------------------------------------------------------------------------------------


def _all_text() -> str:
    return "\n".join(doc.read_text() for doc in DOCS)


def _is_module(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _missing(name: str) -> str | None:
    """Why the dotted name ``name`` does not exist (None when it does): its longest prefix that is a module of
    this repository, then attributes of what that imports."""
    parts = name.split(".")
    k = next(k for k in range(len(parts), 0, -1) if _is_module(parts[:k]))
    obj: object = importlib.import_module(".".join(parts[:k]))
    for attr in parts[k:]:
        if not hasattr(obj, attr):
            if attr in getattr(obj, "__dataclass_fields__", {}):
                return None  # a field of instances
            return f"{'.'.join(parts[:parts.index(attr)])} has no {attr!r}"
        obj = getattr(obj, attr)
    return None


def test_every_module_path_and_name_exists() -> None:
    text = _all_text()
    names = sorted(set(_DOTTED.findall(text)))
    wrong = [f"{name}: {why}" for name in names if (why := _missing(name))]
    for path, test in sorted(set(_PATH.findall(text))):
        if not (ROOT / path).exists():
            wrong.append(f"{path}: no such file or folder")
        elif test and f"def {test}(" not in (ROOT / path).read_text():
            wrong.append(f"{path}::{test}: no such test")
    assert not wrong, "the docs name what does not exist:\n" + "\n".join(wrong)


# Where a user imports from: each package's front door, and the SMP v1 modules a v1 script imports by name
# (``smdistributed.modelparallel.torch.nn.huggingface.gpt2`` and its siblings are SMP v1's own paths).
FRONT_DOORS = {"partitioner", "pipeline", "smp", "smp.nn", "smp.amp", "smp.optimizers", "smp.utils", "smp.model",
               *(f"smp.nn.huggingface.{family}" for family in ("gpt2", "bert", "roberta", "gptj", "gptneo"))}
_PROSE_IMPORT = re.compile(r"`(from\s+[\w.]+\s+import\s+[^`]+)`")


def _imported_modules(source: str) -> list[str]:
    """The modules of our packages that the import statements of ``source`` name (``from X import y``: X)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [n for n in names if n.split(".")[0] in PACKAGES]
    return found


def test_every_documented_import_is_from_a_front_door() -> None:
    """What the README, the manual and the examples tell a user to import comes from a package's front door, not
    from a module inside it (the inside may move; ``partitioner/`` did)."""
    sources = [(f"{b.doc}:{b.line}", b.text) for b in BLOCKS if b.lang == "python"]
    for doc in DOCS:
        sources += [(str(doc.relative_to(ROOT)), m) for m in _PROSE_IMPORT.findall("\n".join(_read_blocks(doc)[1]))]
    sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "examples").glob("*.py"))]
    inside = [f"{where}: {module}" for where, text in sources for module in _imported_modules(text)
              if module not in FRONT_DOORS]
    assert not inside, ("these imports name a module inside a package; import from its front door "
                        f"({sorted(FRONT_DOORS)}) and export the name there:\n" + "\n".join(inside))


def test_every_public_name_is_in_the_manual() -> None:
    text = _all_text()
    missing = [f"{pkg}.{name}" for pkg in PACKAGES for name in importlib.import_module(pkg).__all__
               if not re.search(rf"(?<![\w.]){pkg}\.{re.escape(name)}(?!\w)", text)]
    assert not missing, f"public names the docs never mention: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for line in _read_blocks(path)[1]:
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = _slug(heading.group(1))
            n = counts[slug] = counts.get(slug, -1) + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    wrong = []
    for line in _read_blocks(doc)[1]:
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                wrong.append(f"{target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                wrong.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not wrong, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(wrong)


def test_the_layout_lists_every_module() -> None:
    listed = set(re.findall(r"^\| `((?:%s)/[\w/]+\.py)` \|" % "|".join(PACKAGES),
                            (ROOT / "docs" / "layout.md").read_text(), re.M))
    modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if p.name != "__init__.py"}
    assert listed == modules, (f"docs/layout.md lists missing modules {sorted(listed - modules)} and leaves out "
                               f"{sorted(modules - listed)}")


def test_readme_is_a_front_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference material to docs/"


def test_the_readme_names_every_subcommand() -> None:
    """The README said the command had six subcommands when it had eight: the paragraph that counts them names each
    one, and says how many there are."""
    names = sorted(_subparsers())
    text = (ROOT / "README.md").read_text()
    counted = re.search(r"The command has (\w+) subcommands: ([^\n]+(?:\n[^\n]+)*?)\[docs/cli\.md\]", text)
    assert counted, "README.md must say how many subcommands `smp` has, and name them, before its link to docs/cli.md"
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert counted.group(1) == words[len(names)], f"README.md counts {counted.group(1)}; smp has {len(names)}: {names}"
    assert not [n for n in names if f"`{n}`" not in counted.group(2)], f"README.md names not all of {names}"
