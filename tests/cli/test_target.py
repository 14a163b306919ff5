"""``smp.cli.target``: TARGET as ``zoo:NAME`` or ``file.py:factory``, and every way a factory can go wrong as one
error line that names the file and the factory."""
from __future__ import annotations

from pathlib import Path

from tests.cli.helpers import one_line_error, smp


def test_factory_may_return_a_bare_tensor(factory_file: Path, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", f"{factory_file}:single_tensor", "-p", "2", "-q"]) == 0
    assert "lower bound" in capsys.readouterr().out


def test_a_factory_that_exits_is_named(factory_file: Path) -> None:
    line = one_line_error(smp("inspect", f"{factory_file}:exits", "-p", "2", "-q"), "exits()", "sys.exit(3)")
    assert str(factory_file) in line and "(model, example_args)" in line


def test_a_file_that_exits_on_import_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit('usage: train.py DATA')\n")
    one_line_error(smp("inspect", f"{script}:build", "-p", "2", "-q"), f"cannot import {script}",
                   "sys.exit('usage: train.py DATA')", "__name__ == '__main__'")


def test_the_missing_factory_hint_lists_classes_as_classes(factory_file: Path, capsys) -> None:
    from smp.cli import main

    assert main(["inspect", f"{factory_file}:Build", "-p", "2", "-q"]) == 2
    line = capsys.readouterr().err
    functions, classes = line.split("functions defined there: ")[1].split(" (classes, not factories: ")
    assert functions.split(", ") == ["broken", "build", "build_kwargs", "exits", "single_tensor", "wrong"]
    assert classes.startswith("Net)")
