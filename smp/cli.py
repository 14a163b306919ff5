"""The ``smp`` command: see how a model would be split, why, and what it would cost, before paying for devices.

    smp inspect TARGET --partitions P [--microbatches M] [--pipeline interleaved|simple] ...
    smp simulate TARGET --partitions P --microbatches M [--ranks-per-node R] ...
    smp demo
    smp launch -n N script.py [args ...]

TARGET is ``zoo:NAME`` (a built-in model from :mod:`smp.zoo`, random weights, nothing downloaded) or
``path/to/file.py:factory``, a function returning ``(model, example_args)`` or ``(model, args, kwargs)`` where
the example inputs are one microbatch.

This module imports only the standard library at import time; torch, the partitioner and the pipeline are
imported inside the commands that need them. User errors print one line,
``smp: error: ...``, on stderr and exit with a non-zero status; set ``SMP_TRACEBACK=1`` to see tracebacks.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["main", "inspect", "simulate", "demo", "launch", "CLIError", "load_target", "analyse",
           "module_graph", "write_dot", "write_graph_png", "stage_color", "measure_stages", "parse_target"]

PROG = "smp"
PIPELINES = ("interleaved", "simple")
# SMP's names -> the schedule (and in-flight memory) they mean. SMP calls 1F1B "interleaved".
_SCHEDULE_OF = {"interleaved": "1f1b", "simple": "gpipe"}
_PIPELINE_TITLE = {"interleaved": "interleaved (1F1B)", "simple": "simple (GPipe)"}
OPTIMIZERS = ("adam", "adamw", "sgd")
METHODS = ("auto", "metis", "dp")
# Above this many stages `smp simulate` prices stages as total / P instead of partitioning for real.
EXACT_MAX_STAGES = 64
# Link assumptions of `smp simulate --ranks-per-node` (see README): intra-node links use the plan's link
# (DeviceRates.link_bytes_per_s / link_latency_s); inter-node links default to 10 Gb/s Ethernet.
INTER_NODE_BYTES_PER_S = 1.25e9
INTER_NODE_LATENCY_S = 1.0e-4


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


# --- output helpers -----------------------------------------------------------------------------------


class Progress:
    """Progress lines on stderr (``smp: [  1.2s] tracing ...``); silent with --quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"{PROG}: [{time.perf_counter() - self.t0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _size(n: float) -> str:
    from partitioner.units import format_bytes

    return format_bytes(n)


def _flops(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _time(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()) -> list[str]:
    """Right-aligned columns, except those in ``left``; the last column is never padded."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            if i == len(row) - 1 and i in left:
                cells.append(str(cell))
            else:
                cells.append(str(cell).ljust(widths[i]) if i in left else str(cell).rjust(widths[i]))
        return "  ".join(cells).rstrip()

    lines = [fmt(header)]
    lines.append("-" * len(lines[0]))
    lines.extend(fmt(r) for r in rows)
    return lines


def parse_duration(text: str) -> float:
    """``"100us"``, ``"0.1ms"``, ``"2e-5"`` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*", str(text))
    try:
        value = float(m.group(1)) if m else -1.0
    except ValueError:
        value = -1.0
    if not m or value < 0:
        raise CLIError(f"cannot read duration {text!r}: write a number with a unit, e.g. 100us, 0.1ms")
    return value * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1.0}[m.group(2)]


def parse_memory(text: str | None) -> float | None:
    """``"16GiB"`` -> bytes, with the partitioner's rules, as a one-line CLI error when it cannot."""
    if text is None:
        return None
    from partitioner.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


# --- targets ------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A model with one example microbatch, as named on the command line."""

    spec: str
    model: Any
    args: tuple
    kwargs: dict
    blocks: str = ""


def parse_target(spec: str) -> tuple[str, str]:
    """``zoo:gpt2`` -> ("zoo", "gpt2"); ``models/net.py:build`` -> ("models/net.py", "build")."""
    spec = spec.strip()
    if spec.startswith("zoo:"):
        name = spec[4:]
        if not name:
            raise CLIError("TARGET 'zoo:' names no model: write zoo:NAME, e.g. zoo:gpt2")
        return "zoo", name
    if ":" not in spec:
        if spec.endswith(".py"):
            raise CLIError(f"TARGET {spec!r} names no factory: write {spec}:FUNCTION, where FUNCTION() returns "
                           "(model, example_args) or (model, args, kwargs)")
        raise CLIError(f"TARGET {spec!r} is neither zoo:NAME nor path/to/file.py:factory "
                       f"(did you mean zoo:{spec}?)")
    path, factory = spec.rsplit(":", 1)
    if not path or not factory:
        raise CLIError(f"TARGET {spec!r} must look like path/to/file.py:factory")
    return path, factory


def load_target(spec: str, *, size: str = "small", batch: int = 4,
                progress: Callable[[str], None] = lambda m: None) -> Target:
    """Build the model and its example inputs named by ``spec`` (see :func:`parse_target`)."""
    where, name = parse_target(spec)
    if where == "zoo":
        progress(f"building {spec} ({size}, batch {batch})")
        from smp import zoo

        if name not in zoo.NAMES:
            raise CLIError(f"unknown zoo model {name!r} in TARGET {spec!r}; built-in models: {', '.join(zoo.NAMES)}")
        try:
            z = zoo.build(name, batch=batch, size=size)
        except ImportError as exc:
            raise CLIError(f"zoo:{name} needs a missing package ({exc}); install it with pip install "
                           "'smp-engine[zoo]'") from None
        return Target(spec, z.model, tuple(z.args), dict(z.kwargs), z.blocks)
    return _load_factory(spec, where, name, progress)


def _load_factory(spec: str, path: str, factory: str, progress: Callable[[str], None]) -> Target:
    if not os.path.exists(path):
        raise CLIError(f"TARGET {spec!r}: no such file {path!r}")
    if not os.path.isfile(path):
        raise CLIError(f"TARGET {spec!r}: {path!r} is not a file")
    progress(f"importing {path}")
    mod_name = "_smp_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    try:
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise CLIError(f"TARGET {spec!r}: cannot import {path!r} as Python (is it a .py file?)")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    except CLIError:
        raise
    except SyntaxError as exc:
        raise CLIError(f"cannot import {path}: SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        raise CLIError(f"cannot import {path}: {type(exc).__name__}: {_first_line(exc)}") from None
    fn = getattr(module, factory, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == mod_name)
        hint = f"; functions defined there: {', '.join(found)}" if found else ""
        raise CLIError(f"TARGET {spec!r}: {path} has no function {factory!r}{hint}")
    if not callable(fn):
        raise CLIError(f"TARGET {spec!r}: {factory!r} in {path} is a {type(fn).__name__}, not a function")
    progress(f"calling {factory}()")
    try:
        result = fn()
    except Exception as exc:
        raise CLIError(f"{path}:{factory}() raised {type(exc).__name__}: {_first_line(exc)}") from None
    import torch

    shape = "(model, example_args) or (model, args, kwargs)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise CLIError(f"{path}:{factory}() returned {type(result).__name__}; it must return {shape}")
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{path}:{factory}() returned a {type(model).__name__} as the model; it must be a "
                       f"torch.nn.Module ({shape})")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise CLIError(f"{path}:{factory}() returned {type(kwargs).__name__} as kwargs; it must be a dict")
    return Target(spec, model, tuple(args), dict(kwargs))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def trace_target(target: Target, progress: Callable[[str], None]):
    import partitioner

    progress(f"tracing {target.spec} with torch.export")
    # torch.export logs pages of warnings and graph dumps before it raises; the one-line error below says
    # what went wrong and how to fix it (SMP_TRACEBACK=1 keeps the logs and shows the traceback).
    if os.environ.get("SMP_TRACEBACK"):
        graph = partitioner.trace(target.model, target.args, target.kwargs)
    else:
        logging.disable(logging.CRITICAL)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                graph = partitioner.trace(target.model, target.args, target.kwargs)
        finally:
            logging.disable(logging.NOTSET)
    progress(f"traced {graph.describe()}")
    return graph


