"""A command of the tests run as a process of its own, without paying its imports each time.

A test that runs ``python -m smp.cli ...`` or ``python -c CODE`` as a user would spends 3 to 4 s of its CPU
importing torch, transformers and the engine before the first line of the command runs, and the default run has
dozens of them. :func:`run` runs the same command in a process started as :func:`smp.testing.run_ranks` starts ranks
(:func:`smp.testing.process_context`: forked from a fork server that imported those modules and did nothing else —
no threads, no state of the test's process — or spawned where that server's environment is not the caller's): its
own environment, working directory and file descriptors 1 and 2 (so what C code and child processes print is
captured too), its exit status the command's. What only a real interpreter shows (``python -m smp.cli`` as the
entry point, what importing the command imports, ``smp launch``'s torchrun, consoles and Ctrl-C) stays tested with
:mod:`subprocess`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

__all__ = ["run", "smp_cli", "python_code"]


def smp_cli(argv: Sequence[str]) -> int:
    """``python -m smp.cli ARGV`` in this process: the command's exit status."""
    from smp.cli.entry import main

    return main(list(argv))


def python_code(code: str) -> int:
    """``python -c CODE`` in this process: 0, or 1 after printing an uncaught exception's traceback."""
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    return 0


def _child(fn_args: tuple, cwd: str, env: dict[str, str], out: str, err: str) -> None:
    fn, *args = fn_args
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        code = fn(*args)
    except SystemExit as exc:  # argparse and sys.exit: the interpreter's meaning of the code
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        if "smp.runtime.state" in sys.modules:  # smp's exit handler: os._exit runs none
            sys.modules["smp.runtime.state"].shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(fn_args: tuple, *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``fn(*args)`` (``fn_args``: a module-level function of this file and its arguments) in a forked process of
    its own, in ``cwd`` with environment ``env``; what :func:`subprocess.run` with ``capture_output=True,
    text=True`` returns. Past ``timeout`` seconds the process is killed and :class:`subprocess.TimeoutExpired`
    raised, as :func:`subprocess.run` does."""
    from smp.testing import process_context

    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        with process_context() as ctx:  # as run_ranks starts its ranks; the child then takes ``env``
            proc = ctx.Process(target=_child, args=(fn_args, str(cwd), env, str(out), str(err)))
            proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(fn_args, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(fn_args, proc.exitcode, out.read_text(), err.read_text())
