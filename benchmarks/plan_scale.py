"""``smp plan`` at the scale it is meant for: Llama-3 8B, 70B and 405B shapes on 64 to 2,048 H100s.

Each row runs the command as a user does, in a subprocess, on a factory target of this file (``llama3_8b``,
``llama3_70b``, ``llama3_405b``: ``transformers.LlamaConfig`` with the published shapes, built on the meta device,
one sequence of 8,192 token ids per microbatch; nothing is downloaded and no weight is allocated), for ``h100-80gb``
in ``bf16`` with a global batch of one sequence per device. It prints the wall time, the subprocess's CPU time
(user + system, which a busy machine inflates less) and its peak RSS (read by the subprocess itself at exit), what
the search did (layouts enumerated, priced, partitions made) and the layout it chose, with the load average before
and after: other work on the machine slows the run, not its memory. Goal (issue 24): the 70B shape on 1,024 devices
planned in under 60 s and 2 GB (``--goal`` runs that row alone).

Run: ``python benchmarks/plan_scale.py [--shapes 8b,70b,405b] [--devices 64,512,2048] [--goal] [--seq 8192]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import llama_on_meta, load_average  # noqa: E402
from partitioner.units import format_bytes  # noqa: E402

__all__ = ["LLAMA3", "llama3", "llama3_8b", "llama3_70b", "llama3_405b", "main"]

REPO = Path(__file__).resolve().parents[1]
# (layers, hidden, intermediate, heads, KV heads, vocabulary): Llama 3 / 3.1 (Dubey et al. 2024, "The Llama 3 Herd
# of Models", arXiv:2407.21783, table 3).
LLAMA3 = {"8b": (32, 4096, 14336, 32, 8, 128256), "70b": (80, 8192, 28672, 64, 8, 128256),
          "405b": (126, 16384, 53248, 128, 8, 128256)}
SEQ = int(os.environ.get("PLAN_SCALE_SEQ", "8192"))  # the factories' sequence length (--seq sets it)
TIME_GOAL_S, RSS_GOAL_BYTES = 60.0, 2e9
# The subprocess: run `smp plan`, then print its own peak RSS (KiB on Linux) on the last line of stderr.
_RUN = ("import resource, sys; from smp.cli import main; rc = main(sys.argv[1:]); "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def llama3(shape: str, seq: int = SEQ) -> tuple[torch.nn.Module, tuple]:
    """A Llama-3-shaped causal LM (``shape``: a key of :data:`LLAMA3`) on the meta device and one sequence."""
    return llama_on_meta(LLAMA3[shape], seq)


def llama3_8b() -> tuple:
    """The ``smp plan`` factory of the 8B shape."""
    return llama3("8b")


def llama3_70b() -> tuple:
    """The ``smp plan`` factory of the 70B shape."""
    return llama3("70b")


def llama3_405b() -> tuple:
    """The ``smp plan`` factory of the 405B shape."""
    return llama3("405b")


def _row(shape: str, devices: int, seq: int) -> tuple[list[str], float, int]:
    """Plan one shape on ``devices`` devices in a subprocess: the row's cells, its wall seconds and peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = ["plan", f"{Path(__file__).resolve()}:llama3_{shape}", "--devices", str(devices), "--global-batch",
                str(devices), "--device", "h100-80gb", "--dtype", "bf16", "--top", "1", "--json", str(out), "-q"]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PLAN_SCALE_SEQ=str(seq), OMP_NUM_THREADS="1")
        t0, c0 = time.perf_counter(), os.times()
        done = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, cwd=REPO, env=env)
        wall, c1 = time.perf_counter() - t0, os.times()
        cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
        rss = next((int(line.split()[1]) * 1024 for line in done.stderr.splitlines()
                    if line.startswith("peak_rss_kib")), 0)
        if done.returncode != 0 or not out.exists():
            why = (done.stderr.strip().splitlines() or ["?"])[-2 if rss else -1]
            failed = [shape, str(devices), f"{wall:.1f}", f"{cpu:.1f}", format_bytes(rss), "-", "-", "-", why[:80]]
            return failed, wall, rss
        data = json.loads(out.read_text())
    best, search = data["layouts"][0], data["search"]
    layout = (f"pp{best['pp']} tp{best['tp']} dp{best['dp']} {best['microbatches']}x{best['microbatch_size']} "
              f"{best['schedule']}{' ckpt' if best['checkpointing'] != 'none' else ''}"
              f"{' zero1' if best['zero1'] else ''}: step {best['step_s']:.2f} s, MFU {100 * best['mfu']:.1f}%")
    return [shape, str(devices), f"{wall:.1f}", f"{cpu:.1f}", format_bytes(rss), str(search["enumerated"]),
            str(search["scored"]), str(search["partitions"]), layout], wall, rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,70b,405b")
    ap.add_argument("--devices", default="64,512,2048")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (default 8192)")
    ap.add_argument("--goal", action="store_true", help="only the goal's row: 70b on 1024 devices")
    opts = ap.parse_args(argv)
    runs = [("70b", 1024)] if opts.goal else [(s, int(d)) for s in opts.shapes.split(",")
                                             for d in opts.devices.split(",")]
    print(f"# smp plan on Llama-3 shapes (meta), h100-80gb, bf16, sequence {opts.seq}, global batch = devices; "
          f"before: {load_average()}", flush=True)
    header = ["shape", "devices", "wall s", "CPU s", "peak RSS", "layouts", "priced", "partitions", "best"]
    rows: list[list[str]] = []
    missed: list[str] = []
    for shape, devices in runs:
        cells, wall, rss = _row(shape, devices, opts.seq)
        rows.append(cells)
        print("  " + "  ".join(cells), flush=True)
        if (shape, devices) == ("70b", 1024):
            missed += [f"wall {wall:.1f} s > {TIME_GOAL_S:.0f} s"] * (wall > TIME_GOAL_S)
            missed += [f"peak RSS {format_bytes(rss)} > 2 GB"] * (rss > RSS_GOAL_BYTES)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("\n".join("  ".join(c.rjust(w) if i < len(header) - 1 else c for i, (c, w) in enumerate(zip(r, widths)))
                    for r in [header, ["-" * w for w in widths], *rows]))
    print(f"# after: {load_average()}")
    if ("70b", 1024) in runs:
        print("# goal, 70b on 1024 devices under 60 s and 2 GB: " + ("MISSED: " + "; ".join(missed) if missed
                                                                      else "met"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
