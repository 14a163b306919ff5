"""What each rank of ``smp launch`` runs: the training script as ``__main__``, with Ctrl-C ending it quietly.

``python -m smp.cli.worker script.py args`` runs the script as ``python script.py args`` would (its folder
first on ``sys.path``, ``sys.argv`` its own), except that a KeyboardInterrupt ends the rank with status 130
and no traceback: Ctrl-C reaches every rank at once, and N identical tracebacks would bury the one line
``smp launch`` prints.
"""
from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["run_script"]


def run_script(argv: Sequence[str]) -> int:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as the main script; 130 when interrupted, else 0."""
    script, *args = argv
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(run_script(sys.argv[1:]))
