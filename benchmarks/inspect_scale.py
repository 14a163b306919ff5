"""``smp inspect`` at the scale it is meant for: a Llama-3-70B-shaped model built on the meta device.

Runs the command as a user does, in a subprocess, on the factory target ``benchmarks/inspect_scale.py:llama_70b``
(80 layers, hidden 8192, intermediate 28672, 64 heads / 8 KV heads, vocabulary 128256, sequence 2048, one
sequence per microbatch; :func:`benchmarks.partition_quality.llama_meta`, no weights are ever allocated), and
prints one row: the wall time, the subprocess's CPU time (user + system: what a busy machine does not
inflate as much), its peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``),
the plan's balance, cut bytes per microbatch and largest stage, and the largest stage of each baseline, with
the load average before and after (other work on the machine slows the run, not its memory).

By default the plan is for 8 stages x 16 microbatches (1F1B) of ``h100-80gb`` in ``bf16`` with
``--device-memory unlimited``: trained with Adam in mixed precision a 70B model holds 16 bytes per parameter
(1.1 TB), so 8 stages of 80 GB cannot hold it, and with a budget the command would (rightly) refuse; the
``fits`` column says whether the largest stage fits the device. Goal (issue 15): under 90 s and 3 GB.

Run: ``python benchmarks/inspect_scale.py [--stages 8] [--microbatches 16] [--device h100-80gb] [--dtype bf16]``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average  # noqa: E402
from benchmarks.partition_quality import llama_meta  # noqa: E402
from partitioner.units import format_bytes  # noqa: E402

__all__ = ["llama_70b", "main"]

REPO = Path(__file__).resolve().parents[1]
TIME_GOAL_S = 90.0
RSS_GOAL_BYTES = 3e9


def llama_70b() -> tuple:
    """The ``smp inspect`` factory: a Llama-3-70B-shaped causal LM on meta and one sequence of 2048 ids."""
    return llama_meta("llama-70b")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="8")
    ap.add_argument("--microbatches", default="16")
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device-memory", default="unlimited")
    opts = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "smp.cli", "inspect", f"{Path(__file__).resolve()}:llama_70b",
               "-p", opts.stages, "-m", opts.microbatches, "--device", opts.device, "--dtype", opts.dtype,
               "--device-memory", opts.device_memory, "--json", str(plan_path), "--quiet"]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        print(f"# smp inspect llama-70b shape (meta) -p {opts.stages} -m {opts.microbatches} --device {opts.device} "
              f"--dtype {opts.dtype} --device-memory {opts.device_memory}; before: {load_average()}", flush=True)
        t0 = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        wall = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_rss, cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # ru_maxrss: KiB on Linux
        if result.returncode != 0:
            print(result.stdout + result.stderr)
            return result.returncode
        plan = json.loads(plan_path.read_text())
    largest = max(s["memory_bytes"] for s in plan["stages"])
    device_mem = plan["rates"].get("memory_bytes")
    head = (f"{'wall s':>7} {'CPU s':>7} {'peak RSS':>10} {'balance':>8} {'method':>7} {'cut/mb':>10} "
            f"{'largest stage':>14} {'fits':>5} " + " ".join(f"{b + ' largest':>16}" for b in plan["baselines"]))
    print(head)
    print("-" * len(head))
    print(f"{wall:>7.1f} {cpu:>7.1f} {format_bytes(peak_rss):>10} {plan['balance']:>8.3f} {plan['method']:>7} "
          f"{format_bytes(plan['cut_bytes']):>10} {format_bytes(largest):>14} "
          f"{('yes' if device_mem is None or largest <= device_mem else 'no'):>5} "
          + " ".join(f"{format_bytes(b['max_memory_bytes']):>16}" for b in plan["baselines"].values()))
    print(f"# after: {load_average()}")
    missed = []
    if wall > TIME_GOAL_S:
        missed.append(f"wall time {wall:.1f} s > {TIME_GOAL_S:.0f} s")
    if peak_rss > RSS_GOAL_BYTES:
        missed.append(f"peak RSS {format_bytes(peak_rss)} > 3 GB")
    print("# " + ("MISSED: " + "; ".join(missed) if missed else "goals met (under 90 s and 3 GB)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
