"""Training-health rules while training runs (the module behind ``smp.debug`` and the config's ``"debug"`` key):
SageMaker Debugger's built-in rules, evaluated in flight instead of by a processing job afterwards.

Every ``@smp.step`` call (:func:`smp.engine.execution.run_step`) calls :meth:`Session.before` and
:meth:`Session.after`. On a check step (every ``every_n_steps``-th training step) the rank's stages run with
activation taps (:mod:`smp.health.activations`); after the step each rank measures what it holds
(:mod:`smp.health.statistics`); at the start of the next step one ``all_gather_object`` of those floats over smp's
world group (bounded by ``timeout_s``) gives every rank every rank's statistics, and every rank evaluates the rules
(:mod:`smp.health.rules`) to the same findings. Rank 0 reports them (a :class:`TrainingHealthWarning`, once per rule
and tensor); with ``"action": "stop"`` every rank prints the reason, writes it to the file ``SMP_HEALTH_STOP_FILE``
names (``smp launch`` sets it and then does not restart the job) and leaves the step with
:class:`TrainingStopped`, a ``SystemExit`` whose status is :data:`STOP_EXIT_STATUS`: between steps, before any
collective of that step (the optimizer step after the fault has run). The optimizer step after a check step is
measured for ``WeightUpdateRatio``
(:meth:`Session.around_update`). ``smp.debug.log(name, value)`` records a value (``"eval_loss"`` for ``Overfit``)
sent with the next check.

When no rule is configured, a step costs one attribute lookup more.
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch.distributed as dist

from pipeline.p2p import named_failures
from smp.health.activations import ActivationTaps, layer_paths
from smp.health.rules import Finding, HealthRules, aggregate
from smp.health.statistics import RankStatistics, UpdateProbe, measure
from smp.runtime import state
from smp.runtime.health_options import STOP_EXIT_STATUS, STOP_FILE_ENV, DebugOptions, debug_options

# One check in WEIGHT_CHECKS also reads every weight's norm (ExplodingTensor's weight check): the others rely on the
# gradients and the loss, through which a bad weight shows first, and save a pass over the weights.
WEIGHT_CHECKS = 10

__all__ = ["Session", "session_of", "debug", "Debug", "TrainingStopped", "TrainingHealthWarning",
           "STOP_EXIT_STATUS"]


class TrainingHealthWarning(UserWarning):
    """A training-health rule fired (``"action": "warn"``)."""


class TrainingStopped(SystemExit):
    """A training-health rule fired with ``"action": "stop"``: every rank leaves the step with this, and the
    process exits with :data:`STOP_EXIT_STATUS` unless the script catches it."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(STOP_EXIT_STATUS)
        self.finding = finding

    def __str__(self) -> str:
        return f"smp.debug stopped the job: {self.finding.message()}"


