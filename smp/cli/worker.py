"""What each rank of ``smp launch`` runs: the training script as ``__main__``, with failures kept short.

``python -m smp.cli.worker script.py args`` runs the script as ``python script.py args`` would (its folder
first on ``sys.path``, ``sys.argv`` its own), except:

- a KeyboardInterrupt ends the rank with status 130 and no traceback: Ctrl-C reaches every rank at once, and N
  identical tracebacks would bury the one line ``smp launch`` prints;
- an exception is recorded with torchrun's own mechanism
  (:func:`torch.distributed.elastic.multiprocessing.errors.record` writes its message and traceback to the
  ``error.json`` that ``TORCHELASTIC_ERROR_FILE`` names), and the rank exits with status 1. The traceback goes to
  stderr, which ``smp launch`` sends to the rank's log file (``stderr.log``), except on the local rank whose stderr
  is the console (:data:`smp.runtime.rank_env.CONSOLE_RANK_ENV`): there ``smp launch`` reports the cause once,
  and the traceback (with the notes an exception carries, such as what torch.export printed before it failed) goes
  to ``traceback.log`` beside ``error.json`` (``SMP_TRACEBACK=1`` prints it on the console too);
- with ``smp launch --as-smdistributed`` (:data:`smp.smdistributed_alias.ALIAS_ENV`), ``import
  smdistributed.modelparallel.torch`` imports smp: the alias is installed before the script runs;
- a rank started after a training-health rule stopped the job (the file ``SMP_HEALTH_STOP_FILE`` names exists:
  torchrun restarting a job on several machines) exits at once with the stop status.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence

from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV
from smp.runtime.rank_env import CONSOLE_RANK_ENV, TRACEBACK_LOG
from smp.smdistributed_alias import alias_from_environment

__all__ = ["run_script"]


def run_script(argv: Sequence[str]) -> int:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as the main script; 130 when interrupted, 1 when it raised,
    else 0 (``sys.exit`` inside the script exits with its own status); the health-stop status without running
    it when the job was stopped."""
    from torch.distributed.elastic.multiprocessing.errors import record

    stop = os.environ.get(STOP_FILE_ENV)
    if stop and os.path.exists(stop):  # torchrun restarted a job a training-health rule stopped: stop again
        return STOP_EXIT_STATUS
    alias_from_environment()  # smp launch --as-smdistributed: before the script imports anything
    script, *args = argv
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        record(runpy.run_path)(script, run_name="__main__")
    except KeyboardInterrupt:
        return 130
    except Exception:  # recorded in error.json by record(); say it here only where it is not the console
        console = os.environ.get(CONSOLE_RANK_ENV)
        if console is None or os.environ.get("LOCAL_RANK") != console or os.environ.get("SMP_TRACEBACK"):
            traceback.print_exc()
        if console is not None and os.environ.get("LOCAL_RANK") == console:
            _log_traceback(TRACEBACK_LOG)
        return 1
    return 0


def _log_traceback(name: str) -> None:
    """Write the exception being handled, as Python prints it, to ``name`` in the rank's log folder (the folder of
    torchrun's ``TORCHELASTIC_ERROR_FILE``), where ``smp launch`` says the full log is."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(os.path.join(os.path.dirname(error_file), name), "w") as fh:
                fh.write(traceback.format_exc())
        except OSError:
            pass  # the traceback is still in error.json


if __name__ == "__main__":
    sys.exit(run_script(sys.argv[1:]))
