"""``smp launch``: run a training script on N processes, one per device, through torchrun.

``smp launch -n N script.py args`` runs ``torchrun --nproc-per-node N --standalone ... script.py args`` in this
process (``torch.distributed.run``); torchrun's multi-node options pass through (and drop ``--standalone``).
``--dry-run`` prints that command exactly as it runs: the environment variables added, and every torchrun option.
``--as-smdistributed`` makes ``import smdistributed.modelparallel.torch`` import smp in every rank, for libraries
written for SMP v1 (:mod:`smp.smdistributed_alias`; the ranks' worker installs it before the script runs).

- Each rank runs the script through :mod:`smp.cli.worker`: Ctrl-C ends every rank quietly (the command says
  ``interrupted`` once and exits with 130), and an exception is recorded in the rank's ``error.json`` by torchrun's
  ``record``. Per-rank logs go to torchrun's ``--log-dir``: a folder per launch under ``--log-dir`` (default
  ``$TMPDIR/smp-launch-$USER``), named by the time and this process's id. Local rank 0 writes to the console;
  the other ranks' stderr goes only to their ``stderr.log`` there (``--redirects``), so a warning or a traceback
  shows once, not once per rank. Every rank's stdout stays on the console.
- A failed job prints :func:`smp.cli.launch_report.failure_report`: the first failing rank, its cause once, and
  where the tracebacks and logs are; torchrun's own log lines (the ``OMP_NUM_THREADS`` banner, ``failed
  (exitcode ...)``) are left out unless ``LOGLEVEL`` is set. ``OMP_NUM_THREADS=1`` is set for N > 1, as torchrun
  would, so that torchrun has no banner to print.
- ``--max-restarts N`` on one machine is handled here, not by torchrun: the job runs under torchrun without
  restarts, up to N + 1 times, each in a new rendezvous, with a report of each failure; and it is not restarted
  when a training-health rule stopped it (:mod:`smp.health.session`: each rank writes its reason to the file
  ``SMP_HEALTH_STOP_FILE`` names, set here). On several machines it goes to torchrun, whose agents restart the
  workers of every node in one new rendezvous round (one node's launcher cannot restart the others' ranks); a
  rank then finds the stop file at start and exits at once (:mod:`smp.cli.worker`). That path is torchrun's
  and is not tested here (this project's CI is one machine).

Exit status (:data:`EXIT_STATUS`): 0 the job succeeded; 1 it failed (after the restarts allowed); 2 a bad
command line (argparse's code); 79 a training-health rule stopped it; 130 Ctrl-C; 128 + N torchrun got signal N.
"""
from __future__ import annotations

import argparse
import contextlib
import getpass
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from smp.cli.errors import CLIError
from smp.cli.launch_report import failure_report, last_attempt, run_folders
from smp.cli.options import Parser
from smp.cli.text import PROG
from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV
from smp.runtime.rank_env import CONSOLE_RANK_ENV, RANK_ENV, added_environment
from smp.smdistributed_alias import ALIAS_ENV, SmdistributedAliasError, check_no_real_smdistributed

__all__ = ["register", "run", "launch", "torchrun_args", "launch_environment", "alias_mode", "command_line", "WORKER",
           "EXIT_FAILED", "EXIT_STATUS"]

WORKER = "smp.cli.worker"  # the module each rank runs: the script as __main__, Ctrl-C without a traceback
EXIT_FAILED = 1
EXIT_STATUS = {0: "the job succeeded", EXIT_FAILED: "the job failed (a rank raised, exited non-zero or was killed)",
               2: "a bad command line", STOP_EXIT_STATUS: "a training-health rule stopped the job",
               130: "interrupted (Ctrl-C)"}
_PASS_THROUGH = (("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--rdzv-endpoint", "rdzv_endpoint"),
                 ("--rdzv-backend", "rdzv_backend"), ("--rdzv-id", "rdzv_id"), ("--master-addr", "master_addr"),
                 ("--master-port", "master_port"))
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc-per-node", dest="nproc", required=True,
                   help="processes per node (an integer, or torchrun's gpu/cpu/auto)")
    p.add_argument("--nnodes", help="nodes, or MIN:MAX (torchrun)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", help="this node's rank (torchrun)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", help="host:port (torchrun)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", help="c10d, etcd, ... (torchrun)")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="job id (torchrun)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", help="rank 0's address (torchrun)")
    p.add_argument("--master-port", "--master_port", dest="master_port", help="rank 0's port (torchrun)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts",
                   help="run the job again after a failure, up to this many times (default 0)")
    p.add_argument("--log-dir", "--log_dir", dest="log_dir",
                   help="folder of the per-rank logs; each launch adds a folder (default $TMPDIR/smp-launch-$USER)")
    p.add_argument("--dry-run", action="store_true", help="print the command it would run and exit")
    p.add_argument("--as-smdistributed", action="store_true",
                   help="`import smdistributed.modelparallel.torch` imports smp in every rank (for libraries written "
                        "for SMP v1, such as Hugging Face's Trainer); refused where a real smdistributed is installed")
    p.add_argument("--shadow-smdistributed", action="store_true",
                   help="as --as-smdistributed, also where a real smdistributed is installed (hidden for the job)")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp launch`` to the command's subparsers."""
    _add_arguments(sub.add_parser("launch", help="run a training script on N processes (wraps torchrun)",
                                  description="torchrun --nproc-per-node N [--standalone] script.py args...; "
                                              "torchrun's multi-node options pass through.",
                                  epilog="exit status: " + "; ".join(f"{k} {v}" for k, v in EXIT_STATUS.items())))


