"""``smp calibrate``: this machine's CPU profile, what every CPU plan and prediction is priced with.

The profile's rates are microbenchmarks (:mod:`partitioner.cost.calibration`); its per-pass and per-step costs are what
our runtime pays beyond the ops, measured on two local ranks (:mod:`smp.cli.runtime_costs`). Both are
measured once per machine and kept; ``--refresh`` measures both again (after a change of machine load or of
kernel settings that should show in plans).
"""
from __future__ import annotations

import argparse
import json

from partitioner.units import format_bytes, format_seconds
from smp.cli.text import format_flops, table

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp calibrate`` to the command's subparsers."""
    p = sub.add_parser("calibrate", help="show (or measure again) this machine's CPU profile",
                       description="Print the rates every CPU plan is priced with: the microbenchmarks and the "
                                   "runtime's costs per pass and per step, measured once per machine and kept.")
    p.add_argument("--refresh", action="store_true", help="measure everything again and keep the new figures")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Run ``smp calibrate`` on parsed arguments."""
    import torch

    from partitioner.cost.calibration import cache_file, calibrate, recorded_runtime_costs, runtime_costs_file
    from smp.cli.runtime_costs import ensure_runtime_costs, measure_runtime_costs

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the profile ranks price with: one intra-op thread each, as smp launch runs them
    try:
        if ns.refresh:
            calibrate("cpu", refresh=True)
            measure_runtime_costs()
        else:
            ensure_runtime_costs()
        rates = calibrate("cpu")
    finally:
        torch.set_num_threads(before)
    measured = recorded_runtime_costs()
    if ns.json:
        print(json.dumps({"rates": rates.to_dict(), "runtime_costs": measured, "profile_file": str(cache_file()),
                          "runtime_costs_file": str(runtime_costs_file())}, indent=1, sort_keys=True))
        return 0
    how = "measured on 2 ranks" if measured else "default: not measured"
    rows = [("matmul", f"{format_flops(rates.flops_per_s)}FLOP/s", "512x512 fp32, one thread"),
            ("memory bandwidth", f"{format_bytes(rates.bytes_per_s)}/s", "streaming add beyond the cache"),
            ("per op", format_seconds(rates.op_overhead_s), "an 8-element add"),
            ("fresh memory", f"{format_bytes(rates.grad_bytes_per_s)}/s", "a step's new weight gradients"),
            ("per pass", format_seconds(rates.pass_overhead_s), how),
            ("per step", format_seconds(rates.step_overhead_s), how),
            ("per collective", format_seconds(rates.collective_overhead_s), how + " (a 512 KB all-reduce between ops)")]
    print("\n".join(table(("rate", "value", "what"), rows, left=(0, 2))))
    if measured:
        counts = sorted(int(k.rsplit("_", 1)[1]) for k in measured if k.startswith("measured_s_"))
        steps = ", ".join(f"{format_seconds(measured[f'measured_s_{m}'])} at {m}" for m in counts) + " microbatches"
        print(f"runtime costs fitted to 2-rank steps of {steps}\n(worst error of the fit "
              f"{measured['worst_error']:.0%})")
    print(f"kept in {cache_file()} and {runtime_costs_file()}")
    return 0
