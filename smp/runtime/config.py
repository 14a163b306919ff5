"""The ``smp.init`` configuration: SageMaker model parallelism's keys, defaults and checks.

A config comes as a dict, a path to a JSON file, or JSON in the ``SMP_CONFIG`` environment variable; in a
SageMaker job, SMP v1's ``SM_HP_MP_PARAMETERS`` is merged in (:mod:`smp.runtime.sagemaker_env`).
Unknown keys and bad values are errors that list what is valid, because a typo in a training config
should not silently fall back to a default. Keys of SMP v1 that tune that library's own runtime are
accepted; given a value other than their default they warn once that they have no effect here
(:mod:`smp.runtime.compat`).

``timeout_s`` (engine's own key) bounds every wait and collective smp issues; it may also come from the
``SMP_TIMEOUT_S`` environment variable (the config wins), so a launcher can raise it without editing the
script.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeGuard

from partitioner.cost.pipelines import PIPELINE_NAMES, pipeline_of
from partitioner.errors import EngineError
from pipeline.offload import DEFAULT_HORIZON
from pipeline.profiler import ProfileOptions
from pipeline.shape_classes import DEFAULT_SHAPE_CACHE_SIZE
from smp.runtime import sagemaker_env
from smp.runtime.compat import warn_no_effect
from smp.runtime.health_options import DebugOptions, debug_options
from smp.runtime.topology import axis_order

__all__ = ["Config", "ConfigError", "load_config", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "AutoRepartition",
           "DEFAULT_PROFILE_STEPS"]

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "SMP_TIMEOUT_S"


class ConfigError(EngineError, ValueError):
    """A bad ``smp.init`` configuration; the message says which key and what is allowed."""


_OPTIMIZE = ("speed", "memory")


@dataclass(frozen=True)
class Config:
    """A checked ``smp.init`` configuration: SMP v1's keys with their defaults, and ``timeout_s``."""

    pipeline_parallel_degree: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    auto_partition: bool = True
    default_partition: int | None = None
    placement_strategy: str = "cluster"  # or a permutation of "D", "P", "T" (smp.runtime.topology)
    ddp: bool = False
    optimize: str = "speed"
    memory_weight: float | None = None
    active_microbatches: int | None = None
    shard_optimizer_state: bool = False
    offload_activations: bool = False  # with smp.set_activation_checkpointing: what it keeps waits in host memory
    tensor_parallel_degree: int = 1   # carved out of the data-parallel ranks; > 1 needs "ddp": True
    fp16: bool = False                # steps run under float16 autocast, with loss scaling (smp.engine.mixed_precision)
    bf16: bool = False                # steps run under bfloat16 autocast
    delayed_parameter_initialization: bool = False
    sharded_data_parallel_degree: int = 1  # shard each stage's parameters over as many replicas (smp.engine.sharded_dp)
    sdp_reduce_bucket_size: int = int(5e8)
    sdp_param_persistence_threshold: int = int(1e6)  # parameters with fewer elements stay whole on every replica
    sdp_max_live_parameters: int = int(1e9)
    sdp_hierarchical_allgather: bool = True
    sdp_gradient_clipping: float = 1.0  # with sdp: the global gradient norm is clipped to this at each step (0: off)
    timeout_s: float = DEFAULT_TIMEOUT_S  # per wait/collective; from SMP_TIMEOUT_S when the config has none
    prescaled_batch: bool = False     # with tp > 1: a tp group reads one batch (True) or one each (smp.engine.tp_batch)
    # ours: with tp > 1, Megatron's sequence parallelism (partitioner.tp.sequence); None: on where it applies, quietly
    # (True: on, saying where it does not apply; False: off)
    sequence_parallel: bool | None = None
    expert_parallel_degree: int = 1   # ours: experts sharded over as many data-parallel ranks (partitioner.ep)
    context_parallel_degree: int = 1  # ours: each sequence split over as many data-parallel ranks (partitioner.cp)
    activation_loading_horizon: int = DEFAULT_HORIZON  # offloaded activations load this many backwards ahead
    overlapping_allreduce: bool = True  # replicas average in buckets during the backward (smp.engine.grad_averaging)
    # SMP v1 keys accepted for compatibility; they have no effect here (see _NO_EFFECT).
    checkpoint_attentions: bool = False
    skip_tracing: bool = False
    static_mode: bool = False
    fast_mode: bool = False
    fp16_params: bool = False
    _fp32_grad_accumulation: bool = False
    _match_weights: bool = False
    ddp_dist_backend: str = "auto"  # SMP 1.13+: "auto", "nccl" or "smddp" for its data-parallel reduction
    # Profiling and re-partitioning from measurements (smp.profile, smp.profiling.replan).
    profile: dict | None = None           # {"dir": "prof", "steps": [start, stop], "monitor_s": 0.2}: those steps
    partition_file: str | None = None     # partition by this plan (smp replan -o FILE, smp plan --config)
    auto_repartition: dict | None = None  # {"after_steps": N, "min_gain": 0.05, "dir": None}: re-plan in flight
    debug: dict | None = None  # {"rules": [...], "every_n_steps": N, "action": "warn"}: smp.health's rules
    shape_cache_size: int = DEFAULT_SHAPE_CACHE_SIZE  # shape classes whose stages are kept (pipeline.shape_classes)
    tensorboard: str | None = None  # a directory: every step's loss, throughput and memory (pipeline.tensorboard)

    @property
    def schedule(self) -> str:
        """The pipeline package's name for the schedule SMP calls ``pipeline``."""
        return pipeline_of(self.pipeline)

    @property
    def effective_memory_weight(self) -> float:
        """``memory_weight``, or SMP's default for ``optimize``: 0.2 for "speed", 0.8 for "memory"."""
        if self.memory_weight is not None:
            return self.memory_weight
        return 0.2 if self.optimize == "speed" else 0.8

    @property
    def max_in_flight(self) -> int:
        """``active_microbatches``, or SMP's default: partitions + 2."""
        return self.active_microbatches or self.pipeline_parallel_degree + 2

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain dict (every key, defaults included)."""
        return asdict(self)

    @property
    def profile_options(self) -> ProfileOptions | None:
        """The ``profile`` key as :class:`pipeline.profiler.ProfileOptions` (steps 1 .. 10 by default; the system
        monitor every ``monitor_s`` = 0.2 s by default, 0 or None: off)."""
        if self.profile is None:
            return None
        return ProfileOptions(self.profile["dir"], tuple(self.profile.get("steps", DEFAULT_PROFILE_STEPS)),
                              monitor_s=self.profile.get("monitor_s", ProfileOptions.monitor_s))

    @property
    def debug_options(self) -> DebugOptions | None:
        """The ``debug`` key as :class:`smp.runtime.health_options.DebugOptions` (training-health rules)."""
        return debug_options(self.debug)

    @property
    def repartition(self) -> AutoRepartition | None:
        """The ``auto_repartition`` key as :class:`AutoRepartition`."""
        return None if self.auto_repartition is None else AutoRepartition(**self.auto_repartition)


DEFAULT_PROFILE_STEPS = (1, 11)  # step 0 traces and partitions the model: not a typical step


@dataclass(frozen=True)
class AutoRepartition:
    """Re-partition in flight: profile ``after_steps`` steps after the first, re-plan from what they
    measured, and move to the new plan when it predicts a step at least ``min_gain`` faster (``dir``: also
    write that profile there)."""

    after_steps: int
    min_gain: float = 0.05
    dir: str | None = None

    @property
    def steps(self) -> tuple[int, int]:
        """The steps profiled: 1 .. after_steps (step 0 partitions the model)."""
        return (1, 1 + self.after_steps)


# Key -> why it changes nothing here (warned when a config gives it a value other than its default).
_NO_EFFECT = {
    "prescaled_batch": "without tensor parallelism every data-parallel rank reads its own batch already",
    "sequence_parallel": "it slices the regions between tensor-parallel regions, and tensor_parallel_degree 1 has none",
    "checkpoint_attentions": "it checkpoints SMP's tensor-parallel attention; use smp.set_activation_checkpointing",
    "skip_tracing": "the engine always traces the model at the first step, to partition it",
    "static_mode": "every step runs the stage graph traced at the first step",
    "fast_mode": "stages always exchange exactly the tensors that cross them",
    "fp16_params": "parameters keep the dtype the model was created with; use 'fp16' for mixed precision",
    "_fp32_grad_accumulation": "gradients accumulate in the parameters' dtype, fp32 under 'fp16'/'bf16'",
    "_match_weights": "there are no tensor-parallel weights to match",
    "sdp_reduce_bucket_size": "each sharded gradient is reduce-scattered on its own, once per step",
    "sdp_max_live_parameters": "a sharded parameter is gathered where the stage first reads it and freed after its "
                               "last read, so only the parameters of the running op are whole",
    "sdp_hierarchical_allgather": "parameters are gathered over one sharding group, with no node-level stage",
    "ddp_dist_backend": "data-parallel collectives run on smp's process groups (NCCL on CUDA, gloo on the CPU)",
}
_SMP_V1_FLAGS = ("fp16", "bf16", "delayed_parameter_initialization", "prescaled_batch", "checkpoint_attentions",
              "skip_tracing", "static_mode", "fast_mode", "fp16_params", "_fp32_grad_accumulation", "_match_weights",
              "overlapping_allreduce", "shard_optimizer_state", "offload_activations")


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"smp config {key!r}={value!r} is not valid: {allowed}")


def load_config(config: dict | str | os.PathLike | None = None) -> Config:
    """Read and check a config (dict, JSON file path, or ``SMP_CONFIG`` when None); in a file, a relative
    ``partition_file`` is relative to the file's folder. In a SageMaker job the keys
    of ``SM_HP_MP_PARAMETERS`` are merged in, winning, as SMP v1 does (:mod:`smp.runtime.sagemaker_env`); with it,
    no config at all is needed."""
    sagemaker = sagemaker_env.mp_parameters()
    if config is None:
        text = os.environ.get("SMP_CONFIG")
        if not text and sagemaker is None:
            raise ConfigError("smp.init() needs a config: pass a dict or a JSON file path, or set SMP_CONFIG "
                              "to JSON such as '{\"pipeline_parallel_degree\": 2, \"microbatches\": 4}' (or, as "
                              f"in a SageMaker job, {sagemaker_env.MP_PARAMETERS_ENV} to SMP's keys such as "
                              "'{\"partitions\": 2, \"microbatches\": 4}')")
        config = _parse_json(text, "SMP_CONFIG") if text else {}
    elif isinstance(config, (str, os.PathLike)):
        if not os.path.exists(config):
            raise ConfigError(f"smp config file {os.fspath(config)!r} does not exist")
        with open(config) as fh:
            folder, config = os.path.dirname(os.path.abspath(config)), _parse_json(fh.read(), os.fspath(config))
        if isinstance(config, dict) and isinstance(config.get("partition_file"), str):
            # A config file's plan path is relative to the file's folder (smp plan --config writes them together)
            config = {**config, "partition_file": os.path.join(folder, config["partition_file"])}
    if not isinstance(config, dict):
        raise ConfigError(f"smp config must be a dict, got {type(config).__name__}")
    cfg = _unaliased(config)
    if sagemaker is not None:
        cfg = sagemaker_env.merged(cfg, _unaliased(sagemaker))
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(_unknown_keys(unknown, sorted(known | {"partitions"})))
    if "timeout_s" not in cfg and os.environ.get(TIMEOUT_ENV):
        text = os.environ[TIMEOUT_ENV]
        try:
            cfg["timeout_s"] = float(text)
        except ValueError:
            raise ConfigError(f"{TIMEOUT_ENV}={text!r} is not valid: a number of seconds, such as 600") from None
    if "pipeline_parallel_degree" not in cfg:
        raise ConfigError("smp config needs 'pipeline_parallel_degree' (alias 'partitions'): the number of "
                          "pipeline stages")
    c = Config(**cfg)
    _validate(c)
    defaults = {f.name: f.default for f in fields(Config)}
    for key, why in _NO_EFFECT.items():
        if key in ("prescaled_batch", "sequence_parallel") and c.tensor_parallel_degree > 1:
            continue  # they decide which batch a tensor-parallel group reads and how it splits its whole regions
        unchanged = (defaults[key], False) if key == "sequence_parallel" else (defaults[key],)  # off: as without it
        if getattr(c, key) not in unchanged:  # through smp.init, stacklevel 3 is the user's smp.init line
            warn_no_effect(f"smp config {key!r}={getattr(c, key)!r}", why, stacklevel=3)
    return c


def _unknown_keys(unknown: list[str], valid: list[str]) -> str:
    """The message for config keys that are not smp's, one line a console shows whole: each key's likeliest
    meaning first (did you mean), for a key with none a few keys that look like it, then where every key is
    listed (not the keys themselves)."""
    best = {k: difflib.get_close_matches(k, valid, n=1, cutoff=0.7) for k in unknown}
    hints = [f"{k!r}: did you mean {m[0]!r}?" for k, m in best.items() if m]
    near = dict.fromkeys(c for k, m in best.items() if not m
                         for c in difflib.get_close_matches(k, valid, n=3, cutoff=0.5))
    if near:
        hints.append(f"keys like {' or '.join(repr(k) for k, m in best.items() if not m)}: "
                     + ", ".join(map(repr, list(near)[:3])))
    return (f"unknown smp config key(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
            + f"; all {len(valid)} keys: docs/smp_api.md (Setup and config), smp.Config's fields")


def _unaliased(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with SMP's alias ``partitions`` under its name ``pipeline_parallel_degree``."""
    cfg = dict(config)
    if "partitions" in cfg:
        if "pipeline_parallel_degree" in cfg and cfg["pipeline_parallel_degree"] != cfg["partitions"]:
            raise ConfigError(f"'partitions'={cfg['partitions']} and 'pipeline_parallel_degree'="
                              f"{cfg['pipeline_parallel_degree']} disagree; give one of them")
        cfg["pipeline_parallel_degree"] = cfg.pop("partitions")
    return cfg


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"smp config in {where} is not valid JSON: {exc}") from None


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(c: Config) -> None:
    _check(_is_int(c.pipeline_parallel_degree) and c.pipeline_parallel_degree >= 1,
           "pipeline_parallel_degree", c.pipeline_parallel_degree, "a positive integer")
    _check(_is_int(c.microbatches) and c.microbatches >= 1, "microbatches", c.microbatches, "a positive integer")
    _check(c.pipeline in PIPELINE_NAMES, "pipeline", c.pipeline,
           "'interleaved' or '1f1b' (1F1B, backward first), 'simple' or 'gpipe' (GPipe)")
    _check(isinstance(c.auto_partition, bool), "auto_partition", c.auto_partition, "True or False")
    try:
        axis_order(c.placement_strategy)
    except ValueError:
        _check(False, "placement_strategy", c.placement_strategy, "'cluster' (= 'DPT'), 'spread' (= 'TPD') or a "
               "permutation of the letters 'D' (reduced data parallelism), 'P' (pipeline) and 'T' (tensor "
               "parallelism), the right-most varying fastest over consecutive ranks")
    _check(isinstance(c.ddp, bool), "ddp", c.ddp, "True or False")
    _check(c.ddp_dist_backend in ("auto", "nccl", "smddp"), "ddp_dist_backend", c.ddp_dist_backend,
           "'auto', 'nccl' or 'smddp'")
    _check(c.optimize in _OPTIMIZE, "optimize", c.optimize, f"one of {_OPTIMIZE}")
    _check(c.memory_weight is None or (isinstance(c.memory_weight, (int, float)) and 0 <= c.memory_weight <= 1),
           "memory_weight", c.memory_weight, "a number in [0, 1]")
    _check(c.active_microbatches is None or (_is_int(c.active_microbatches) and c.active_microbatches >= 1),
           "active_microbatches", c.active_microbatches, "a positive integer")
    _check(c.sequence_parallel is None or isinstance(c.sequence_parallel, bool), "sequence_parallel",
           c.sequence_parallel, "True, False or None (on where it applies)")
    _check(isinstance(c.timeout_s, (int, float)) and not isinstance(c.timeout_s, bool) and 0 < c.timeout_s < 1e9,
           "timeout_s", c.timeout_s, "a positive number of seconds: how long any one wait or collective of smp "
           "may take before the job stops with an error")
    for key, what in (("expert_parallel_degree", "shards the experts over data-parallel ranks and needs 'ddp': True"),
                      ("context_parallel_degree", "splits each sequence over data-parallel ranks and needs 'ddp': "
                                                  "True"),
                      ("tensor_parallel_degree", "needs 'ddp': True, as in SMP v1 (tensor parallelism is carved out of "
                                                 "the data-parallel ranks)")):
        degree = getattr(c, key)
        _check(_is_int(degree) and degree >= 1, key, degree, "a positive integer")
        _check(degree == 1 or c.ddp is True, key, degree,
               f"a degree above 1 {what}; add \"ddp\": True to the smp config")
    _check(c.expert_parallel_degree == 1 or (c.sharded_data_parallel_degree == 1 and not c.shard_optimizer_state),
           "expert_parallel_degree", c.expert_parallel_degree, "1 with sharded_data_parallel_degree above 1 or "
           "shard_optimizer_state (experts are split over replicas that hold their parameters and optimizer state "
           "whole, for now)")
    cp = c.context_parallel_degree
    _check(cp == 1 or (c.sharded_data_parallel_degree == 1 and c.expert_parallel_degree == 1),
           "context_parallel_degree", cp,
           "1 with sharded_data_parallel_degree or expert_parallel_degree above 1 (not combined yet)")
    _check(cp == 1 or c.sequence_parallel is not True, "sequence_parallel", c.sequence_parallel,
           "None or False with context_parallel_degree above 1 (the sequence is already split across the cp group)")
    for key in _SMP_V1_FLAGS:
        _check(isinstance(getattr(c, key), bool), key, getattr(c, key), "True or False")
    _check(_is_int(c.sharded_data_parallel_degree) and c.sharded_data_parallel_degree >= 1,
           "sharded_data_parallel_degree", c.sharded_data_parallel_degree, "a positive integer")
    sdp = c.sharded_data_parallel_degree
    _check(sdp == 1 or c.ddp is True, "sharded_data_parallel_degree", sdp, "a degree above 1 needs 'ddp': True "
           "(the parameters are sharded over data-parallel replicas); add \"ddp\": True to the smp config")
    _check(sdp == 1 or not c.shard_optimizer_state, "shard_optimizer_state", c.shard_optimizer_state,
           "not together with sharded_data_parallel_degree > 1, as in SMP v1: sharded data parallelism shards the "
           "optimizer state already; remove 'shard_optimizer_state'")
    _check(sdp == 1 or c.auto_repartition is None, "auto_repartition", c.auto_repartition,
           "not together with sharded_data_parallel_degree > 1 (sharded parameters cannot move between stages); "
           "turn one of them off")
    for key in ("sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters"):
        _check(isinstance(getattr(c, key), (int, float)) and not isinstance(getattr(c, key), bool)
               and getattr(c, key) >= 0, key, getattr(c, key), "a number of elements >= 0")
    _check(isinstance(c.sdp_hierarchical_allgather, bool), "sdp_hierarchical_allgather", c.sdp_hierarchical_allgather,
           "True or False")
    _check(isinstance(c.sdp_gradient_clipping, (int, float)) and not isinstance(c.sdp_gradient_clipping, bool)
           and c.sdp_gradient_clipping >= 0, "sdp_gradient_clipping", c.sdp_gradient_clipping,
           "a norm >= 0 (0 turns clipping off)")
    _check(not (c.fp16 and c.bf16), "fp16", c.fp16, "not together with 'bf16': True; choose one of them")
    _check(_is_int(c.activation_loading_horizon) and c.activation_loading_horizon >= 1,
           "activation_loading_horizon", c.activation_loading_horizon, "a positive integer")
    _check(_is_int(c.shape_cache_size) and c.shape_cache_size >= 1, "shape_cache_size", c.shape_cache_size,
           "a positive integer: how many input shape classes (batch size, sequence length) keep their stages")
    _check(c.tensorboard is None or (isinstance(c.tensorboard, str) and bool(c.tensorboard)), "tensorboard",
           c.tensorboard, "the directory to write TensorBoard logs to (needs the tensorboard package), or None")
    _validate_profiling(c)
    try:
        _ = c.debug_options  # built (and checked) by smp.runtime.health_options
    except ValueError as exc:
        raise ConfigError(f"smp config 'debug' is not valid: {exc}") from None
    if c.auto_partition:
        _check(c.default_partition is None or (_is_int(c.default_partition) and
                                               0 <= c.default_partition < c.pipeline_parallel_degree),
               "default_partition", c.default_partition, f"an integer in [0, {c.pipeline_parallel_degree})")
    else:
        _check(_is_int(c.default_partition) and 0 <= c.default_partition < c.pipeline_parallel_degree,
               "default_partition", c.default_partition,
               f"required when auto_partition is False: an integer in [0, {c.pipeline_parallel_degree})")


