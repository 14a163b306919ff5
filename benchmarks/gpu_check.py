"""A prepared GPU check (``make gpu-check``): six checks of what only a GPU shows, one table, under 8 minutes.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--budget-s 420] [--only bf16,memory,...]

Checks (:mod:`benchmarks.gpu_checks`; each one wrapped: a failure is a FAIL row with its reason, the rest run):

1. ``bf16``: a tiny random GPT-2 (transformers, nothing downloaded) through the pipeline runtime, 2 stages x 2
   microbatches, against the plain model, both under ``torch.autocast(bf16)``: loss within 1 %, every gradient
   within 4 % of its largest entry (bf16's 8 bits, rounded differently per microbatch shape: gpu_checks.py says why).
2. ``memory``: the plan's stage memory (weights + gradients + activations in flight) against
   ``torch.cuda.max_memory_allocated`` over one step (CPU: SKIP, the CPU allocator records no peak).
3. ``op_times``: the cost model's per-op seconds for this device's profile (h200/h100/a100 datasheet when the GPU is
   one, else calibrated; CPU: the calibrated CPU profile) against each op timed, the median ratio over ops, and the
   predicted step (sum over ops) against a real forward + backward.
4. ``offload``: activation offloading (pipeline/offload.py) of every checkpointed block: identical gradients to the
   same run without it, host copies pinned on CUDA (CPU: the same round trip through plain host copies).
5. ``streams``: on CUDA an async all_reduce (NCCL) behind a side-stream sleep does not hold up a matmul on the
   compute stream (CUDA events), ``work.wait()`` does; on every device the async paths of pipeline/grad_buckets.py and
   pipeline/param_gather.py give the same gradients over a single-rank group.
6. ``nvml``: pipeline/system_monitor.py records GPU utilisation and memory through NVML (CPU: SKIP).

Why one process with two virtual stages: ``pipeline_runner(..., virtual_stages=2)`` runs both stages on one rank
(the interleaved-virtual schedule), through the same executor, schedule, stage split and autocast handling as
several ranks; stage-to-stage tensors stay in the process. Two processes on one GPU would need NCCL between two
ranks of one device, which NCCL refuses (duplicate GPU), and gloo cannot carry CUDA tensors, so a single process is
the one setup that runs the same way on a lent GPU and on this CPU. The process group is world size 1: gloo for CPU
tensors and, on CUDA, NCCL beside it for CUDA tensors (``cpu:gloo,cuda:nccl``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Deterministic cuBLAS for the offload check's bit-for-bit comparison; read when CUDA starts, so set before torch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import load_average  # noqa: E402
from benchmarks.gpu_checks import CHECKS, Row, Skip  # noqa: E402

__all__ = ["main", "run_checks", "format_table", "COLUMNS", "DEFAULT_BUDGET_S"]

COLUMNS = ("check", "device", "measured", "expected/predicted", "ratio/error", "status")
DEFAULT_BUDGET_S = 420.0  # 7 minutes of checks: the whole script stays under 8 with start-up and NCCL init


def _init_group(dev: torch.device) -> None:
    """World size 1 in this process (a HashStore: no port, no environment): gloo, plus NCCL for CUDA tensors."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=dev if dev.type == "cuda" else None)  # NCCL binds its communicator to it


def run_checks(dev: torch.device, names: Sequence[str], budget_s: float,
               checks: dict[str, Callable[[torch.device], Row]] | None = None) -> list[Row]:
    """Each check in turn; a Skip is a SKIP row, any other exception a FAIL row with its reason, a check not
    started before ``budget_s`` ran out a SKIP row, so one failure or a slow device never hides the others."""
    table = checks or CHECKS
    start, rows = time.perf_counter(), []
    for name in names:
        if time.perf_counter() - start > budget_s:
            rows.append(Row(name, str(dev), "-", "-", "-", f"SKIP (time budget {budget_s:.0f} s spent)"))
            continue
        t0 = time.perf_counter()
        try:
            row = table[name](dev)
        except Skip as why:
            row = Row(name, str(dev), "-", "-", "-", f"SKIP ({why})")
        except Exception as exc:  # noqa: BLE001 -- any failure is this check's FAIL, the others still run
            traceback.print_exc(file=sys.stderr)
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            row = Row(name, str(dev), "-", "-", "-", f"FAIL ({reason})")
        finally:
            if dev.type == "cuda":  # one check's leftovers neither fill the next's memory nor its peak
                torch.cuda.empty_cache()
        row.check = name  # the key --only takes; the description is in the docstrings
        row.status = f"{row.status} [{time.perf_counter() - t0:.1f} s]"
        rows.append(row)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table under a header line."""
    cells = [COLUMNS] + [(r.check, r.device, r.measured, r.expected, r.ratio, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks, print the table; exit 1 when a check FAILs (SKIPs are fine: a CPU has no NVML)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="no check starts after this many seconds (default %(default)s)")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks (default: all)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
        # Bit-for-bit gradients in the offload check: embedding's backward otherwise adds with atomics.
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(1 if dev.type == "cpu" else torch.get_num_threads())  # as the other benchmarks, on CPU
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    start = time.perf_counter()
    _init_group(dev)
    rows = run_checks(dev, names, args.budget_s)
    total = time.perf_counter() - start
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"date {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, torch {torch.__version__}, "
          f"device {_device_name(dev)}, {load_average()}")
    print(format_table(rows))
    failed = [r.check for r in rows if r.status.startswith("FAIL")]
    print(f"total {total:.1f} s of a {args.budget_s:.0f} s budget; "
          f"{len(rows) - len(failed)} of {len(rows)} checks without FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