def launch(argv: Sequence[str]) -> int:
    """``smp launch ARGV`` from Python (the demo trains this way)."""
    p = Parser(prog=f"{PROG} launch")
    _add_arguments(p)
    return run(p.parse_args(list(argv)))


def _local_world(nproc: str) -> int:
    """The number of ranks on this node, as torchrun counts ``gpu``/``cpu``/``auto``."""
    if nproc.isdigit():
        return int(nproc)
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(nproc)
    except ValueError as exc:
        raise CLIError(f"-n {nproc}: {exc}") from None


def _log_folder(ns: argparse.Namespace) -> str:
    """This launch's folder of logs: ``--log-dir`` (or ``$TMPDIR/smp-launch-$USER``) / ``<time>-<pid>``."""
    if ns.log_dir:
        root = ns.log_dir
    else:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (a container)
            user = str(os.getuid()) if hasattr(os, "getuid") else "user"
        root = os.path.join(tempfile.gettempdir(), f"smp-launch-{user}")
    return os.path.join(root, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")


def _standalone(ns: argparse.Namespace) -> bool:
    return ns.nnodes is None and ns.rdzv_endpoint is None and ns.master_addr is None


def torchrun_args(ns: argparse.Namespace, log_dir: str, local_world: int) -> list[str]:
    """The arguments of torchrun for the launch: each rank starts the script through :data:`WORKER`, per-rank logs
    go to ``log_dir``, and the stderr of local ranks 1.. only there. ``--max-restarts`` goes to torchrun only on
    several machines (its agents restart every node together); on one, this command restarts the job itself."""
    args = ["--nproc-per-node", str(ns.nproc)]
    if _standalone(ns):
        args.append("--standalone")
    for flag, dest in _PASS_THROUGH:
        if getattr(ns, dest) is not None:
            args += [flag, str(getattr(ns, dest))]
    if ns.max_restarts and not _standalone(ns):
        args += ["--max-restarts", str(ns.max_restarts)]
    args += ["--log-dir", log_dir]
    if local_world > 1:
        args += ["--redirects", ",".join(f"{r}:2" for r in range(1, local_world))]
    script_args = list(ns.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return args + ["--module", WORKER, ns.script, *script_args]


def launch_environment(log_dir: str, local_world: int, alias: str | None = None) -> dict[str, str]:
    """The variables the launch adds to the ranks' environment (those the user set are kept as they are);
    ``alias`` (:func:`alias_mode`) asks :mod:`smp.cli.worker` to alias ``smdistributed`` to smp in each rank."""
    env = {"OMP_NUM_THREADS": "1"} if local_world > 1 else {}  # torchrun's default, without its banner
    env.update(RANK_ENV)
    env[STOP_FILE_ENV] = os.path.join(log_dir, "health-stop")
    env[CONSOLE_RANK_ENV] = "0"
    added = {k: v for k, v in env.items() if k not in os.environ}
    if alias is not None:  # the command line's choice, over a value inherited from the environment
        added[ALIAS_ENV] = alias
    return added


def alias_mode(ns: argparse.Namespace) -> str | None:
    """The value of :data:`~smp.smdistributed_alias.ALIAS_ENV` the ranks get: ``"force"`` for
    ``--shadow-smdistributed``, ``"1"`` for ``--as-smdistributed``, None without either. A plain
    ``--as-smdistributed`` where a real ``smdistributed`` is importable is refused here, before any rank starts."""
    if ns.shadow_smdistributed:
        return "force"
    if not ns.as_smdistributed:
        return None
    try:
        check_no_real_smdistributed(fix="launch with --shadow-smdistributed to use smp in its place anyway")
    except SmdistributedAliasError as exc:
        raise CLIError(f"--as-smdistributed: {exc}") from None
    return "1"


def command_line(ns: argparse.Namespace, log_dir: str, local_world: int) -> str:
    """The command ``--dry-run`` prints: what runs, as a shell line (and a comment when this command restarts it)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch_environment(log_dir, local_world, alias_mode(ns)).items())
    line = f"{env} torchrun {shlex.join(torchrun_args(ns, log_dir, local_world))}".strip()
    if ns.max_restarts and _standalone(ns):
        line += f"\n# if it fails, {PROG} launch runs it again, up to {ns.max_restarts} more time(s) (--max-restarts)"
    return line


def run(ns: argparse.Namespace) -> int:
    """Run ``smp launch`` on parsed arguments; returns the exit status (:data:`EXIT_STATUS`)."""
    if not os.path.isfile(ns.script):
        raise CLIError(f"no such script {ns.script!r}")
    nproc = str(ns.nproc)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "cpu", "auto"):
        raise CLIError(f"-n {nproc!r}: give a positive number of processes (or gpu, cpu, auto)")
    restarts = str(ns.max_restarts or 0)
    if not restarts.isdigit():
        raise CLIError(f"--max-restarts {ns.max_restarts!r}: give a number of restarts (0 or more)")
    log_dir, local_world = _log_folder(ns), _local_world(nproc)
    if ns.dry_run:
        print(command_line(ns, log_dir, local_world))
        return 0
    if local_world > 1 and _standalone(ns):
        _measure_cpu_costs()
    os.makedirs(log_dir, exist_ok=True)
    return _attempts(ns, log_dir, local_world, int(restarts) if _standalone(ns) else 0)


def _measure_cpu_costs() -> None:
    """Ranks on this machine's CPU plan with its runtime costs: measured here first if they are not yet (a rank
    cannot measure them: its peers would wait)."""
    import torch

    from smp.cli.runtime_costs import ensure_runtime_costs

    if not torch.cuda.is_available():
        ensure_runtime_costs()


def _attempts(ns: argparse.Namespace, log_dir: str, local_world: int, restarts: int) -> int:
    """Run the job, and again after a failure up to ``restarts`` times, unless a training-health rule stopped it."""
    added = launch_environment(log_dir, local_world, alias_mode(ns))
    with added_environment(added):
        stop_file = os.environ[STOP_FILE_ENV]
        for attempt in range(restarts + 1):
            _remove(stop_file)  # an earlier job's reason is not this attempt's
            before = run_folders(log_dir)
            failure = _run_once(torchrun_args(ns, log_dir, local_world))
            if isinstance(failure, int):
                return failure
            if os.path.isfile(stop_file):
                with open(stop_file) as fh:
                    reason = fh.read().strip()
                print(f"{PROG}: a training-health rule stopped the job; not restarting it: {reason}", file=sys.stderr)
                return STOP_EXIT_STATUS
            new = sorted(run_folders(log_dir) - before)
            attempt_dir = last_attempt(os.path.join(log_dir, new[0])) if len(new) == 1 else None
            headline, details = (failure_report(ns.script, failure, attempt_dir) if isinstance(failure, dict)
                                 else (f"{ns.script} failed: {failure}", []))
            last = attempt == restarts
            print(f"{PROG}: error: {headline}" if last else f"{PROG}: run {attempt + 1} failed: {headline}",
                  *details, sep="\n", file=sys.stderr)
            if not last:
                print(f"{PROG}: restarting the job ({attempt + 1} of {restarts} restarts)", file=sys.stderr)
        return EXIT_FAILED


def _run_once(args: list[str]) -> int | dict[int, Any] | str:
    """One run of the job under torchrun (no restarts there): its exit status, or what failed (torchrun's
    failures by global rank, or the text of a rendezvous error)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    try:
        with _quiet_torchrun():
            torchrun_main(args)
    except SignalException as exc:  # torchrun stopped the ranks on this signal
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"{PROG}: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failures = dict(getattr(exc, "failures", {}) or {})
        if failures and all(f.exitcode in (130, -signal.SIGINT) for f in failures.values()):
            raise KeyboardInterrupt from None  # Ctrl-C reached the ranks before torchrun
        return failures
    except RendezvousError as exc:
        return f"the rendezvous failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
    return 0


class _DropTorchrunLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(_TORCHRUN_LOGGERS) or record.levelno >= logging.CRITICAL


@contextlib.contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """Leave torchrun's log lines out (banner, ``failed (exitcode ...)``): the launch reports failures itself.
    ``LOGLEVEL`` (torchrun's own switch) keeps them."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    handlers = {h for name in ("", "torch", "torch.distributed") for h in logging.getLogger(name).handlers}
    drop = _DropTorchrunLogs()
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
