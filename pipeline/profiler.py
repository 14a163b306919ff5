"""Profiling real pipelined training: which steps to record, what every rank records, one merged trace.

A :class:`Profiler` lives on every rank. Between :meth:`Profiler.begin` and :meth:`Profiler.end` of the
steps in its window it hands the executor a :class:`pipeline.timeline.Recorder`, which records every pass
(F/B/W of microbatch k on stage s), the time each pass spent blocked on its receives, the sends and
receives themselves; the profiler adds the step itself, the time between two steps (data loading and the
user's code, the optimizer step included), host memory (RSS) and, on CUDA, allocated memory after each
step; and, every ``monitor_s`` seconds, the system monitor's samples of the host and device
(:mod:`pipeline.system_monitor`: per-core CPU, the rank's and its data-loader workers' CPU and memory, disk,
network, GPU). Outside the window nothing is recorded and the executor runs as it does unprofiled.

At the start of the window the ranks measure their clocks' offsets from rank 0's (:mod:`pipeline.clock`);
at its end every rank sends its spans, on rank 0's time axis, to rank 0, which writes the profile directory:

* ``trace.json`` -- one Chrome trace (Perfetto, chrome://tracing), one track per rank;
* ``profile.json`` -- the run: ranks and pipelines, the schedule, the plan, transfer times per stage edge,
  clock offsets, what profiling cost (its own spans, timed on each rank after the window), and per rank its
  system monitor's host, cores, interval and GPU (under ``ranks.R.system``);
* ``graph.npz`` -- the traced op graph the plan cuts, so that ``smp replan`` can cut it again;
* ``timeline.png`` -- the median step as measured, above the simulator's prediction of it
  (:mod:`pipeline.profile_description`).

Recording costs two clock reads and an append per span, tens of spans per step, so the overhead is a few
microseconds per pass; it is measured and written with the profile.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import psutil
import torch
import torch.distributed as dist

from partitioner.cost.calibration import cost_clock
from pipeline.clock import ClockOffset, clock_offset
from pipeline.profile_description import GRAPH_FILE, PROFILE_FILE, TIMELINE_FILE, TRACE_FILE, merge, write_gantt
from pipeline.system_monitor import SystemMonitor
from pipeline.timeline import Recorder, to_chrome_trace

__all__ = ["ProfileOptions", "Profiler", "memory_sample"]

_NULL = nullcontext()


@dataclass(frozen=True)
class ProfileOptions:
    """What to profile: ``dir`` to write the profile to (None: keep it in memory), ``steps`` = (start, stop):
    the steps numbered start .. stop - 1, counting from 0 (None: every step, until written), ``detail``:
    record the steps, the gaps between them, memory, receive waits, sends and receives too (False: only the
    passes, the timeline ``PipelineRunner(record=True).events`` has always been), and ``monitor_s``: sample
    the system (:mod:`pipeline.system_monitor`) every so many seconds with ``detail`` (None or 0: off)."""

    dir: str | None = None
    steps: tuple[int, int] | None = None
    detail: bool = True
    monitor_s: float | None = 0.2

    def __post_init__(self) -> None:
        if self.steps is not None:
            steps = tuple(self.steps)
            if (len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                    or not 0 <= steps[0] < steps[1]):
                raise ValueError(f"profile steps must be [start, stop] with 0 <= start < stop (steps start .. "
                                 f"stop - 1 are recorded, counting from 0), got {self.steps!r}")
            object.__setattr__(self, "steps", steps)
        if self.dir is not None:
            object.__setattr__(self, "dir", os.fspath(self.dir))
        interval = self.monitor_s
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float))
                                     or not (interval == 0 or 0.05 <= interval <= 60)):
            raise ValueError(f"profile monitor_s must be the system monitor's sampling interval in seconds, between "
                             f"0.05 and 60 (0.1 to 0.5 is the useful range), or 0 / None to turn it off; got "
                             f"{self.monitor_s!r}")

    @classmethod
    def of(cls, record: Any) -> ProfileOptions | None:
        """``PipelineRunner(record=...)``'s value: False/None (off), True (every pass, in memory, as the
        timeline of ``runner.events``), a directory, or ProfileOptions."""
        if record is None or record is False:
            return None
        if record is True:
            return cls(detail=False)
        if isinstance(record, cls):
            return record
        if isinstance(record, (str, os.PathLike)):
            return cls(dir=os.fspath(record))
        raise TypeError(f"record must be a bool, a directory or pipeline.profiler.ProfileOptions, got {record!r}")


def memory_sample(device: torch.device | None = None) -> dict[str, float]:
    """This process's resident host memory and, when CUDA is in use, the caching allocator's allocated and
    peak allocated bytes on ``device``."""
    out: dict[str, float] = {"rss_bytes": float(psutil.Process().memory_info().rss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        out["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return out


class Profiler:
    """One rank's profiler (see the module docstring). ``describe()`` (called on rank 0 when writing) returns
    the run's description for ``profile.json`` and may return the op graph under ``"graph"``."""

    def __init__(self, rank: int, options: ProfileOptions, *, clock: Callable[[], float] = perf_counter,
                 describe: Callable[[], dict[str, Any]] | None = None, device: torch.device | None = None) -> None:
        self.rank = rank
        self.options = options
        self.clock = clock
        self.describe = describe
        self.device = device
        cost = cost_clock(device or torch.device("cpu"))
        self.recorder = Recorder(rank, clock, detail=options.detail, cost_clock=None if cost is perf_counter else cost)
        self.index = 0              # steps begun so far (the next step's number)
        self.active = False         # inside the window
        self.done = False           # the window is over
        self.offset = ClockOffset(0.0, 0.0)
        self.written: str | None = None
        self.monitor: SystemMonitor | None = None
        self._group: Any = None
        self._step_start = 0.0
        self._last_end: float | None = None  # end of the previous step, when it was recorded
        if options.dir is None and options.steps is None:
            self.active = True       # an in-memory timeline needs no clock exchange: record from the start

    @property
    def recording(self) -> Recorder | None:
        """The recorder while a step of the window runs, else None (nothing is recorded)."""
        return self.recorder if self.active else None

    def span(self, name: str, cat: str) -> Any:
        """A context manager recording ``name`` while profiling (and doing nothing otherwise)."""
        return self.recorder.span(name, cat) if self.active else _NULL

    def begin(self) -> None:
        """A step starts: enter the window if it starts here (a collective over every rank), record the
        time since the previous step."""
        steps = self.options.steps
        if not self.active and not self.done and (steps is None or self.index == steps[0]):
            self._enter()
        if self.active and self.options.detail:
            if self.options.monitor_s and self.monitor is None:
                self.monitor = SystemMonitor(self.recorder, self.options.monitor_s, self.device)
                self.monitor.start()
            now = self.clock()
            if self._last_end is not None:
                self.recorder.add("between steps", self._last_end, now, "between")
            self._step_start = now

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """:meth:`begin` and :meth:`end` around one step (``end(ok=False)`` when it raises)."""
        self.begin()
        try:
            yield
        except BaseException:
            self.end(ok=False)
            raise
        self.end()

    def end(self, ok: bool = True) -> None:
        """The step ended (``ok``: without an error): record it and the memory; at the end of the window,
        write the profile (a collective over every rank, skipped after an error)."""
        index = self.index
        self.index += 1
        if not self.active:
            return
        if self.options.detail:
            self.recorder.add(f"step {index}", self._step_start, self.clock(), "step")
            self.recorder.counter("memory", memory_sample(self.device))
            self._last_end = self.clock() if ok else None
        steps = self.options.steps
        if steps is not None and self.index >= steps[1]:
            self.stop()
            if ok and self.options.dir is not None:
                self.write()

    def _enter(self) -> None:
        if self.options.dir is not None and dist.is_initialized():
            if dist.get_backend() != "gloo" and self._group is None:
                self._group = dist.new_group(backend="gloo")  # clock pings and the gather travel on CPU
            self.offset = clock_offset(self.clock, group=self._group)
        self.active = True
        self._last_end = None

    def stop(self) -> None:
        """Stop recording (what was recorded stays), the system monitor too."""
        self.active, self.done = False, True
        if self.monitor is not None:
            self.monitor.stop()

    def gather(self) -> list[dict[str, Any]] | None:
        """A collective over every rank: each rank's spans, counters, clock offset and overhead, on rank 0's
        time axis, to rank 0 (None on the other ranks)."""
        shift = self.offset.to_rank0
        part = {
            "rank": self.rank, "offset_s": self.offset.offset_s, "offset_error_s": self.offset.error_s,
            "events": [(e.action, shift(e.start), shift(e.end), e.cat, e.thread, e.cost) for e in self.recorder.events],
            "counters": [(c.name, shift(c.time), dict(c.values)) for c in self.recorder.counters],
            "overhead": self._overhead(),
            "system": self.monitor.summary() if self.monitor is not None else None,
        }
        if not dist.is_initialized():
            return [part]
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0, group=self._group)
        return parts

    def write(self) -> str | None:
        """A collective over every rank: gather and, on rank 0, write the profile directory (see the module
        docstring); returns its path on rank 0."""
        self.stop()
        parts = self.gather()
        if parts is None:
            return None
        directory = self.options.dir or "."
        os.makedirs(directory, exist_ok=True)
        events, counters = merge(parts)
        info = dict(self.describe()) if self.describe is not None else {}
        graph = info.pop("graph", None)
        if graph is not None:
            graph.save(os.path.join(directory, GRAPH_FILE))
        ranks = {str(p["rank"]): {"offset_s": p["offset_s"], "offset_error_s": p["offset_error_s"],
                                  "overhead": p["overhead"], "system": p["system"]} for p in parts}
        info.update(version=1, world=len(parts), steps=self.options.steps, ranks=ranks)
        to_chrome_trace(events, os.path.join(directory, TRACE_FILE), counters=counters,
                        metadata={"clock_offsets_s": {r: v["offset_s"] for r, v in ranks.items()}})
        with open(os.path.join(directory, PROFILE_FILE), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
        if "schedule" in info and any(e.cat == "step" for e in events):
            try:
                write_gantt(events, info, os.path.join(directory, TIMELINE_FILE))
            except ImportError:  # matplotlib is optional (the "viz" extra): the trace is written regardless
                pass
        self.written = directory
        return directory

    def _overhead(self) -> dict[str, float]:
        """What recording cost this rank: its spans and memory samples, each timed here on a scratch recorder,
        and the system monitor's samples, timed as they were taken."""
        scratch = Recorder(self.rank, self.clock, cost_clock=self.recorder.cost_clock)
        n = 2000
        t0 = perf_counter()
        for _ in range(n):
            with scratch.span("x"):  # a pass: the dearest kind of span
                pass
        per_span = (perf_counter() - t0) / n
        t0 = perf_counter()
        for _ in range(10):
            memory_sample(self.device)
        per_sample = (perf_counter() - t0) / 10
        events = self.recorder.events
        spans = sum(1 for e in events if e.cat not in ("step", "between"))
        samples = sum(1 for c in self.recorder.counters if c.name == "memory")
        profiled = sum(e.duration for e in events if e.cat in ("step", "between"))
        monitor = self.monitor.cost_s if self.monitor is not None else 0.0
        cost = spans * per_span + samples * per_sample + monitor
        return {"spans": spans, "per_span_s": per_span, "samples": samples, "per_sample_s": per_sample,
                "monitor_s": monitor, "overhead_s": cost, "profiled_s": profiled,
                "fraction": cost / profiled if profiled > 0 else 0.0}
