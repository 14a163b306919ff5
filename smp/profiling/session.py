"""Profiling smp training (the module behind ``smp.profile``): ``smp.profile(dir)``, the config's ``"profile"``
key, ``smp.annotate(name)``.

Every rank keeps one :class:`pipeline.profiler.Profiler` per profile (the config's window of steps, or the steps
inside a ``with smp.profile(dir):`` block). Each ``@smp.step`` call (:func:`smp.engine.execution.run_step`) calls
:meth:`Session.before` and :meth:`Session.after`, which start and end the profiler's steps and hand its recorder to
the pipeline, so the passes, waits, sends and receives of the step are recorded; ``DistributedOptimizer.step`` and
``smp.annotate`` blocks are recorded as spans of their own. When the window ends (or the block exits), rank 0 writes
the profile directory: one merged Chrome trace, the run's description, the op graph (see :mod:`pipeline.profiler`).
``smp report DIR`` explains it (:mod:`smp.profiling.report`), ``smp replan DIR`` re-partitions from it
(:mod:`smp.profiling.replan`). With ``"auto_repartition"`` the session records the first steps and says when that
profile is complete (:meth:`Session.repartition_due`); the step decides what to do with it.

When nothing is profiled, a step costs one attribute lookup more.
"""
from __future__ import annotations

import atexit
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from pipeline.profile_description import run_description
from pipeline.profiler import ProfileOptions, Profiler
from smp.runtime import state
from smp.runtime.config import AutoRepartition

__all__ = ["profile", "annotate", "span", "Session", "session_of"]


class Session:
    """This process's profiling: the steps begun so far, the active profiler, a pending re-partition."""

    def __init__(self, st: state.State) -> None:
        self.steps = 0
        self.profiler: Profiler | None = None
        self.repartition = st.config.repartition
        options = st.config.profile_options
        if self.repartition is not None:  # profile the first steps for the re-planner, then the config's window
            self.profiler = self.make_profiler(st, ProfileOptions(self.repartition.dir, self.repartition.steps))
            self._next = options
        elif options is not None:
            self.profiler = self.make_profiler(st, options)
            self._next = None
        if options is not None:
            atexit.register(self._warn_unfinished)

    def make_profiler(self, st: state.State, options: ProfileOptions) -> Profiler:
        """A profiler for ``options`` on this rank, counting steps from this session's."""
        def describe() -> dict[str, Any]:
            topo = st.topology
            return {**run_description(st.model.runner), "config": st.config.to_dict(),
                    "topology": {"pp": topo.pp, "dp": topo.dp, "world": topo.world}}

        profiler = Profiler(st.rank, options, describe=describe, device=st.device)
        profiler.index = self.steps
        return profiler

    def _warn_unfinished(self) -> None:
        p = self.profiler
        if p is not None and not p.done and p.options.steps is not None and state.is_initialized() \
                and state.get().rank == 0:
            print(f"smp: the profile of steps {p.options.steps[0]} .. {p.options.steps[1] - 1} was not written: "
                  f"the run ended after {self.steps} steps; end the window within the run, or use "
                  "`with smp.profile(dir):` around the steps", file=sys.stderr)

    def repartition_due(self) -> tuple[Profiler, AutoRepartition] | None:
        """The re-planner's complete profile and options when ``"auto_repartition"`` is due before this step;
        the step then re-partitions (:mod:`smp.engine.repartition`) and calls :meth:`repartition_done`."""
        p = self.profiler
        if p is not None and p.done and self.repartition is not None:
            return p, self.repartition
        return None

    def repartition_done(self, st: state.State) -> None:
        """The re-planner's window is used: move on to the config's profile window, if any."""
        self.repartition = None
        self.profiler = self.make_profiler(st, self._next) if self._next is not None else None

    def before(self, model: Any) -> None:
        """Before step ``self.steps``: hand the profiler, if one records, to the model's pipeline."""
        p = self.profiler
        if p is not None:
            p.index = self.steps  # a profile block in between did not count this profiler's steps
            p.begin()
            if model.partitioned:
                model.runner.profiler = p
            else:  # the first step partitions: hand the profiler to the runner as soon as it exists
                model.register_post_partition_hook(lambda m, _: setattr(m.runner, "profiler", p))
        elif model.partitioned:
            model.runner.profiler = None

    def after(self, ok: bool) -> None:
        """After a step (``ok``: it did not raise)."""
        self.steps += 1
        if self.profiler is not None:
            self.profiler.end(ok)


def session_of(st: state.State) -> Session:
    """The profiling session of the process ``st`` describes, made on first use."""
    if st.profiling is None:
        st.profiling = Session(st)
    return st.profiling


def span(name: str, cat: str) -> Any:
    """A context manager recording ``name`` (category ``cat``) while a profile records, else nothing."""
    if not state.is_initialized():
        return nullcontext()
    st = state.get()
    profiler = st.profiling.profiler if st.profiling is not None else None
    return profiler.span(name, cat) if profiler is not None else nullcontext()


@contextmanager
def annotate(name: str) -> Iterator[None]:
    """``with smp.annotate("load batch"):`` (or ``@smp.annotate("eval")``) shows the block as a span named
    ``name`` in the profile, on the rank's track (the step function's own track inside ``@smp.step``).
    Without a profile recording it does nothing."""
    with span(name, "user"):
        yield


@contextmanager
def profile(directory: str) -> Iterator[Profiler]:
    """``with smp.profile("prof"):`` records every step inside the block; at its end every rank must leave
    the block (a collective) and rank 0 writes the profile to ``directory`` (``smp report prof`` explains it).
    Nothing is written when the block ends with an error."""
    session = session_of(state.get())
    if session.profiler is not None and session.profiler.active:
        raise RuntimeError("smp.profile: a profile is already recording (the config's 'profile' or "
                           "'auto_repartition' window, or another smp.profile block); profile one window at a time")
    previous = session.profiler
    profiler = session.profiler = session.make_profiler(state.get(), ProfileOptions(directory))
    try:
        yield profiler
    except BaseException:
        profiler.stop()
        raise
    finally:
        session.profiler = previous
    if profiler.active:  # else no step ran in the block: nothing to write (on every rank alike)
        profiler.write()
