"""Measuring what our runtime pays beyond the ops on this machine: the step model's per-pass, per-step and
per-collective costs.

:func:`pipeline.step_model.predict_step` prices a step as its ops plus :attr:`partitioner.DeviceRates.pass_overhead_s`
per pass and :attr:`~partitioner.DeviceRates.step_overhead_s` per step. On a CPU those are thread wake-ups and
loopback messages, so they are the host's (two machines fitted 1.0 and 0.56 ms per pass, 2 and 10 ms per step) and
are measured here, as a user's run pays them: two gloo ranks on this host (one intra-op thread each, as ``smp
launch`` runs them) train a small MLP through ``smp.init`` (``pipeline_parallel_degree`` 2, SMP's ``"interleaved"``
pipeline), ``smp.DistributedModel`` and an ``@smp.step`` function with its loss and ``model.backward``, at
:data:`MICROBATCHES` microbatches. Each count's median step (barrier to barrier) is set against the step model of the
plan the run made, its ops timed on this machine: the per-pass cost is the one whose predictions, each with the best
per-step cost, fit the measured steps best (least squares on the relative error,
:func:`partitioner.cost.runtime_fit.fit_runtime_costs`). Then the ranks time 512 KB all-reduces, each after a few
milliseconds of compute as a rank's collectives come between its ops: what one takes beyond the link's price for it
is the per-collective cost (:attr:`partitioner.DeviceRates.collective_overhead_s`; gloo's threads waking and the
ranks' skew make it 40 to 60 times a message's latency here).

The result is kept with the machine's CPU profile (:func:`partitioner.cost.calibration.record_runtime_costs`), measured
once per machine on first use (:func:`ensure_runtime_costs`, called when the command line prices a multi-rank CPU
job) or by ``smp calibrate``; about 10 s on two idle cores.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import torch

__all__ = ["measure_runtime_costs", "ensure_runtime_costs", "MICROBATCHES"]

MICROBATCHES = (1, 2, 4, 8, 16)
_STEPS = 21  # timed steps per microbatch count, after two warm-up steps (the first one partitions)
_TRIED: set[str] = set()  # measurements this process began: each once (a failure is not retried per command)


def _probe_model() -> torch.nn.Module:
    """Six 256-wide layers: enough ops per stage for the runtime's per-op paths, small enough that the overheads
    are most of the step."""
    gen = torch.Generator().manual_seed(0)  # never the user's global random stream
    layers: list[torch.nn.Module] = []
    for i in range(6):
        linear = torch.nn.Linear(64 if i == 0 else 256, 256)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.05)
            linear.bias.zero_()
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _rank(rank: int, world: int, steps: int) -> list[dict[str, Any]] | None:
    """One rank of the measurement: for each microbatch count, the median step and the plan's predicted steps
    (rank 0 returns them)."""
    import torch.distributed as dist

    import smp
    from partitioner.cost.devices import DeviceRates
    from partitioner.cost.runtime_fit import PASS_GRID_S
    from pipeline.schedule import make_schedule
    from pipeline.step_model import plan_step
    from smp.runtime import state

    gen = torch.Generator().manual_seed(1)
    rows = []
    for m in MICROBATCHES:
        state.reset()
        smp.init({"pipeline_parallel_degree": world, "microbatches": m, "pipeline": "interleaved"})
        model = smp.DistributedModel(_probe_model(), trace_execution_times=True)
        x, y = torch.randn(8 * m, 64, generator=gen), torch.randn(8 * m, 256, generator=gen)

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        times = []
        for i in range(steps + 2):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            train_step(model, x, y)
            dist.barrier()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        plan = model.partition_plan()
        assert plan is not None  # partitioned by the first step
        graph = plan.traced_graph()
        schedule = make_schedule(plan.options["pipeline"], plan.num_stages, m)
        base = DeviceRates.from_dict(plan.rates)
        predicted = [plan_step(plan, schedule, dataclasses.replace(base, pass_overhead_s=o, step_overhead_s=0.0),
                               graph).step_s for o in PASS_GRID_S]
        rows.append({"microbatches": m, "measured_s": statistics.median(times), "predicted_s": predicted})
    state.reset()
    collective_s = _collective_s()
    return [*rows, {"collective_s": collective_s}] if rank == 0 else None


def _collective_s(repeats: int = 9, calls: int = 10) -> float:
    """Seconds of one all-reduce between the ranks beyond what the link prices for it (its transfers and ring
    latencies), as a rank pays it between its ops: each call, of a 512 KB tensor (a small model's activations, what
    a tensor-parallel collective moves), follows a few milliseconds of compute, so it also pays its gloo threads'
    wake-up and the ranks' skew, which back-to-back calls hide (3 to 5 ms against 1 ms here). The median of
    ``repeats`` runs of ``calls`` compute-and-collective rounds less the median of the same rounds without the
    collective, the two alternating, each run from a barrier."""
    import torch.distributed as dist

    from partitioner.cost.calibration import calibrate
    from partitioner.cost.collectives import all_reduce_s

    flat, a, w = torch.zeros(128 * 1024), torch.randn(256, 256), torch.randn(256, 1024)

    def run(collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            for _ in range(4):  # about a layer's matmuls of a small model
                torch.mm(a, w)
            if collective:
                dist.all_reduce(flat)
        return (time.perf_counter() - t0) / calls

    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for collective in (False, True):
            runs[collective].append(run(collective))
    paid = statistics.median(runs[True]) - statistics.median(runs[False])
    link = dataclasses.replace(calibrate("cpu"), collective_overhead_s=0.0)
    return max(0.0, paid - all_reduce_s(flat.numel() * 4, dist.get_world_size(), link))


def measure_runtime_costs(steps: int = _STEPS, timeout: float = 300.0) -> dict[str, float]:
    """Measure this machine's per-pass and per-step costs on two local ranks and keep them
    (:func:`partitioner.cost.calibration.record_runtime_costs`); returns what was kept."""
    from partitioner.cost.calibration import record_runtime_costs
    from partitioner.cost.runtime_fit import fit_runtime_costs
    from smp.testing import run_ranks

    got = run_ranks(_rank, 2, steps, timeout=timeout, pg_timeout=timeout, allow_failure=True)
    failed = [r for r in got if isinstance(r, str)]  # a failed rank's traceback
    if failed:
        raise RuntimeError(f"measuring the runtime's costs on 2 local ranks failed: {failed[0][-600:]}")
    *rows, last = got[0]
    o, s, worst = fit_runtime_costs([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    how = {f"measured_s_{r['microbatches']}": r["measured_s"] for r in rows}
    c = float(f"{last['collective_s']:.2g}")
    record_runtime_costs(float(f"{o:.2g}"), float(f"{s:.2g}"), c, worst_error=worst, **how)
    return {"pass_overhead_s": float(f"{o:.2g}"), "step_overhead_s": float(f"{s:.2g}"), "collective_overhead_s": c,
            "worst_error": worst, **how}


def ensure_runtime_costs(quiet: bool = False) -> None:
    """Measure this machine's runtime costs if they are not yet (once per machine; ``SMP_RECALIBRATE=1``: once per
    process). Never inside a rank (its peers would wait), and a failure is a warning: the default costs stand in."""
    import torch.distributed as dist

    from partitioner.cost.calibration import RECALIBRATE_ENV, recorded_runtime_costs, runtime_costs_file

    again = os.environ.get(RECALIBRATE_ENV, "") not in ("", "0")
    path = str(runtime_costs_file())
    if path in _TRIED or (recorded_runtime_costs() is not None and not again) or dist.is_initialized() \
            or "RANK" in os.environ:
        return
    _TRIED.add(path)
    if not quiet:
        print("smp: measuring this machine's runtime costs per pass, step and collective (once, about 10 s; "
              "smp calibrate shows them)", file=sys.stderr, flush=True)
    try:
        measure_runtime_costs()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"smp: warning: the runtime's costs could not be measured ({' '.join(str(exc).split())[:300]}): "
              "predictions use the defaults; `smp calibrate` tries again", file=sys.stderr, flush=True)
