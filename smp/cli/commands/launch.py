"""``smp launch``: run a training script on N processes, one per device, through torchrun.

``smp launch -n N script.py args`` is ``torchrun --nproc-per-node N --standalone script.py args``; torchrun's
multi-node options pass through (and drop ``--standalone``). Each rank runs the script through
:mod:`smp.cli.worker`, so that Ctrl-C ends every rank quietly: the command says ``interrupted`` once and exits
with 130 instead of printing a traceback per rank. A rank that fails is reported by its local rank. The
ranks start with :mod:`smp.runtime.rank_env`'s variables (huge pages for large CPU tensors) unless the user set them.

``--max-restarts N`` is handled here, not by torchrun (which restarts on any failure): the job runs under torchrun
without restarts, up to N + 1 times, and is not restarted when a training-health rule stopped it
(:mod:`smp.health.session`: each rank writes its reason to the file ``SMP_HEALTH_STOP_FILE`` names, set here); the
command then exits with that job's status, :data:`smp.runtime.health_options.STOP_EXIT_STATUS`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from smp.cli.errors import CLIError
from smp.cli.options import Parser
from smp.cli.text import PROG
from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV
from smp.runtime.rank_env import rank_environment

__all__ = ["register", "run", "launch", "torchrun_args", "WORKER"]

WORKER = "smp.cli.worker"  # the module each rank runs: the script as __main__, Ctrl-C without a traceback
_PASS_THROUGH = (("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--rdzv-endpoint", "rdzv_endpoint"),
                 ("--rdzv-backend", "rdzv_backend"), ("--rdzv-id", "rdzv_id"), ("--master-addr", "master_addr"),
                 ("--master-port", "master_port"), ("--max-restarts", "max_restarts"))


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
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", help="(torchrun)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun arguments and exit")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp launch`` to the command's subparsers."""
    _add_arguments(sub.add_parser("launch", help="run a training script on N processes (wraps torchrun)",
                                  description="torchrun --nproc-per-node N [--standalone] script.py args...; "
                                              "torchrun's multi-node options pass through."))


def launch(argv: Sequence[str]) -> int:
    """``smp launch ARGV`` from Python (the demo trains this way)."""
    p = Parser(prog=f"{PROG} launch")
    _add_arguments(p)
    return run(p.parse_args(list(argv)))


def torchrun_args(ns: argparse.Namespace, *, worker: bool = False) -> list[str]:
    """The torchrun command line of the launch, as ``--dry-run`` prints it; with ``worker``, as it runs (each
    rank starts the script through :data:`WORKER`)."""
    args = ["--nproc-per-node", str(ns.nproc)]
    if ns.nnodes is None and ns.rdzv_endpoint is None and ns.master_addr is None:
        args.append("--standalone")
    for flag, dest in _PASS_THROUGH:
        if worker and dest == "max_restarts":
            continue  # smp launch restarts the job itself (see the module docstring)
        if getattr(ns, dest) is not None:
            args += [flag, str(getattr(ns, dest))]
    script_args = list(ns.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return args + (["--module", WORKER] if worker else []) + [ns.script, *script_args]


def run(ns: argparse.Namespace) -> int:
    """Run ``smp launch`` on parsed arguments."""
    if not os.path.isfile(ns.script):
        raise CLIError(f"no such script {ns.script!r}")
    nproc = str(ns.nproc)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "cpu", "auto"):
        raise CLIError(f"-n {nproc!r}: give a positive number of processes (or gpu, cpu, auto)")
    if ns.dry_run:
        print("torchrun " + " ".join(torchrun_args(ns)))
        return 0
    restarts = str(ns.max_restarts or 0)
    if not restarts.isdigit():
        raise CLIError(f"--max-restarts {ns.max_restarts!r}: give a number of restarts (0 or more)")
    return _attempts(ns, int(restarts))


def _attempts(ns: argparse.Namespace, restarts: int) -> int:
    """Run the job, and again after a failure up to ``restarts`` times, unless a training-health rule stopped it."""
    given = os.environ.get(STOP_FILE_ENV)
    with tempfile.TemporaryDirectory(prefix="smp-launch-") as tmp:
        stop_file = os.environ[STOP_FILE_ENV] = given or os.path.join(tmp, "health-stop")
        try:
            for attempt in range(restarts + 1):
                _remove(stop_file)  # an earlier job's reason is not this attempt's
                try:
                    return _run_once(ns)
                except CLIError:
                    if os.path.isfile(stop_file):
                        break
                    if attempt == restarts:
                        raise
                    print(f"{PROG}: restarting the job ({attempt + 1} of {restarts} restarts)", file=sys.stderr)
            with open(stop_file) as fh:
                reason = fh.read().strip()
            print(f"{PROG}: a training-health rule stopped the job; not restarting it: {reason}", file=sys.stderr)
            return STOP_EXIT_STATUS
        finally:
            if given is None:  # a later launch from this process gets its own
                os.environ.pop(STOP_FILE_ENV, None)


def _run_once(ns: argparse.Namespace) -> int:
    """One run of the job under torchrun (no restarts there); a failure is a CLIError naming the ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        with rank_environment():  # the ranks torchrun starts inherit it
            torchrun_main(torchrun_args(ns, worker=True))
    except SignalException as exc:  # torchrun stopped the ranks on this signal
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"{PROG}: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failures = dict(sorted((getattr(exc, "failures", {}) or {}).items()))
        if failures and all(f.exitcode in (130, -signal.SIGINT) for f in failures.values()):
            raise KeyboardInterrupt from None  # Ctrl-C reached the ranks before torchrun
        # Ranks torchrun stopped because another one failed are not the cause.
        causes = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
        ranks = ", ".join(str(getattr(f, "local_rank", r)) for r, f in causes.items()) or "?"
        raise CLIError(f"{ns.script} failed on local rank(s) {ranks} (see their output above)") from None
    return 0


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