def _keys(value: Any, key: str, allowed: tuple[str, ...], required: tuple[str, ...], example: str) -> None:
    _check(isinstance(value, dict) and set(required) <= set(value) and set(value) <= set(allowed), key, value,
           f"a dict with keys {list(allowed)} ({', '.join(required)} required), such as {example}")


def _validate_profiling(c: Config) -> None:
    """The ``profile``, ``partition_file`` and ``auto_repartition`` keys, and how they combine."""
    if c.profile is not None:
        _keys(c.profile, "profile", ("dir", "steps", "monitor_s"), ("dir",),
              '{"dir": "prof", "steps": [10, 20], "monitor_s": 0.2}')
        _check(isinstance(c.profile["dir"], str) and bool(c.profile["dir"]), "profile", c.profile,
               "'dir' must be a directory name (a non-empty string)")
        try:
            _ = c.profile_options  # built (and checked) by pipeline.profiler.ProfileOptions
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"smp config 'profile'={c.profile!r} is not valid: {exc}") from None
    _check(c.partition_file is None or (isinstance(c.partition_file, str) and os.path.isfile(c.partition_file)),
           "partition_file", c.partition_file, "the path of an existing plan file (written by `smp replan -o FILE` "
           "or PartitionPlan.to_json(FILE))")
    if c.auto_repartition is None:
        return
    auto = c.auto_repartition
    _keys(auto, "auto_repartition", ("after_steps", "min_gain", "dir"), ("after_steps",), '{"after_steps": 10}')
    _check(_is_int(auto["after_steps"]) and auto["after_steps"] >= 1, "auto_repartition", auto,
           "'after_steps' must be a positive integer: the steps to profile before re-planning")
    gain = auto.get("min_gain", 0.05)
    _check(isinstance(gain, (int, float)) and not isinstance(gain, bool) and gain >= 0, "auto_repartition", auto,
           "'min_gain' must be a number >= 0: the predicted speed-up (0.05 = 5%) worth moving for")
    _check(auto.get("dir") is None or isinstance(auto["dir"], str), "auto_repartition", auto,
           "'dir' must be a directory name or None")
    _check(not c.shard_optimizer_state, "auto_repartition", auto, "not together with 'shard_optimizer_state': "
           "True (a sharded optimizer state cannot move between stages); turn one of them off")
    assert c.repartition is not None and c.repartition.steps is not None  # auto_repartition is set
    window = c.repartition.steps
    options = c.profile_options
    _check(options is None or options.steps is None or options.steps[0] >= window[1], "profile", c.profile,
           f"its steps must start at {window[1]} or later: auto_repartition profiles steps {window[0]} .. "
           f"{window[1] - 1}")