# --- plan analysis ------------------------------------------------------------------------------------


@dataclass
class Options:
    partitions: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    method: str = "auto"
    memory_weight: float = 0.2
    device_memory: float | None = None
    optimizer: str = "adam"
    measure: bool = False
    seed: int = 0

    @property
    def schedule(self) -> str:
        return _SCHEDULE_OF[self.pipeline]


def edge_bytes(graph: Any, assignment: dict[str, int], num_stages: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(producer stage, consumer stage) -> (bytes, tensors) crossing per microbatch (the objective's count)."""
    import numpy as np

    from partitioner.objective import stage_crossings

    return stage_crossings(graph, np.array([assignment[n] for n in graph.names], np.int64), num_stages)


def _stage_comm(plan: Any, graph: Any) -> tuple[list[tuple[int, int]], dict[tuple[int, int], float], dict]:
    """Stage dependency edges and their per-microbatch transfer times under the plan's link rates."""
    from partitioner.cost import DeviceRates

    rates = DeviceRates(**plan.rates) if plan.rates else DeviceRates()
    crossing = edge_bytes(graph, plan.assignment, plan.num_stages)
    deps = sorted(crossing)
    comm = {e: rates.comm_s(b, messages=c) for e, (b, c) in crossing.items()}
    return deps, comm, crossing


def simulate_stages(schedule_name: str, microbatches: int, forward_s: Sequence[float], backward_s: Sequence[float],
                    *, deps: Sequence[tuple[int, int]] | None = None, comm: dict[tuple[int, int], float] | None = None,
                    num_ranks: int | None = None, virtual_stages: int = 1):
    """Build the named schedule and run it through :func:`pipeline.simulate.simulate`."""
    from pipeline.schedule import make_schedule
    from pipeline.simulate import simulate as run_sim

    ranks = num_ranks or len(forward_s)
    kwargs = {"virtual_stages": virtual_stages} if virtual_stages != 1 else {}
    schedule = make_schedule(schedule_name, ranks, microbatches, **kwargs)
    return run_sim(schedule, list(forward_s), list(backward_s), comm_s=dict(comm or {}),
                   stage_deps=list(deps) if deps is not None else None)


def analyse(graph: Any, opts: Options, *, target: Target | None = None,
            progress: Callable[[str], None] = lambda m: None) -> tuple[Any, Any]:
    """Partition ``graph``, score the baselines, simulate the schedule, and measure if asked.

    Returns ``(plan, sim)``: the plan with ``extra["baselines"]``, ``extra["schedule"]`` (and
    ``extra["measured"]``, ``extra["target"]``) filled in, and the simulator's result for its schedule.
    """
    from partitioner import partition
    from partitioner.baselines import all_baselines
    from partitioner.partition import make_problem

    common = dict(memory_weight=opts.memory_weight, device_memory=opts.device_memory,
                  microbatches=opts.microbatches, pipeline=opts.schedule, optimizer=opts.optimizer,
                  seed=opts.seed)
    progress(f"partitioning into {opts.partitions} stages (method {opts.method})")
    plan = partition(graph, opts.partitions, method=opts.method, **common)
    progress(f"scoring baselines and simulating {opts.microbatches} microbatches, {opts.pipeline} pipeline")
    problem = make_problem(graph, opts.partitions, **common)
    baselines = {}
    for name, other in all_baselines(problem).items():
        other_sim = _plan_sim(other, graph, opts)
        baselines[name] = {"balance": other.balance, "bottleneck_s": other.bottleneck, "cut_bytes": other.cut_bytes,
                           "max_memory_bytes": max(s.memory_bytes for s in other.stages),
                           "predicted_step_s": other_sim.step_s}
    sim = _plan_sim(plan, graph, opts)
    plan.extra["baselines"] = baselines
    plan.extra["schedule"] = {
        "microbatches": opts.microbatches, "pipeline": opts.pipeline, "schedule": opts.schedule,
        "predicted_step_s": sim.step_s, "bubble": sim.bubble,
        "throughput_microbatches_per_s": opts.microbatches / sim.step_s if sim.step_s > 0 else 0.0,
    }
    if target is not None:
        plan.extra["target"] = target.spec
    if opts.measure:
        if target is None:
            raise CLIError("--measure needs the model's example inputs")
        fwd, bwd = measure_stages(plan, graph, target.args, target.kwargs, progress=progress)
        for s, f, b in zip(plan.stages, fwd, bwd):
            s.measured_s = f + b
        msim = _plan_sim(plan, graph, opts, forward_s=fwd, backward_s=bwd)
        plan.extra["measured"] = {"forward_s": fwd, "backward_s": bwd, "predicted_step_s": msim.step_s,
                                  "bubble": msim.bubble}
    return plan, sim


def _plan_sim(plan: Any, graph: Any, opts: Options, forward_s: Sequence[float] | None = None,
              backward_s: Sequence[float] | None = None):
    deps, comm, _ = _stage_comm(plan, graph)
    fwd = forward_s if forward_s is not None else [s.forward_s for s in plan.stages]
    bwd = backward_s if backward_s is not None else [s.backward_s for s in plan.stages]
    return simulate_stages(opts.schedule, opts.microbatches, fwd, bwd, deps=deps, comm=comm)


def measure_stages(plan: Any, graph: Any, args: tuple, kwargs: dict, *, repeats: int = 3,
                   progress: Callable[[str], None] = lambda m: None) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of every stage, run for real in this process (median of ``repeats``
    after one warm-up; :func:`partitioner.measure_stages`)."""
    from partitioner import measure_stages as measure
    from partitioner.split import split

    times = measure(split(graph, plan.assignment, plan.num_stages), args, kwargs, repeats=repeats, progress=progress)
    return times.forward_s, times.backward_s


# --- the inspect report -------------------------------------------------------------------------------


def _is_ancestor(a: str, b: str) -> bool:
    """Module path ``a`` contains ``b`` (the root ``""`` contains everything)."""
    return a != b and (a == "" or b.startswith(a + "."))


def _module_range(modules: Sequence[str]) -> str:
    """First .. last module of a stage, skipping containers whose children are listed."""
    mods = [m for m in modules if not any(_is_ancestor(m, o) for o in modules)] or list(modules)
    mods = [m or "(root)" for m in mods]
    if not mods:
        return ""
    return mods[0] if len(mods) == 1 or mods[0] == mods[-1] else f"{mods[0]} .. {mods[-1]}"


def format_report(plan: Any, graph: Any = None) -> str:
    """The table ``smp inspect`` prints: one row per stage, totals, bounds, schedule, baselines."""
    measured = plan.extra.get("measured")
    header = ["stage", "ops", "params", "FLOPs", "fwd ms", "bwd ms"]
    if measured:
        header += ["meas fwd", "meas bwd"]
    header += ["comm ms", "cost ms", "memory", "in", "out", "modules"]
    rows = []
    for s in plan.stages:
        row = [str(s.index), str(s.nodes), _size(s.param_bytes), _flops(s.flops), _ms(s.forward_s), _ms(s.backward_s)]
        if measured:
            row += [_ms(measured["forward_s"][s.index]), _ms(measured["backward_s"][s.index])]
        row += [_ms(s.comm_s), _ms(s.cost_s), _size(s.memory_bytes), _size(s.bytes_in), _size(s.bytes_out),
                _module_range(s.modules)]
        rows.append(row)
    unique_params = int(graph.param_bytes.sum()) if graph is not None else sum(s.param_bytes for s in plan.stages)
    total = ["total", str(sum(s.nodes for s in plan.stages)), _size(unique_params),
             _flops(sum(s.flops for s in plan.stages)), _ms(sum(s.forward_s for s in plan.stages)),
             _ms(sum(s.backward_s for s in plan.stages))]
    if measured:
        total += [_ms(sum(measured["forward_s"])), _ms(sum(measured["backward_s"]))]
    total += [_ms(sum(s.comm_s for s in plan.stages)), _ms(sum(s.cost_s for s in plan.stages)),
              _size(sum(s.memory_bytes for s in plan.stages)), "", _size(plan.cut_bytes), ""]
    lines = _table(header, rows + [total], left=(len(header) - 1,))
    lines.insert(len(lines) - 1, lines[1])
    worst = max(plan.stages, key=lambda s: s.cost_s).index
    lines.append("")
    lines.append(f"lower bound {_ms(plan.lower_bound)} ms per microbatch (max of total compute/{plan.num_stages} and the "
                 f"largest op); bottleneck {_ms(plan.bottleneck)} ms (stage {worst}); balance {plan.balance:.3f}")
    mw = plan.options.get("memory_weight", 0.2)
    lines.append(f"cut {_size(plan.cut_bytes)} per microbatch; largest stage memory "
                 f"{_size(max(s.memory_bytes for s in plan.stages))} (weights, gradients, "
                 f"{plan.options.get('optimizer', 'adam')} state, activations in flight); method {plan.method}, "
                 f"memory_weight {mw:g}")
    if plan.shared_params:
        lines.append("shared parameters (replicated, gradients summed): " +
                     ", ".join(f"{k} on stages {v}" for k, v in sorted(plan.shared_params.items())))
    sched = plan.extra.get("schedule")
    if sched:
        title = _PIPELINE_TITLE.get(sched["pipeline"], sched["pipeline"])
        lines.append(f"schedule {title}, {plan.num_stages} stages x {sched['microbatches']} microbatches: "
                     f"predicted step {_time(sched['predicted_step_s'])}, "
                     f"bubble {100 * sched['bubble']:.1f}%, "
                     f"{sched.get('throughput_microbatches_per_s', 0):.1f} microbatches/s")
    if measured:
        lines.append(f"with measured stage times: predicted step {_time(measured['predicted_step_s'])}, bubble "
                     f"{100 * measured['bubble']:.1f}%")
    base = plan.extra.get("baselines")
    if base:
        lines.append("baselines (same cost model and schedule; the plan minimises the worst stage's blend of time "
                     "and memory, --memory-weight 0 for time alone):")
        step = sched["predicted_step_s"] if sched else None
        for name, b in base.items():
            extra = ""
            if step and b.get("predicted_step_s"):
                extra = (f"  step {_time(b['predicted_step_s'])} "
                         f"({100 * (b['predicted_step_s'] / step - 1):+.1f}% vs plan)")
            mem = f"  max memory {_size(b['max_memory_bytes'])}" if b.get("max_memory_bytes") is not None else ""
            lines.append(f"  {name:<8} balance {b['balance']:.3f}  bottleneck {_ms(b['bottleneck_s'])} ms  "
                         f"cut {_size(b['cut_bytes'])}{mem}{extra}")
    return "\n".join(lines)


# --- the module-level graph picture -------------------------------------------------------------------

_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
            "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]


def stage_color(stage: int, num_stages: int) -> str:
    """Hex colour of a stage: matplotlib's tab10/tab20, then evenly spaced hues for more stages."""
    if num_stages <= len(_PALETTE):
        return _PALETTE[stage]
    import colorsys

    h = (stage * 0.618033988749895) % 1.0
    r, g, b = colorsys.hsv_to_rgb(h, 0.55, 0.9)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


_BLOCK_AT = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")


def _group_key(module: str) -> str:
    """A module path truncated after its first numbered segment (``transformer.h.3.attn`` -> ``transformer.h.3``),
    else to two levels (``bert.embeddings.LayerNorm`` -> ``bert.embeddings``)."""
    hit = _BLOCK_AT.match(module)
    if hit:
        return hit.group(1)
    return ".".join(module.split(".")[:2])


def _group_ops(modules: Sequence[str], small: int = 4) -> list[str]:
    """Group key of every op (in topological order).

    Keys are module paths truncated at the repeated-block level (:func:`_group_key`). A short run (fewer than
    ``small`` ops) of a container's own ops between its children (GPT-2's position ids, UNet's pooling, the
    final output) joins the run before it (the run after it, at the very start); a longer one (GPT-2's
    attention-mask arithmetic) stays a group of its own, named after the container.
    """
    keys = [_group_key(m) for m in modules]
    runs: list[list] = []  # [key, start, length]
    for i, k in enumerate(keys):
        if runs and runs[-1][0] == k:
            runs[-1][2] += 1
        else:
            runs.append([k, i, 1])

    def container(j: int) -> bool:
        k = runs[j][0]
        near = [runs[x][0] for x in (j - 1, j + 1) if 0 <= x < len(runs)]
        return runs[j][2] < small and any(_is_ancestor(k, o) for o in near)

    names = [r[0] for r in runs]
    for j in range(len(runs)):
        if container(j) and j > 0:
            names[j] = names[j - 1]
    for j in range(len(runs) - 1, -1, -1):
        if j == 0 or names[j] != runs[j][0] or not container(j):
            continue
        if j + 1 < len(runs):  # a container run at the very start joins what follows
            names[j] = names[j + 1]
    lead = 0
    while lead + 1 < len(runs) and container(lead):
        lead += 1
    for j in range(lead):
        names[j] = names[lead]
    out: list[str] = []
    for name, (_, _, length) in zip(names, runs):
        out.extend([name] * length)
    return out


def module_graph(plan: Any, graph: Any) -> tuple[list[dict], list[dict]]:
    """The op graph collapsed to module level: one node per (module group, stage), edges with the bytes of
    the distinct tensors they carry per microbatch; ``cut`` edges cross stages."""
    n = graph.num_nodes
    eff = _group_ops(graph.modules)
    stage = [plan.assignment[name] for name in graph.names]
    try:
        from partitioner.cost import DeviceRates, estimate

        cost = estimate(graph, DeviceRates(**plan.rates) if plan.rates else None).total_s
    except Exception:  # a picture without timings is still a picture
        cost = None
    ids: dict[tuple[str, int, int], int] = {}
    nodes: list[dict] = []
    op_group = []
    occurrence: dict[str, int] = {}  # a module run again later (T5's shared dropout) is a new node
    for i in range(n):
        if i == 0 or eff[i] != eff[i - 1]:
            occurrence[eff[i]] = occurrence.get(eff[i], -1) + 1
        key = (eff[i], stage[i], occurrence[eff[i]])
        if key not in ids:
            ids[key] = len(nodes)
            nodes.append({"id": len(nodes), "module": eff[i] or "(root)", "stage": stage[i], "ops": 0,
                          "flops": 0.0, "cost_s": 0.0})
        g = ids[key]
        op_group.append(g)
        nodes[g]["ops"] += 1
        nodes[g]["flops"] += float(graph.flops[i])
        if cost is not None:
            nodes[g]["cost_s"] += float(cost[i])
    stages_of: dict[str, set[int]] = {}
    for m, s, _ in ids:
        stages_of.setdefault(m or "(root)", set()).add(s)
    for node in nodes:
        split_here = len(stages_of[node["module"]]) > 1
        node["label"] = node["module"] + (f" [s{node['stage']}]" if split_here else "")
    seen: set[tuple[int, int, int]] = set()
    edge_b: dict[tuple[int, int], int] = {}
    for s, d, v in zip(graph.src.tolist(), graph.dst.tolist(), graph.value.tolist()):
        a, b = op_group[s], op_group[d]
        if a == b or (v, a, b) in seen:
            continue
        seen.add((v, a, b))
        edge_b[(a, b)] = edge_b.get((a, b), 0) + int(graph.value_bytes[v])
    edges = [{"src": a, "dst": b, "bytes": nb, "cut": nodes[a]["stage"] != nodes[b]["stage"]}
             for (a, b), nb in sorted(edge_b.items())]
    return nodes, edges


def _node_text(node: dict) -> str:
    return f"{node['label']}\n{node['ops']} ops" + (f", {_ms(node['cost_s'])} ms" if node["cost_s"] else "")


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_dot(plan: Any, graph: Any, path: str) -> None:
    """Graphviz text: one cluster per stage (filled with the stage's colour), cut edges labelled with bytes."""
    nodes, edges = module_graph(plan, graph)
    k = plan.num_stages
    out = ["digraph smp_plan {",
           f"  graph [rankdir=TB, fontname=Helvetica, label={_dot_quote(_graph_title(plan))}];",
           '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
           "  edge [fontname=Helvetica, fontsize=9, color=\"#555555\"];"]
    for s in range(k):
        col = stage_color(s, k)
        st = plan.stages[s]
        out.append(f"  subgraph cluster_stage{s} {{")
        out.append(f"    label={_dot_quote(f'stage {s}: {st.nodes} ops, {_ms(st.cost_s)} ms')}; "
                   f"color={_dot_quote(col)}; penwidth=2;")
        for node in nodes:
            if node["stage"] == s:
                out.append(f"    n{node['id']} [label={_dot_quote(_node_text(node))}, fillcolor={_dot_quote(col)}];")
        out.append("  }")
    for e in edges:
        if e["cut"]:
            out.append(f"  n{e['src']} -> n{e['dst']} [label={_dot_quote(_size(e['bytes']))}, color=black, "
                       "penwidth=2.5];")
        else:
            out.append(f"  n{e['src']} -> n{e['dst']};")
    out.append("}")
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")


def _graph_title(plan: Any) -> str:
    target = plan.extra.get("target", "model")
    return (f"{target}: {plan.num_stages} stages ({plan.method}), balance {plan.balance:.3f}, "
            f"cut {_size(plan.cut_bytes)} per microbatch")


def _layers(nodes: list[dict], edges: list[dict]) -> list[int]:
    """Topological layer of every node: longest path from a source (networkx; cycles are condensed), with
    nodes that read nothing (T5's decoder mask) moved down to just above their first reader."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(len(nodes)))
    g.add_edges_from((e["src"], e["dst"]) for e in edges)
    if nx.is_directed_acyclic_graph(g):
        layer_of = {v: i for i, gen in enumerate(nx.topological_generations(g)) for v in gen}
        layer = [layer_of[v] for v in range(len(nodes))]
    else:
        c = nx.condensation(g)
        layer_c = {v: i for i, gen in enumerate(nx.topological_generations(c)) for v in gen}
        layer = [layer_c[c.graph["mapping"][v]] for v in range(len(nodes))]
    for v in range(len(nodes)):
        if g.in_degree(v) == 0 and g.out_degree(v) > 0:
            layer[v] = max(layer[v], min(layer[w] for w in g.successors(v)) - 1)
    return layer


def write_graph_png(plan: Any, graph: Any, path: str) -> None:
    """Draw the module graph with matplotlib: layers top to bottom, nodes coloured by stage, cut edges bold
    and labelled with the bytes they carry per microbatch. An edge that skips layers runs down a lane beside
    the drawing, one lane per source (a bus), so a tensor read by every block stays readable.
    ``.svg`` or ``.png`` by the file name."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise CLIError("drawing --graph as an image needs matplotlib: pip install 'smp-engine[viz]' "
                       "(or write .dot)") from None
    nodes, edges = module_graph(plan, graph)
    k = plan.num_stages
    layer = _layers(nodes, edges)
    by_layer: dict[int, list[int]] = {}
    for v in sorted(range(len(nodes)), key=lambda v: (layer[v], v)):
        by_layer.setdefault(layer[v], []).append(v)
    gap = 3.2
    pos: dict[int, tuple[float, float]] = {}
    for ly, members in by_layer.items():
        for j, v in enumerate(members):
            pos[v] = ((j - (len(members) - 1) / 2) * gap, -float(ly))
    # Long edges: one bus per source; buses whose layer spans overlap get different lanes, right then left.
    short = [e for e in edges if layer[e["dst"]] - layer[e["src"]] <= 1]
    buses: dict[int, list[dict]] = {}
    for e in edges:
        if layer[e["dst"]] - layer[e["src"]] > 1:
            buses.setdefault(e["src"], []).append(e)
    lane_end: list[int] = []
    lane_of: dict[int, int] = {}
    for src in sorted(buses, key=lambda s: (layer[s], s)):
        lo, hi = layer[src], max(layer[e["dst"]] for e in buses[src])
        free = next((i for i, end in enumerate(lane_end) if end < lo), None)
        if free is None:
            lane_end.append(hi)
            free = len(lane_end) - 1
        lane_end[free] = hi
        lane_of[src] = free
    width = max(len(m) for m in by_layer.values())
    span_x = (width - 1) * gap
    lane_gap = 0.42
    side_lanes = (len(lane_end) + 1) // 2
    half_x = span_x / 2 + 1.4 + lane_gap * side_lanes + 0.6
    fig_w = max(7.0, 0.8 * 2 * half_x + 2.6)
    fig_h = max(4.0, 0.62 * len(by_layer) + 1.6)
    fig = Figure(figsize=(fig_w, fig_h), dpi=min(110.0, 30000.0 / fig_h))  # stay far below Agg's size limit
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Fixed margins (no tight_layout afterwards): sizes below are converted between points and data units.
    fig.subplots_adjust(left=0.02, right=1.0 - 2.3 / fig_w, top=1.0 - 0.45 / fig_h, bottom=0.02)
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(-half_x, half_x)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    bbox = ax.get_window_extent()
    x_per_pt = (2 * half_x) / (bbox.width * 72.0 / fig.dpi)
    fontsize = 8
    half_pt = {n["id"]: 0.31 * fontsize * max(len(s) for s in _node_text(n).split("\n")) + 6 for n in nodes}
    label_box = dict(boxstyle="round,pad=0.15", fc="#ffffdd", ec="#999999", lw=0.5)

    def style(cut: bool) -> dict:
        return dict(color="black" if cut else "#888888", lw=2.0 if cut else 0.9)

    for e in short:
        (x0, y0), (x1, y1) = pos[e["src"]], pos[e["dst"]]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", shrinkA=11, shrinkB=11, **style(e["cut"])))
        if e["cut"]:
            ax.text((x0 + x1) / 2 + 0.12, (y0 + y1) / 2, _size(e["bytes"]), fontsize=7.5, ha="left", va="center",
                    bbox=label_box, zorder=3)
    labels_at: dict[tuple[int, int], int] = {}
    for src, bus in buses.items():
        lane = lane_of[src]
        side = 1 if lane % 2 == 0 else -1
        xs_edge = span_x / 2 + 1.4 + lane_gap * (lane // 2)
        lx = side * xs_edge
        (x0, y0) = pos[src]
        y_last = min(pos[e["dst"]][1] for e in bus)
        cut_any = any(e["cut"] for e in bus)
        # Down half a layer first, so the trunk runs between rows rather than through this row's nodes.
        ax.plot([x0, x0, lx, lx], [y0, y0 - 0.5, y0 - 0.5, y_last], zorder=0, solid_joinstyle="round",
                **style(cut_any))
        for e in bus:
            x1, y1 = pos[e["dst"]]
            ax.annotate("", xy=(x1, y1), xytext=(lx, y1), zorder=1,
                        arrowprops=dict(arrowstyle="-|>", shrinkA=0, shrinkB=half_pt[e["dst"]], **style(e["cut"])))
            if e["cut"]:
                n = labels_at.get((e["dst"], side), 0)
                labels_at[(e["dst"], side)] = n + 1
                edge_x = x1 + side * (half_pt[e["dst"]] * x_per_pt + 0.05)
                ax.text(edge_x, y1 + 0.13 + 0.2 * n, _size(e["bytes"]), fontsize=7, va="bottom",
                        ha="left" if side > 0 else "right", bbox=label_box, zorder=3)
    for node in nodes:
        x, y = pos[node["id"]]
        ax.text(x, y, _node_text(node), ha="center", va="center", fontsize=fontsize, zorder=2,
                bbox=dict(boxstyle="round,pad=0.35", fc=stage_color(node["stage"], k), ec="black", lw=0.6))
    ax.axis("off")
    handles = [Patch(facecolor=stage_color(s, k), edgecolor="black",
                     label=f"stage {s}: {_ms(plan.stages[s].cost_s)} ms") for s in range(k)]
    handles.append(Patch(facecolor="white", edgecolor="black", label="bold: cut (bytes/microbatch)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(_graph_title(plan), fontsize=10)
    fig.savefig(path)


def write_graph(plan: Any, graph: Any, path: str) -> None:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".dot":
        write_dot(plan, graph, path)
    elif ext in (".png", ".svg"):
        write_graph_png(plan, graph, path)
    else:
        raise CLIError(f"--graph {path!r}: write .png, .svg or .dot")


def write_timeline(sim: Any, path: str, title: str | None = None) -> None:
    from pipeline import timeline

    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        timeline.to_chrome_trace(sim.events, path)
    elif ext == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--timeline .png needs matplotlib: pip install 'smp-engine[viz]' (or write .json)") from None
        timeline.to_png(sim.events, path, title=title)
    else:
        raise CLIError(f"--timeline {path!r}: write .png (Gantt chart) or .json (Chrome trace)")


def _check_output(path: str | None, flag: str, exts: Sequence[str]) -> None:
    if path is None:
        return
    ext = os.path.splitext(path)[1].lower()
    if ext not in exts:
        raise CLIError(f"{flag} {path!r}: the file name must end in {' or '.join(exts)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CLIError(f"{flag} {path!r}: folder {folder!r} does not exist")


def ascii_schedule(sim: Any, num_ranks: int, width: int = 96) -> str:
    """The simulated schedule as text: one row per rank; digits are forwards of microbatch k (mod 10), letters
    a-j its backward, w weight-gradient passes, '.' idle."""
    events = list(getattr(sim, "events", []) or [])
    if not events or sim.step_s <= 0:
        return ""
    scale = width / sim.step_s
    rows = [["."] * width for _ in range(num_ranks)]
    for ev in events:
        hit = _ACTION.fullmatch(ev.action)
        if hit is None or not 0 <= ev.rank < num_ranks:
            continue
        kind, mb = hit.group(1), int(hit.group(2))
        ch = str(mb % 10) if kind == "F" else ("abcdefghij"[mb % 10] if kind == "B" else "w")
        a = int(round(ev.start * scale))
        b = max(a + 1, int(round(ev.end * scale)))
        for x in range(a, min(b, width)):
            rows[ev.rank][x] = ch
    return "\n".join(f"rank {r:>2} |{''.join(row)}|" for r, row in enumerate(rows))


_ACTION = re.compile(r"([FBW])(\d+)@s(\d+)")


# --- commands -----------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise CLIError(f"{message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1")
    return value


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET",
                   help="zoo:NAME (gpt2, bert, vit, resnet, t5, mlp, unet, inception) or path/to/file.py:factory, "
                        "a function returning (model, example_args) or (model, args, kwargs); the example inputs "
                        "are one microbatch")
    p.add_argument("--size", choices=("small", "base"), default="small", help="zoo model size (default small)")
    p.add_argument("--batch", type=_positive_int, default=4, help="zoo microbatch size (default 4)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")


def _add_plan_args(p: argparse.ArgumentParser, *, microbatches_required: bool = False) -> None:
    p.add_argument("--partitions", "-p", type=_positive_int, required=True, help="pipeline stages")
    p.add_argument("--microbatches", "-m", type=_positive_int, required=microbatches_required,
                   default=None if microbatches_required else 1, help="microbatches per step (default 1)")
    p.add_argument("--pipeline", choices=PIPELINES, default="interleaved",
                   help="SMP naming: interleaved = 1F1B (default), simple = GPipe")
    p.add_argument("--method", choices=METHODS, default="auto", help="partitioner (default auto: best of both)")
    p.add_argument("--memory-weight", type=_weight, default=0.2,
                   help="0..1, how much memory balance counts next to time (SMP's memory_weight, default 0.2)")
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="per-device memory budget, e.g. 16GiB or 512MB (default: no limit)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="optimizer whose state counts in memory (default adam)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Partition a PyTorch model into pipeline stages: inspect the plan, "
                     "simulate its schedule, launch training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("inspect", help="show the partition plan, why, and what it costs",
                       description="Partition TARGET and print a table per stage, the bounds, the predicted step "
                                   "time and the baselines.")
    _add_target_args(p)
    _add_plan_args(p)
    p.add_argument("--measure", action="store_true", help="also time every stage's forward+backward for real")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--graph", metavar="FILE", help="draw the module graph coloured by stage (.png, .svg or .dot)")
    p.add_argument("--timeline", metavar="FILE", help="the simulated schedule: Gantt chart (.png) or Chrome trace "
                                                       "(.json)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("simulate", help="predict step time, throughput and bubble, up to 1024+ stages",
                       description="Predict the step time, throughput and bubble of a pipeline of TARGET, and "
                                   "compare schedules.")
    _add_target_args(p)
    _add_plan_args(p, microbatches_required=True)
    p.add_argument("--ranks-per-node", type=_positive_int, default=8,
                   help="ranks per node: consecutive stages on one node use the plan's (intra-node) link, "
                        "stage boundaries between nodes the inter-node link (default 8)")
    p.add_argument("--inter-node-bandwidth", metavar="SIZE", default=None,
                   help="inter-node bytes per second, e.g. 1.25GB (default 1.25GB = 10 Gb/s Ethernet)")
    p.add_argument("--inter-node-latency", metavar="TIME", default=None, help="inter-node latency (default 100us)")
    p.add_argument("--virtual-stages", type=_positive_int, default=2,
                   help="model chunks per rank for the interleaved-virtual row (default 2)")
    p.add_argument("--schedules", default="all",
                   help="schedules to compare, comma-separated: gpipe, 1f1b, interleaved-virtual, zero-bubble "
                        "(default all; each takes seconds at 1024 stages x 2048 microbatches)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("demo", help="partition a built-in GPT-2, show the plan and its schedule, train it pipelined",
                       description="The quickest look: zoo:gpt2 in 2 stages, its plan and simulated schedule, "
                                   "then a few training steps pipelined over 2 local processes.")
    p.add_argument("--partitions", "-p", type=_positive_int, default=2)
    p.add_argument("--microbatches", "-m", type=_positive_int, default=4)
    p.add_argument("--pipeline", choices=PIPELINES, default="interleaved")
    p.add_argument("--no-train", dest="train", action="store_false",
                   help="stop after the plan and schedule (skip training examples/train_gpt2.py pipelined)")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("launch", help="run a training script on N processes (wraps torchrun)",
                       description="torchrun --nproc-per-node N [--standalone] script.py args...; torchrun's "
                                   "multi-node options pass through.")
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
    p.set_defaults(func=cmd_launch)
    return parser


def _options(ns: argparse.Namespace) -> Options:
    return Options(partitions=ns.partitions, microbatches=ns.microbatches, pipeline=ns.pipeline, method=ns.method,
                   memory_weight=ns.memory_weight, device_memory=parse_memory(ns.device_memory),
                   optimizer=ns.optimizer, measure=getattr(ns, "measure", False), seed=getattr(ns, "seed", 0))


def cmd_inspect(ns: argparse.Namespace) -> int:
    opts = _options(ns)
    _check_output(ns.json, "--json", (".json",))
    _check_output(ns.graph, "--graph", (".png", ".svg", ".dot"))
    _check_output(ns.timeline, "--timeline", (".png", ".json"))
    progress = Progress(ns.quiet)
    target = load_target(ns.target, size=ns.size, batch=ns.batch, progress=progress)
    graph = trace_target(target, progress)
    plan, sim = analyse(graph, opts, target=target, progress=progress)
    print(f"{target.spec}: {graph.describe()}")
    print(format_report(plan, graph))
    _write_outputs(plan, graph, sim, json_path=ns.json, graph_path=ns.graph, timeline_path=ns.timeline,
                   progress=progress)
    return 0


def _write_outputs(plan: Any, graph: Any, sim: Any, *, json_path: str | None, graph_path: str | None,
                   timeline_path: str | None, progress: Callable[[str], None]) -> None:
    if json_path:
        plan.to_json(json_path)
        progress(f"wrote {json_path}")
    if graph_path:
        write_graph(plan, graph, graph_path)
        progress(f"wrote {graph_path}")
    if timeline_path:
        sched = plan.extra.get("schedule", {})
        title = (f"{plan.extra.get('target', 'model')}: p={plan.num_stages}, m={sched.get('microbatches')}, "
                 f"{_SCHEDULE_OF.get(sched.get('pipeline'), '')}, step {_time(sim.step_s)}, "
                 f"bubble {100 * sim.bubble:.0f}%")
        write_timeline(sim, timeline_path, title)
        progress(f"wrote {timeline_path}")


def inspect(argv: Sequence[str]) -> int:
    """``smp inspect ARGS``, from Python: ``inspect(["zoo:gpt2", "--partitions", "4"])``."""
    return main(["inspect", *argv])


# --- simulate -----------------------------------------------------------------------------------------


@dataclass
class PipelineCosts:
    """Per-stage forward/backward seconds and per-boundary bytes of a pipeline to simulate."""

    forward_s: list[float]
    backward_s: list[float]
    deps: list[tuple[int, int]]
    edge_bytes: dict[tuple[int, int], tuple[int, int]]
    exact: bool
    note: str = ""
    rates: dict[str, float] = field(default_factory=dict)
    act_bytes: list[float] = field(default_factory=list)  # activations one microbatch leaves on each stage


def _pipeline_costs(graph: Any, opts: Options, stages: int, *, exact: bool = True) -> PipelineCosts:
    """A real plan for ``stages`` stages when ``exact`` and ``stages <= min(ops, EXACT_MAX_STAGES)``; otherwise
    the model's totals scaled to total / P per stage, with the mean boundary of a real plan of up to 16 stages."""
    import numpy as np

    from partitioner import partition

    ops = sum(k != "output" for k in graph.kinds)
    common = dict(memory_weight=opts.memory_weight, microbatches=opts.microbatches, pipeline=opts.schedule,
                  optimizer=opts.optimizer, seed=opts.seed)

    def acts(plan: Any) -> list[float]:
        stage = np.array([plan.assignment[n] for n in graph.names], np.int64)
        return np.bincount(stage, weights=graph.act_bytes, minlength=plan.num_stages).tolist()

    if exact and stages <= min(ops, EXACT_MAX_STAGES):
        plan = partition(graph, stages, method=opts.method, device_memory=opts.device_memory, **common)
        crossing = edge_bytes(graph, plan.assignment, stages)
        return PipelineCosts([s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages],
                             sorted(crossing), crossing, True,
                             f"a real {stages}-stage plan ({plan.method}, balance {plan.balance:.3f})", plan.rates,
                             acts(plan))
    k0 = max(1, min(ops, 16, stages))
    plan = partition(graph, k0, method=opts.method, **common)
    fwd = sum(s.forward_s for s in plan.stages)
    bwd = sum(s.backward_s for s in plan.stages)
    crossing = edge_bytes(graph, plan.assignment, k0)
    per_boundary = plan.cut_bytes / max(k0 - 1, 1)
    tensors = max(1, round(sum(c for _, c in crossing.values()) / max(k0 - 1, 1)))
    why = (f"P={stages} > the model's {ops} ops, so no real plan exists" if stages > ops
           else f"P={stages} > {EXACT_MAX_STAGES}")
    deeper = f", as if the model were {stages / ops:.1f}x deeper" if stages > ops else ""
    note = (f"{why}: every stage gets total/P = ({_ms(fwd)} + {_ms(bwd)} ms)/{stages} per microbatch{deeper}; "
            f"each boundary carries {_size(per_boundary)}, the mean boundary of a real {k0}-stage plan")
    chain = [(s, s + 1) for s in range(stages - 1)]
    total_act = float(graph.act_bytes.sum())
    return PipelineCosts([fwd / stages] * stages, [bwd / stages] * stages, chain,
                         {e: (int(per_boundary), tensors) for e in chain}, False, note, plan.rates,
                         [total_act / stages] * stages)


def _link_comm(costs: PipelineCosts, stage_rank: Sequence[int], ranks_per_node: int,
               inter_bw: float, inter_lat: float) -> dict[tuple[int, int], float]:
    """Seconds per boundary: 0 on one rank, the plan's link within a node, the inter-node link across."""
    from partitioner.cost import DeviceRates

    intra = DeviceRates(**costs.rates) if costs.rates else DeviceRates()
    inter = DeviceRates(link_bytes_per_s=inter_bw, link_latency_s=inter_lat)
    comm = {}
    for (s, t), (b, c) in costs.edge_bytes.items():
        ra, rb = stage_rank[s], stage_rank[t]
        if ra == rb:
            comm[(s, t)] = 0.0
        else:
            link = intra if ra // ranks_per_node == rb // ranks_per_node else inter
            comm[(s, t)] = link.comm_s(b, messages=c)
    return comm


def _peak_activations(schedule: Any, act_bytes: Sequence[float]) -> float:
    """Most activation bytes any rank holds at once under the schedule (an activation lives from F to B,
    or to W when the backward is split)."""
    free = "W" if schedule.split_backward else "B"
    peak = 0.0
    for order in schedule.actions:
        held = top = 0.0
        for a in order:
            if a.kind == "F":
                held += act_bytes[a.stage]
                top = max(top, held)
            elif a.kind == free:
                held -= act_bytes[a.stage]
        peak = max(peak, top)
    return peak


def _sim_row(name: str, costs: PipelineCosts, microbatches: int, ranks: int, rpn: int,
             inter: tuple[float, float], virtual: int = 1) -> dict[str, Any]:
    """Simulate one schedule (zero-bubble splits each backward into equal B and W halves)."""
    fwd, bwd = costs.forward_s, costs.backward_s
    stage_rank = [s % ranks for s in range(len(fwd))]
    comm = _link_comm(costs, stage_rank, rpn, *inter)
    sim = simulate_stages(name, microbatches, fwd, bwd, deps=costs.deps, comm=comm, num_ranks=ranks,
                          virtual_stages=virtual)
    row = {"schedule": name, "virtual_stages": virtual, "predicted_step_s": sim.step_s, "bubble": sim.bubble,
           "throughput_microbatches_per_s": microbatches / sim.step_s if sim.step_s > 0 else 0.0,
           "peak_activation_bytes": _peak_activations(sim.schedule, costs.act_bytes) if costs.act_bytes else None}
    return row


# Rows of the schedule comparison: --schedules name -> (label, pipeline.schedule name).
COMPARED = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-virtual": "interleaved-virtual", "zero-bubble": "zb-h1"}


def _schedule_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(COMPARED)
    bad = [s for s in names if s not in COMPARED]
    if bad or not names:
        raise CLIError(f"--schedules {text!r}: choose from {', '.join(COMPARED)} (comma-separated) or all")
    return names


def cmd_simulate(ns: argparse.Namespace) -> int:
    opts = _options(ns)
    _check_output(ns.json, "--json", (".json",))
    compared = _schedule_list(ns.schedules)
    inter_bw = parse_memory(ns.inter_node_bandwidth) if ns.inter_node_bandwidth else INTER_NODE_BYTES_PER_S
    inter_lat = parse_duration(ns.inter_node_latency) if ns.inter_node_latency else INTER_NODE_LATENCY_S
    progress = Progress(ns.quiet)
    target = load_target(ns.target, size=ns.size, batch=ns.batch, progress=progress)
    graph = trace_target(target, progress)
    P, M, V, rpn = opts.partitions, opts.microbatches, ns.virtual_stages, ns.ranks_per_node
    inter = (inter_bw, inter_lat)
    progress(f"pricing {P} stages")
    costs = _pipeline_costs(graph, opts, P)
    if opts.schedule not in compared:  # the chosen pipeline is always simulated
        compared.insert(0, opts.schedule)
    rows: dict[str, dict[str, Any]] = {}
    for key in [k for k in COMPARED if k in compared]:
        name = COMPARED[key]
        if name == "interleaved-virtual":
            label = f"interleaved-virtual (v={V})"
            if V == 1 or M % P:
                why = "needs --virtual-stages > 1" if V == 1 else f"needs microbatches % partitions == 0 (m={M}, p={P})"
                rows[label] = {"schedule": name, "virtual_stages": V, "skipped": why}
                continue
            progress(f"simulating {label}: {P * V} virtual stages x {M} microbatches")
            vcosts = _pipeline_costs(graph, opts, P * V, exact=costs.exact)
            rows[label] = _sim_row(name, vcosts, M, P, rpn, inter, virtual=V)
        else:
            label = "zero-bubble (ZB-H1)" if name == "zb-h1" else key
            progress(f"simulating {label}: {P} stages x {M} microbatches")
            rows[label] = _sim_row(name, costs, M, P, rpn, inter)
    main_row = rows[opts.schedule]
    ok = {k: r for k, r in rows.items() if "skipped" not in r}
    best = min(ok, key=lambda k: ok[k]["predicted_step_s"])
    T = sum(costs.forward_s) + sum(costs.backward_s)
    progress("scaling table")
    scaling = _scaling(graph, opts, costs, P, M, rpn, inter, main_row)

    nodes = math.ceil(P / rpn)
    print(f"{target.spec}: {graph.describe()}")
    print(f"{P} stages on {nodes} node(s) of {rpn} ranks, {M} microbatches, {_PIPELINE_TITLE[opts.pipeline]}")
    print(f"stage costs: {costs.note}")
    print(f"links: within a node {_size(costs.rates.get('link_bytes_per_s', 0))}/s + "
          f"{_time(costs.rates.get('link_latency_s', 0))} per tensor (the plan's link); between nodes "
          f"{_size(inter_bw)}/s + {_time(inter_lat)}")
    ideal = M * max(f + b for f, b in zip(costs.forward_s, costs.backward_s))
    print(f"predicted step {_time(main_row['predicted_step_s'])}, throughput "
          f"{main_row['throughput_microbatches_per_s']:.1f} microbatches/s, bubble {100 * main_row['bubble']:.1f}% "
          f"(bottleneck stage x m = {_time(ideal)}; one device would take {_time(M * T)})")
    print()
    print(f"schedules at p={P}, m={M} (same stage costs and links):")
    table = []
    for label, r in rows.items():
        if "skipped" in r:
            table.append([label, "-", "-", "-", "-", r["skipped"]])
            continue
        peak = r.get("peak_activation_bytes")
        table.append([label, _time(r["predicted_step_s"]), f"{r['throughput_microbatches_per_s']:.1f}",
                      f"{100 * r['bubble']:.1f}%", _size(peak) if peak is not None else "-",
                      "<- fastest" if label == best else ""])
    print("\n".join("  " + line for line in _table(
        ["schedule", "step", "microbatches/s", "bubble", "peak activations/rank", ""], table, left=(0, 5))))
    chosen = main_row["predicted_step_s"]
    gain = (f", {100 * (1 - ok[best]['predicted_step_s'] / chosen):.1f}% faster than {opts.schedule}"
            if ok[best] is not main_row else f" (the {opts.pipeline} pipeline you chose)")
    print(f"winner: {best}{gain}")
    print()
    simulated = all(r["simulated"] for r in scaling)
    how = ("simulated with the links above" if simulated else
           "equal stages, compute only: (m + p - 1) T/p per step, bubble (p - 1)/(m + p - 1)")
    print(f"how it scales with p and m ({opts.schedule}; a microbatch costs T = {_ms(T)} ms of compute, T/p per "
          f"stage; {how}):")
    ps = sorted({r["p"] for r in scaling})
    ms = sorted({r["m"] for r in scaling})
    grid = {(r["p"], r["m"]): r for r in scaling}
    header = ["p \\ m"] + [str(m) for m in ms]
    body = [[str(p)] + [f"{_time(grid[(p, m)]['step_s'])} ({100 * grid[(p, m)]['bubble']:.1f}%)" for m in ms]
            for p in ps]
    print("\n".join("  " + line for line in _table(header, body)))
    if not simulated:
        formula = grid[(P, M)]["step_s"]
        print(f"  (too large to simulate every cell quickly; at p={P}, m={M} the simulation above adds "
              f"{_time(main_row['predicted_step_s'] - formula)} of communication to the formula's {_time(formula)})")
    if ns.json:
        out = {"target": target.spec, "partitions": P, "microbatches": M, "pipeline": opts.pipeline,
               "schedule": opts.schedule, "ranks_per_node": rpn, "exact": costs.exact, "note": costs.note,
               "intra_node": {"bytes_per_s": costs.rates.get("link_bytes_per_s"),
                              "latency_s": costs.rates.get("link_latency_s")},
               "inter_node": {"bytes_per_s": inter_bw, "latency_s": inter_lat}, "rates": costs.rates,
               "stage_forward_s": costs.forward_s, "stage_backward_s": costs.backward_s,
               "predicted_step_s": main_row["predicted_step_s"], "bubble": main_row["bubble"],
               "throughput_microbatches_per_s": main_row["throughput_microbatches_per_s"],
               "schedules": rows, "winner": best, "scaling": scaling}
        with open(ns.json, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True)
            fh.write("\n")
        progress(f"wrote {ns.json}")
    return 0


SCALING_SIM_MAX = 1 << 16  # p * m up to which a scaling cell is simulated (well under a second)


def _scaling(graph: Any, opts: Options, costs: PipelineCosts, P: int, M: int, rpn: int,
             inter: tuple[float, float], main_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chosen schedule at p in {P/4, P/2, P} x m in {M/4, M/2, M}: simulated with the same pricing rule
    and links as the main result when every cell has p * m <= SCALING_SIM_MAX; otherwise, for every cell, the
    equal-stage compute-only formula step = (m + p - 1) T / p, bubble = (p - 1) / (m + p - 1), which the
    simulator reproduces when communication is free."""
    total = sum(costs.forward_s) + sum(costs.backward_s)
    ps = sorted({max(1, P // 4), max(1, P // 2), P})
    ms = sorted({max(1, M // 4), max(1, M // 2), M})
    simulated = P * M <= SCALING_SIM_MAX
    cache: dict[int, PipelineCosts] = {P: costs}
    out = []
    for p in ps:
        for m in ms:
            if not simulated:
                out.append({"p": p, "m": m, "step_s": (m + p - 1) * total / p, "bubble": (p - 1) / (m + p - 1),
                            "simulated": False})
                continue
            if (p, m) == (P, M):
                r = main_row
            else:
                if p not in cache:
                    cache[p] = _pipeline_costs(graph, opts, p, exact=costs.exact)
                r = _sim_row(opts.schedule, cache[p], m, p, rpn, inter)
            out.append({"p": p, "m": m, "step_s": r["predicted_step_s"], "bubble": r["bubble"], "simulated": True})
    return out


def simulate(argv: Sequence[str]) -> int:
    """``smp simulate ARGS``, from Python."""
    return main(["simulate", *argv])


# --- demo ---------------------------------------------------------------------------------------------


def demo(argv: Sequence[str] | None = None) -> int:
    """``smp demo``: partition the built-in GPT-2 into 2 stages, print the plan and the simulated schedule.

    The demo is the list of steps in ``DEMO_STEPS``, each a function of one :class:`DemoRun` that prints its
    part and leaves results on the run for the steps after it; a step that returns a non-zero exit code stops
    the demo. Training GPT-2 pipelined (``examples/train_gpt2.py`` through ``smp launch``; ``--no-train`` skips
    it) is the last step; extend the demo by adding steps.
    """
    return main(["demo", *(argv or [])])


@dataclass
class DemoRun:
    args: argparse.Namespace
    opts: Options
    progress: Progress
    graph: Any = None
    plan: Any = None
    sim: Any = None


def _demo_plan(run: DemoRun) -> int:
    o = run.opts
    print(f"smp demo: GPT-2 (built-in small config, random weights) in {o.partitions} pipeline stages, "
          f"{o.microbatches} microbatches, {_PIPELINE_TITLE[o.pipeline]}")
    target = load_target("zoo:gpt2", progress=run.progress)
    run.graph = trace_target(target, run.progress)
    run.plan, run.sim = analyse(run.graph, o, target=target, progress=run.progress)
    print()
    print(format_report(run.plan, run.graph))
    return 0


def _demo_schedule(run: DemoRun) -> int:
    text = ascii_schedule(run.sim, run.plan.num_stages)
    if text:
        print()
        m = run.plan.extra["schedule"]["microbatches"]
        letters = "a" if m == 1 else f"a-{chr(ord('a') + min(m, 10) - 1)}"
        print(f"simulated schedule, {_time(run.sim.step_s)} per step (digits: forward of microbatch k, letters "
              f"{letters}: its backward, '.': idle):")
        print(text)
    return 0


TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt2.py")


def _demo_train(run: DemoRun) -> int:
    """Unless ``--no-train``: run ``examples/train_gpt2.py`` pipelined on ``--partitions`` processes."""
    if not run.args.train:
        print()
        print("next: smp inspect zoo:gpt2 --partitions 4 --microbatches 8 --graph plan.png --timeline steps.png")
        return 0
    if not os.path.exists(TRAIN_SCRIPT):
        raise CLIError(f"pipelined training is not available yet ({TRAIN_SCRIPT} is missing)")
    o = run.opts
    run.progress(f"training with {TRAIN_SCRIPT} on {o.partitions} processes")
    return launch(["-n", str(o.partitions), TRAIN_SCRIPT, "--partitions", str(o.partitions),
                   "--microbatches", str(o.microbatches), "--pipeline", o.pipeline])


DEMO_STEPS: list[Callable[[DemoRun], int]] = [_demo_plan, _demo_schedule, _demo_train]


def cmd_demo(ns: argparse.Namespace) -> int:
    run = DemoRun(ns, Options(partitions=ns.partitions, microbatches=ns.microbatches, pipeline=ns.pipeline),
                  Progress(ns.quiet))
    for step in DEMO_STEPS:
        code = step(run)
        if code:
            return code
    return 0


# --- launch -------------------------------------------------------------------------------------------


def torchrun_args(ns: argparse.Namespace) -> list[str]:
    """The argument list for ``torch.distributed.run.main``."""
    args = ["--nproc-per-node", str(ns.nproc)]
    multi = ns.nnodes is not None or ns.rdzv_endpoint is not None or ns.master_addr is not None
    if not multi:
        args.append("--standalone")
    for flag, value in (("--nnodes", ns.nnodes), ("--node-rank", ns.node_rank), ("--rdzv-endpoint", ns.rdzv_endpoint),
                        ("--rdzv-backend", ns.rdzv_backend), ("--rdzv-id", ns.rdzv_id),
                        ("--master-addr", ns.master_addr), ("--master-port", ns.master_port),
                        ("--max-restarts", ns.max_restarts)):
        if value is not None:
            args += [flag, str(value)]
    script_args = list(ns.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return args + [ns.script, *script_args]


def launch(argv: Sequence[str]) -> int:
    """``smp launch ARGS``, from Python."""
    return main(["launch", *argv])


def cmd_launch(ns: argparse.Namespace) -> int:
    if not os.path.isfile(ns.script):
        raise CLIError(f"no such script {ns.script!r}")
    nproc = str(ns.nproc)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "cpu", "auto"):
        raise CLIError(f"-n {nproc!r}: give a positive number of processes (or gpu, cpu, auto)")
    args = torchrun_args(ns)
    if ns.dry_run:
        print("torchrun " + " ".join(args))
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except ChildFailedError as exc:
        failures = getattr(exc, "failures", {}) or {}
        ranks = ", ".join(str(getattr(f, "local_rank", r)) for r, f in sorted(failures.items())) or "?"
        raise CLIError(f"{ns.script} failed on local rank(s) {ranks} (see their output above)") from None
    return 0


# --- entry point --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = build_parser().parse_args(argv)
        return int(ns.func(ns) or 0)
    except CLIError as exc:
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # every failure becomes one line; SMP_TRACEBACK=1 shows where
        if os.environ.get("SMP_TRACEBACK"):
            raise
        return _fail(_describe(exc), 1)


def _describe(exc: Exception) -> str:
    """What the engine raises for bad input (ValueError and its kin: budget, schedule and graph errors; the
    tracer's TraceError; OSError of a file; ImportError of an optional package) is shown as its message;
    anything else is a bug and says so."""
    from_input = (ValueError, TypeError, OSError, ImportError)
    name = type(exc).__name__
    text = " ".join(str(exc).split()) or name
    if name == "TraceError" or type(exc) is ValueError or name == "MemoryBudgetError":
        return text
    if isinstance(exc, from_input):
        return f"{name}: {text}"
    return f"internal error, {name}: {text} (set SMP_TRACEBACK=1 to see where)"


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
