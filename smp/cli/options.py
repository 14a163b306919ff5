"""The arguments of the ``smp`` commands, and the one :class:`Options` object a plan request becomes.

The partitioner's options are not copied here: the arguments that set them are named after the fields of
:class:`partitioner.PartitionOptions` and left out of the namespace unless given, so :meth:`Options.from_args`
hands them over unchanged and the partitioner applies its own defaults and checks. ``--pipeline`` takes
SMP's names and ours (:data:`partitioner.cost.pipelines.PIPELINE_NAMES`). Argument types only read text, with
:mod:`partitioner.units` for sizes and durations; nothing here imports torch until a command runs.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from partitioner.cost.devices import DEVICES, LINKS, PRECISIONS
from partitioner.units import UNLIMITED, parse_duration, parse_size
from smp.cli.errors import CLIError
from smp.cli.limits import DEFAULT_MAX_ACTIONS

__all__ = ["Options", "times_ops", "Parser", "add_target_args", "add_plan_args", "positive_int", "size", "duration",
           "budget", "memory_headroom", "check_output", "RANKS_PER_NODE"]

RANKS_PER_NODE = 8  # devices per node unless told (`smp simulate --ranks-per-node`): a p4d/p5 instance's GPUs


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that point at the right ``--help``, values such as ``-1GB``, and the names
    of its options and commands kept for suggestions (``--partitons``: did you mean ``--partitions``?)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.option_names: list[str] = []
        self.commands: dict[str, Parser] = {}
        self.arguments: list[str] = []
        super().__init__(*args, **kwargs)
        # argparse takes any token that starts with '-' for an option unless it is a plain negative number,
        # so `--device-memory -1GB` would lose its value; none of our options starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """argparse's ``add_argument``, remembering the option's names."""
        action = super().add_argument(*args, **kwargs)
        self.option_names.extend(action.option_strings)
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        """argparse's ``add_subparsers``; the commands added to it are kept in :attr:`commands`."""
        sub = super().add_subparsers(**kwargs)
        self.commands = sub.choices
        return sub

    def suggest(self, token: str) -> str:
        """`` (did you mean --x?)`` for an unknown option or command ``token`` close to one of ours, else ``""``."""
        names = self.option_names if token.startswith("-") else list(self.commands)
        close = difflib.get_close_matches(token.split("=", 1)[0], names, n=1, cutoff=0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's ``parse_known_args``, keeping the arguments for :meth:`error`'s suggestions."""
        self.arguments = list(args) if args is not None else []
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise the parse error as a CLIError instead of printing usage and exiting; a misspelt option or command
        among the arguments gets a suggestion."""
        choice = re.search(r"invalid choice: '([^']*)'", message)
        unknown = [a for a in self.arguments if a.startswith("--") and a.split("=", 1)[0] not in self.option_names]
        hint = self.suggest(choice.group(1)) if choice else self.suggest(unknown[0]) if unknown else ""
        raise CLIError(f"{message}{hint} (see '{self.prog} --help')")


def _typed(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type whose ValueError message is shown as is (argparse would replace it)."""
    @functools.wraps(convert)
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _positive_int(text: str) -> int:
    """``"4"`` or ``"3e7"`` -> the integer; zero, negative, fractional and non-finite text is an error."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{text!r} is not an integer") from None
        value = int(number)
    if value < 1:
        raise ValueError(f"{text!r} must be a positive integer")
    return value


def _weight(text: str) -> float:
    """``"0.2"`` -> 0.2; anything outside [0, 1] (NaN included) is an error."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text!r} must be between 0 and 1")
    return value


def _budget(text: str) -> float | str:
    """``"16GiB"`` -> bytes; ``"unlimited"`` -> no budget at all (not even the device's memory)."""
    if text.strip().lower() == UNLIMITED:
        return UNLIMITED
    size = parse_size(text)
    assert size is not None  # parse_size gives None only for None
    return size


def _headroom(text: str) -> Any:
    """``"10%"``, ``"0.1"``, ``"8GiB"`` -> a :class:`partitioner.layout.headroom.Headroom` (read when a command runs:
    the layout planner imports torch)."""
    from partitioner.layout.headroom import parse_headroom

    return parse_headroom(text)


positive_int = _typed(_positive_int)
memory_headroom = _typed(_headroom)
size = _typed(parse_size)
budget = _typed(_budget)
duration = _typed(parse_duration)
memory_weight = _typed(_weight)


def add_target_args(p: argparse.ArgumentParser) -> None:
    """TARGET and how to build a zoo model."""
    p.add_argument("target", metavar="TARGET",
                   help="zoo:NAME (gpt2, bert, vit, resnet, t5, mlp, unet, inception) or path/to/file.py:factory, "
                        "a function returning (model, example_args) or (model, args, kwargs); the example inputs "
                        "are one microbatch")
    p.add_argument("--size", choices=("small", "base"), default="small", help="zoo model size (default small)")
    p.add_argument("--batch", type=positive_int, default=4, help="zoo microbatch size (default 4)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")


def add_plan_args(p: argparse.ArgumentParser, *, microbatches_required: bool = False) -> None:
    """The plan request; the partitioner's options are absent from the namespace unless given."""
    keep = argparse.SUPPRESS
    p.add_argument("--partitions", "-p", type=positive_int, required=True, help="pipeline stages")
    p.add_argument("--microbatches", "-m", type=positive_int, required=microbatches_required, default=keep,
                   help="microbatches per step" + ("" if microbatches_required else " (default 1)"))
    p.add_argument("--pipeline", dest="smp_pipeline", metavar="NAME", default="interleaved",
                   help="interleaved or 1f1b = 1F1B (default), simple or gpipe = GPipe (SMP's names and ours)")
    p.add_argument("--method", metavar="NAME", default=keep,
                   help="partitioner: auto (default, the best of dp and metis), dp or metis")
    p.add_argument("--memory-weight", type=memory_weight, default=keep,
                   help="0..1, how much memory balance counts next to time (SMP's memory_weight, default 0.2)")
    p.add_argument("--device", metavar="NAME", choices=DEVICES, default=keep,
                   help=f"the device the stages will run on, priced from its profile: {', '.join(DEVICES)} "
                        "(default cpu: this machine, measured)")
    p.add_argument("--dtype", metavar="NAME", choices=PRECISIONS, default=keep,
                   help=f"training precision: {', '.join(PRECISIONS)} (default fp32; bf16 and fp16 are mixed "
                        "precision: 16-bit activations, weights and gradients, fp32 master weights and "
                        "optimizer state)")
    p.add_argument("--link", metavar="NAME", choices=sorted(LINKS), default=keep,
                   help=f"link between stages within a node: {', '.join(sorted(LINKS))} (default: the "
                        "device's, e.g. nvlink4 for an H100; loopback for cpu)")
    p.add_argument("--inter-node-link", metavar="NAME", choices=sorted(LINKS), default=keep,
                   help="link between nodes, one of the --link names (default: the device's, e.g. "
                        "infiniband-ndr for an H100; ethernet-10g for cpu)")
    p.add_argument("--device-memory", metavar="SIZE", type=budget, default=keep,
                   help="per-device memory budget, e.g. 16GiB or 512MB, or unlimited (default: the device's "
                        "memory; no limit on cpu)")
    p.add_argument("--optimizer", metavar="NAME", default=keep,
                   help="optimizer whose state counts in memory: adam (default), adamw, sgd or none")
    p.add_argument("--tp", "--tensor-parallel-degree", dest="tp", metavar="T", type=positive_int, default=1,
                   help="tensor-parallel degree: split each transformer block's matmuls, the embedding and the LM "
                        "head over T ranks of a node (Megatron's pattern; what cannot be split stays whole, with a "
                        "warning), plan tp rank 0's shards and price the tp all-reduces on --link (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: Megatron's sequence parallelism, the norms, residual adds and dropout between the "
                        "tp regions run on 1/T of the sequence (activations and their compute 1/T per rank; the "
                        "all-reduces become reduce-scatter/all-gather pairs); config key sequence_parallel")
    p.add_argument("--ep", "--expert-parallel-degree", dest="ep", metavar="E", type=positive_int, default=1,
                   help="expert-parallel degree: split every mixture-of-experts layer's experts over E data-parallel "
                        "ranks (tokens routed to them by all-to-all), plan ep rank 0's experts and price the "
                        "all-to-alls on --link (default 1); config key expert_parallel_degree")
    p.add_argument("--cp", "--context-parallel-degree", dest="cp", metavar="C", type=positive_int, default=1,
                   help="context-parallel degree: split every sequence over C data-parallel ranks (attention reads "
                        "the group's gathered keys and values), plan cp rank 0's half of the tokens and price the "
                        "gathers on --link (default 1); config key context_parallel_degree")
    p.add_argument("--sdp", "--sharded-data-parallel-degree", dest="sdp", metavar="D", type=positive_int, default=1,
                   help="sharded data-parallel degree: each stage's parameters sharded over D replicas (ZeRO-3, "
                        "SMP's sharded_data_parallel_degree): memory per rank with weights, gradients at rest and "
                        "optimizer state / D plus the gathered layers, and the all-gathers and reduce-scatters "
                        "priced (default 1: no sharding)")
    p.add_argument("--sdp-threshold", "--sdp-param-persistence-threshold", dest="sdp_threshold", metavar="N",
                   type=positive_int, default=keep,
                   help="with --sdp: parameters of fewer than N elements stay whole on every replica (SMP's "
                        "sdp_param_persistence_threshold, default 1000000)")
    p.add_argument("--estimate", action="store_true",
                   help="price the ops with the cost model's roofline also on --device cpu, where by default each "
                        "op's forward and backward is timed on this machine (what the ranks will pay)")
    p.add_argument("--max-actions", type=positive_int, default=DEFAULT_MAX_ACTIONS,
                   help=f"refuse to simulate more schedule actions (stages x microbatches x passes, all schedules "
                        f"together) than this (default {DEFAULT_MAX_ACTIONS:.0e}, a few minutes and GB)")


def check_output(path: str | None, flag: str, exts: Sequence[str]) -> None:
    """Check an output file's extension and folder before any work is done."""
    if path is None:
        return
    ext = os.path.splitext(path)[1].lower()
    if ext not in exts:
        raise CLIError(f"{flag} {path!r}: the file name must end in {' or '.join(exts)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CLIError(f"{flag} {path!r}: folder {folder!r} does not exist")


def times_ops(device: str, dtype: str, estimate: bool) -> bool:
    """Whether a command prices the ops by timing them here: on this machine's CPU (``--device cpu``) in fp32, unless
    ``--estimate`` (:mod:`partitioner.cost.op_times`; the cost model's roofline otherwise)."""
    return device == "cpu" and dtype == "fp32" and not estimate


@dataclass(frozen=True, init=False)
class Options:
    """A plan request: ``partitions`` stages under ``partition``, the :class:`partitioner.PartitionOptions`
    (microbatches and schedule included), for the pipeline SMP calls ``pipeline``; ``measure_stages`` also
    times each stage for real; ``max_actions`` bounds the simulation; ``tp``: the tensor-parallel degree
    (:mod:`smp.cli.tensor_parallel`); ``ep``: the expert-parallel degree (:mod:`smp.cli.expert_parallel`); ``cp``:
    the context-parallel degree (:mod:`smp.cli.context_parallel`); ``sdp``:
    the sharded data-parallel degree, ``sdp_threshold`` the elements
    below which a parameter stays whole (None: :data:`partitioner.sdp.shards.PERSISTENCE_THRESHOLD`;
    :mod:`smp.cli.sharded_dp`, :meth:`sharding`).

    ``Options(4, microbatches=8, memory_weight=0)``: keywords other than these go to PartitionOptions."""

    partitions: int
    partition: Any
    pipeline: str
    measure_stages: bool
    max_actions: int
    tp: int
    sdp: int
    sdp_threshold: int | None
    ep: int
    cp: int

    def __init__(self, partitions: int, pipeline: str = "interleaved", *, measure_stages: bool = False,
                 max_actions: int = DEFAULT_MAX_ACTIONS, tp: int = 1, sdp: int = 1, sdp_threshold: int | None = None,
                 ep: int = 1, cp: int = 1, **partition: Any) -> None:
        from partitioner.cut.options import PartitionOptions

        for flag, degree, what in (("--tp", tp, "tensor"), ("--sdp", sdp, "sharded data"), ("--ep", ep, "expert"),
                                   ("--cp", cp, "context")):
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise CLIError(f"{flag} {degree!r}: the {what}-parallel degree must be a positive integer (1: no "
                               f"{what} parallelism)")
        for flag, degree in (("--tp", tp), ("--sdp", sdp), ("--ep", ep), ("--cp", cp)):
            if degree > 1 and measure_stages:
                raise CLIError(f"--measure times the stages in this process, but {flag} {degree} stages run "
                               f"collectives between ranks; measure with {flag} 1, or run the job and use smp report")
        if cp > 1 and max(sdp, ep) > 1:
            raise CLIError(f"--cp {cp} with {'--sdp ' + str(sdp) if sdp > 1 else '--ep ' + str(ep)}: context "
                           "parallelism is not combined with sharded data or expert parallelism yet (the runtime "
                           "refuses context_parallel_degree with them); drop one")
        if sdp_threshold is not None and (isinstance(sdp_threshold, bool) or not isinstance(sdp_threshold, int)
                                          or sdp_threshold < 1):
            raise CLIError(f"--sdp-threshold {sdp_threshold!r}: give a positive number of elements")
        try:
            options = PartitionOptions.of(pipeline=pipeline, **partition)
        except (TypeError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        for name, value in (("partitions", partitions), ("partition", options), ("pipeline", pipeline),
                            ("measure_stages", measure_stages), ("max_actions", max_actions), ("tp", tp),
                            ("sdp", sdp), ("sdp_threshold", sdp_threshold), ("ep", ep), ("cp", cp)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "Options":
        """The options of a parsed command line (arguments named after PartitionOptions fields pass through)."""
        from partitioner.cut.options import PartitionOptions

        given = {f.name: getattr(ns, f.name) for f in fields(PartitionOptions) if hasattr(ns, f.name)}
        # Timed only where one tensor- and sdp-rank's graph runs in this process.
        given.setdefault("measure", hasattr(ns, "estimate") and times_ops(given.get("device", "cpu"),
                                                                           given.get("dtype", "fp32"), ns.estimate)
                         and all(getattr(ns, axis, 1) == 1 for axis in ("tp", "sdp", "ep", "cp")))
        return cls(ns.partitions, ns.smp_pipeline, measure_stages=getattr(ns, "measure_stages", False),
                   max_actions=getattr(ns, "max_actions", DEFAULT_MAX_ACTIONS), tp=getattr(ns, "tp", 1),
                   sdp=getattr(ns, "sdp", 1), sdp_threshold=getattr(ns, "sdp_threshold", None),
                   ep=getattr(ns, "ep", 1), cp=getattr(ns, "cp", 1), **given)

    def with_partition(self, **changes: Any) -> "Options":
        """These options with ``changes`` to the partitioner's (:class:`partitioner.PartitionOptions` fields)."""
        from partitioner.cut.options import PartitionOptions

        other = copy.copy(self)
        object.__setattr__(other, "partition", PartitionOptions.of(self.partition, **changes))
        return other

    def sharding(self, link: Any = None) -> Any:
        """``--sdp`` and ``--sdp-threshold`` as a :class:`partitioner.sdp.group.ShardingGroup` whose collectives run on
        ``link`` (:func:`partitioner.sdp.group.group_link`; None: the plan's link within a node)."""
        from partitioner.sdp.group import ShardingGroup
        from partitioner.sdp.shards import PERSISTENCE_THRESHOLD

        return ShardingGroup(self.sdp, self.sdp_threshold or PERSISTENCE_THRESHOLD, link)

    @property
    def microbatches(self) -> int:
        """Microbatches per step."""
        return self.partition.microbatches

    @property
    def schedule(self) -> str:
        """The schedule's name in :mod:`pipeline.schedule` (``1f1b`` or ``gpipe``)."""
        return self.partition.pipeline