class Session:
    """This process's training-health checks: options, steps seen, taps, what the rules found."""

    def __init__(self, options: DebugOptions | None) -> None:
        self.options = options
        self.rules = HealthRules(options) if options is not None else None
        self.steps = 0                      # training steps seen (checks count these)
        self.checks = 0                     # checks made
        self.findings: list[Finding] = []   # every finding, in order (each rank has the same)
        self.logged: dict[str, float] = {}  # smp.debug.log values waiting for the next check
        self.probe = UpdateProbe()
        self.taps: dict[bool, ActivationTaps] = {}  # every layer's output too? -> this rank's tapped stages
        self.tapping: ActivationTaps | None = None  # the taps of the step running now
        self.taps_of: Any = None  # the runner whose stages the taps copy
        self.checking = False               # the step running now is a check step
        self.measure_update = False         # the next optimizer step follows a check step
        self.reported: set[tuple[str, str]] = set()
        self.named: tuple[Any, list[tuple[str, Any]]] | None = None  # (the runner, its local parameters)
        self.pending: tuple[int, RankStatistics] | None = None  # the last check's step and statistics, not judged

    def before(self, st: state.State, model: Any, train: bool) -> None:
        """Before a step: judge the last check's statistics (:meth:`judge`, which may stop the job); on a check
        step, record the activations the configured rules read in this rank's
        stages: every layer's output while ``PoorWeightInitialization`` watches the first steps, else only the
        values crossing stages (``ExplodingTensor``); none for the other rules. A variance per layer output costs
        a pass over each activation, a fifth of a small model's step: only the start of training pays it."""
        self.judge(st)
        options = self.options
        self.checking = options is not None and train and self.steps % options.every_n_steps == 0
        if not self.checking:
            return
        assert options is not None  # checking
        init = options.rules.get("PoorWeightInitialization")
        layers = init is not None and self.steps < init["steps"]
        if not layers and "ExplodingTensor" not in options.rules:
            return
        if model.partitioned:
            self.start_taps(model, layers)
        else:  # the first step partitions: tap the stages once they exist, before they run
            model.register_post_partition_hook(lambda m, _: self.start_taps(m, layers))

    def start_taps(self, model: Any, layers: bool) -> None:
        """Build the tapped stage copies (once per kind: with every layer's output, or only what crosses stages)
        and run them for this step."""
        if self.taps_of is not model.runner:  # re-partitioned: the old stages no longer run
            self.taps, self.taps_of = {}, model.runner
        if layers not in self.taps:
            paths = layer_paths(self.local_parameters(model)) if layers else set()
            self.taps[layers] = ActivationTaps(model.runner.local_stages, paths)
        self.tapping = self.taps[layers]
        self.tapping.start()

    def after(self, st: state.State, model: Any, run: Any, train: bool, ok: bool) -> None:
        """After a step: on a check step that ran, measure what this rank holds (before the optimizer step and
        ``zero_grad`` change it); the next step's :meth:`before` judges it."""
        taps, self.tapping = self.tapping, None
        if taps is not None:
            taps.stop()
        if not train:
            return
        self.steps += 1
        if not (self.checking and ok):
            return
        assert self.rules is not None and self.options is not None  # checking needs them
        stats = measure(st.rank, st.topology.pp_rank(st.rank), self.local_parameters(model), run.losses(),
                        taps.variances() if taps is not None else [], self.probe.take(), st.device,
                        weights=self.checks % WEIGHT_CHECKS == 0)
        stats.logged, self.logged = self.logged, {}
        self.pending = (self.steps - 1, stats)
        ratio = self.options.rules.get("WeightUpdateRatio")
        self.checks += 1
        self.measure_update = ratio is not None and (self.checks - 1) % int(ratio["every"]) == 0

    def judge(self, st: state.State) -> None:
        """Gather the last check's statistics from every rank, evaluate the rules and act: at the start of the
        next step (or the end of an ``smp.debug`` block), where the ranks meet anyway, not right after the
        step, where the gather would make the rank that finished first wait before its optimizer step (a few %
        of a step). A finding stops the job one step later than it could: before the step after the fault."""
        if self.pending is None:
            return
        assert self.rules is not None  # a check ran
        step, stats = self.pending
        self.pending = None
        found = self.rules.evaluate(step, aggregate(_gather(st, stats)))
        self.findings += found
        self.act(st, found)

    def act(self, st: state.State, found: list[Finding]) -> None:
        """Report ``found`` (rank 0, once per rule and tensor); stop every rank when the action is "stop"."""
        assert self.options is not None  # findings come from configured rules
        if not found:
            return
        if self.options.action == "stop":
            first = found[0]
            print(f"smp.debug: rank {st.rank}: stopping the job (exit status {STOP_EXIT_STATUS}): {first.message()}",
                  file=sys.stderr, flush=True)
            path = os.environ.get(STOP_FILE_ENV)
            if path:
                with open(path, "w") as fh:
                    fh.write(first.message() + "\n")
            raise TrainingStopped(first)
        for f in found:
            if st.rank == 0 and (f.rule, f.tensor) not in self.reported:
                self.reported.add((f.rule, f.tensor))
                warnings.warn(f"smp.debug: {f.message()}", TrainingHealthWarning, stacklevel=4)

    def around_update(self, model: Any, device: Any) -> Any:
        """The context ``DistributedOptimizer.step`` runs the update of ``model``'s parameters in: measured after a
        check step that asks for it, nothing otherwise (not even a look at the parameters)."""
        if not self.measure_update or model is None or not model.partitioned:
            return nullcontext()
        self.measure_update = False
        return self.probe.around_step(self.local_parameters(model), device)

    def local_parameters(self, model: Any) -> list[tuple[str, Any]]:
        """``model``'s (name, parameter) pairs on this rank, found once per partition (finding them walks the
        model and the plan: a millisecond a step on a small model)."""
        if self.named is None or self.named[0] is not model.runner:
            self.named = (model.runner, list(model.local_named_parameters()))
        return self.named[1]


def _gather(st: state.State, stats: RankStatistics) -> list[RankStatistics]:
    """Every rank's statistics on every rank: one small all-gather on smp's world group."""
    call = "smp.debug check"
    st.calls["world"].announce(call)
    out: list[Any] = [None] * st.topology.world
    peers = [r for r in range(st.topology.world) if r != st.rank]
    try:
        with named_failures(call, peers, st.rank, st.config.timeout_s):
            dist.all_gather_object(out, stats, group=st.group("world"))
    except BaseException as exc:
        st.report_failure(exc)
        raise
    return out


def session_of(st: state.State) -> Session:
    """The training-health session of the process ``st`` describes (from the config's ``"debug"``), made on
    first use."""
    if st.health is None:
        st.health = Session(st.config.debug_options)
    return st.health


class Debug:
    """``smp.debug``: ``with smp.debug(rules=[...], every_n_steps=1, action="warn"):`` checks the rules on the
    steps inside the block (replacing the config's ``"debug"`` there); ``smp.debug.log(name, value)`` records a
    value, such as ``"eval_loss"`` for the ``Overfit`` rule."""

    @contextmanager
    def __call__(self, rules: list[Any] | None = None, every_n_steps: int = 1,
                 action: str = "warn") -> Iterator[Session]:
        """Check ``rules`` (names or dicts with thresholds; default: all six) inside the block; yields the session,
        whose ``findings`` list what fired."""
        given: dict[str, Any] = {"every_n_steps": every_n_steps, "action": action}
        if rules is not None:
            given["rules"] = rules
        try:
            options = debug_options(given)
        except ValueError as exc:
            raise ValueError(f"smp.debug: {exc}") from None
        st = state.get()
        previous = session_of(st)
        st.health = Session(options)
        st.health.steps = previous.steps
        try:
            yield st.health
            st.health.judge(st)  # the block's last check (every rank leaves the block here; not after an error)
        finally:
            previous.steps = st.health.steps
            st.health = previous

    def log(self, name: str, value: float) -> None:
        """Record ``value`` (a number or a one-element tensor) under ``name`` for the next check; the ``Overfit``
        rule reads ``"eval_loss"``. Ranks that log the same name are averaged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"smp.debug.log: name {name!r} must be a non-empty string, such as 'eval_loss'")
        session_of(state.get()).logged[name] = float(value)


debug = Debug()
