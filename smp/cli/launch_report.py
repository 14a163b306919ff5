"""What ``smp launch`` prints when a job fails: the first failing rank's cause, once, and where the logs are.

torchrun reports a failed job as a :class:`~torch.distributed.elastic.multiprocessing.errors.ChildFailedError`
whose ``failures`` map each failed global rank to a ``ProcessFailure`` (local rank, pid, exit status, and the
``error.json`` that :func:`~torch.distributed.elastic.multiprocessing.errors.record` wrote in the rank's log
folder, when the rank raised). :func:`failure_report` turns them into a few lines, one screen at most:

    smp: error: train.py failed on rank 1: TraceError: cannot trace Net: ... in module Net (Net, train.py:11): ...
      fix: the model branches on tensor values (data-dependent control flow); make the branch depend on ...
      full log: /tmp/smp-launch-me/20250101-120000-4242/none_ab12/attempt_0/1/stderr.log
      logs of every rank: /tmp/smp-launch-me/20250101-120000-4242/none_ab12/attempt_0/<local rank>/ ...

The cause is the exception's message, whitespace folded, with where in the script it was raised; an engine error's
``Fix: ...`` goes on a line of its own. The full log is the rank's ``stderr.log`` (everything it wrote to stderr,
its traceback last), or for the local rank whose stderr was the console, the ``traceback.log`` that
:mod:`smp.cli.worker` wrote (else torchrun's ``error.json``).

Ranks that torchrun stopped (SIGTERM) because another one failed are not causes. Among the others the first
is the one torchrun saw first (the error files' timestamps), then the lowest rank. A rank that left no
error file (``sys.exit(3)``, a signal, a crash in C++) is described by its exit status and the last lines of
its stderr log.
"""
from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from typing import Any

from smp.runtime.rank_env import TRACEBACK_LOG

__all__ = ["failure_report", "first_failure", "cause", "full_log", "run_folders", "last_attempt", "MAX_CAUSE_CHARS"]

MAX_CAUSE_CHARS = 600  # a cause longer than this (a tensor printed in a message) is cut, the rest is in error.json
_FIX = " Fix: "  # how an engine error (partitioner.errors.EngineError) begins its suggestion
_TAIL_LINES = 5
_FRAME = re.compile(r'File "(.+?)", line (\d+)')


def run_folders(log_dir: str) -> set[str]:
    """The folders in ``log_dir`` (torchrun makes one per run: ``<rdzv id>_<random>``)."""
    try:
        return {e for e in os.listdir(log_dir) if os.path.isdir(os.path.join(log_dir, e))}
    except FileNotFoundError:
        return set()


def last_attempt(run_folder: str) -> str | None:
    """The folder of the last attempt in torchrun's folder of a run (``attempt_<restart count>``), if any."""
    attempts = [e for e in run_folders(run_folder) if e.startswith("attempt_") and e[8:].isdigit()]
    return os.path.join(run_folder, max(attempts, key=lambda e: int(e[8:]))) if attempts else None


def first_failure(failures: Mapping[int, Any]) -> tuple[list[int], int]:
    """The ranks that failed on their own (not stopped by torchrun's SIGTERM, unless all were), and the first
    of them: the earliest timestamp, then the lowest rank."""
    own = [r for r, f in failures.items() if f.exitcode != -signal.SIGTERM] or list(failures)
    return sorted(own), min(own, key=lambda r: (failures[r].timestamp, r))


def _error_data(failure: Any) -> dict[str, Any]:
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, dict) else {}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS] + " ... (cut; the whole message is " \
                                                                               "in error.json)"


def cause(failure: Any, script: str, log_folder: str | None) -> tuple[str, list[str]]:
    """One line saying why ``failure``'s rank stopped (its exception and where in the script it was raised, else
    its exit status), and the lines under it: the error's ``Fix: ...`` (``  fix: ...``), or the last lines of its
    stderr log when it left no error file."""
    data = _error_data(failure)
    text = data.get("message")
    if isinstance(text, str) and text:
        text, _, fix = " ".join(text.split()).partition(_FIX)
        text = _cut(text)
        frames = _FRAME.findall(str(data.get("extraInfo", {}).get("py_callstack", "")))
        mine = [(f, n) for f, n in frames if os.path.abspath(f) == os.path.abspath(script)]
        if mine:
            text += f" ({os.path.basename(mine[-1][0])}, line {mine[-1][1]})"
        return text, [f"  fix: {_cut(fix)}"] if fix else []
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        text = f"killed by {name}"
    else:
        text = f"exited with status {failure.exitcode}"
    tail = _tail(os.path.join(log_folder, "stderr.log")) if log_folder else []
    return text, [f"  its stderr ended with: {line}" for line in tail]


def full_log(failure: Any, folder: str | None) -> str | None:
    """The file with the failed rank's whole story: its ``stderr.log`` (torchrun's, where its stderr was not the
    console), else the ``traceback.log`` the worker wrote (:data:`smp.runtime.rank_env.TRACEBACK_LOG`), else torchrun's
    ``error.json``; None if there is none."""
    error_file = getattr(failure, "error_file", "")
    places = [os.path.join(folder, "stderr.log"), os.path.join(folder, TRACEBACK_LOG)] if folder else []
    if error_file:
        places.append(error_file)
    return next((p for p in places if os.path.isfile(p) and os.path.getsize(p)), None)


def _tail(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as fh:
            lines = [line.rstrip() for line in fh.read().splitlines() if line.strip()]
    except OSError:
        return []
    return [line[:200] for line in lines[-_TAIL_LINES:]]


def failure_report(script: str, failures: Mapping[int, Any], attempt_dir: str | None,
                   console_rank: int | None = 0) -> tuple[str, list[str]]:
    """The headline (``SCRIPT failed on rank R: CAUSE``) and the detail lines of a failed job.
    ``attempt_dir`` is torchrun's folder of this run's per-rank logs (``.../attempt_0``), None if unknown;
    ``console_rank`` the local rank whose stderr went to the console instead."""
    if not failures:
        return f"{script} failed (torchrun reported no rank)", []
    ranks, first = first_failure(failures)
    failure = failures[first]
    local = failure.local_rank
    folder = os.path.join(attempt_dir, str(local)) if attempt_dir else None
    why, lines = cause(failure, script, folder if local != console_rank else None)
    where = f"rank {first}" + (f" (local rank {local})" if local != first else "")
    others = f"; {len(ranks)} ranks failed ({', '.join(map(str, ranks))}), rank {first} first" if len(ranks) > 1 else ""
    headline = f"{script} failed on {where}{others}: {why}"
    log = full_log(failure, folder)
    if log:
        lines.append(f"  full log: {log}")
    if attempt_dir:
        lines.append(f"  logs of every rank: {os.path.join(attempt_dir, '<local rank>')}/ (stderr.log, error.json"
                     + (f"; local rank {console_rank} wrote to this console)" if console_rank is not None else ")"))
    return headline, lines
