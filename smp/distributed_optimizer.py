"""``smp.DistributedOptimizer``: any torch optimizer over a DistributedModel's parameters.

Each rank's stages fill ``.grad`` only for the parameters they hold, and torch optimizers skip
parameters whose gradient is None, so the wrapped optimizer steps exactly the local parameters and
keeps state for those only. ``state_dict()`` gathers every stage's state into the full dict;
``local_state_dict()`` is this rank's part. With ``shard_optimizer_state`` the local parameters are
handed to torch's ``ZeroRedundancyOptimizer`` over the reduced-data-parallel group instead (the replicas of
this rank's stage and tensor-parallel shard: the data-parallel group mixes different tp ranks' shards).

Under tensor parallelism the state of a sharded parameter is this tp rank's shard of it: ``local_state_dict()``
holds it (marked with the tp degree and rank, :data:`~smp.checkpoint.state_dicts.TP_KEY`), ``state_dict()``
puts the tp ranks' shards together into whole tensors, and a full dict's whole tensors are cut to this rank's
shards on load (:mod:`smp.checkpoint.tp_state`).

With ``"fp16": True`` in the config the optimizer holds SMP's loss scaler (:mod:`smp.engine.mixed_precision`), built
from the ``static_loss_scale`` / ``dynamic_loss_scale`` / ``dynamic_loss_args`` arguments: ``step()`` unscales
the gradients, skips the update on every rank when one overflowed (``overflow`` says so) and adjusts the
scale, and ``clip_master_grads`` clips by the norm of the whole model's gradient.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist

from pipeline.p2p import named_failures
from smp.checkpoint.commit import CheckpointError
from smp.checkpoint.expert_state import EP_KEY, check_experts, cut_rows, gather_rows
from smp.checkpoint.sdp_state import check_shards, marker, optimizer_shards, optimizer_whole, shard_state
from smp.checkpoint.state_dicts import SCALER_KEY, SDP_KEY, SHARD_KEY, TP_KEY, ZERO_KEY, on_cpu
from smp.checkpoint.tp_state import ShardedParam, TPLayout, check_partial, cut_optimizer_state, whole_optimizer_state
from smp.engine import gradnorm
from smp.engine import mixed_precision as precision
from smp.engine.optimizer_step import step_in_chunks
from smp.foreign_optimizer import foreign_optimizer
from smp.health import session as health
from smp.profiling import session as profiling
from smp.runtime import state

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch ``Optimizer`` (so lr schedulers accept it) that delegates to the optimizer it wraps; it never
    calls ``Optimizer.__init__``, so ``param_groups``, ``state`` and ``defaults`` are the wrapped one's."""

    def __new__(cls, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """A torch optimizer is wrapped by this class; another optimizer object (SMP's fp16 optimizer wrappers) is
        returned with SMP's state-dict methods (:func:`smp.foreign_optimizer.foreign_optimizer`)."""
        if isinstance(optimizer, torch.optim.Optimizer):
            return super().__new__(cls)
        return foreign_optimizer(optimizer, *args, **kwargs)

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 **more_dynamic_loss_args: Any):
        """``dynamic_loss_args`` (``init_scale``, ``scale_factor``, ``scale_window``, ``min_scale``,
        ``delayed_shift``, ``consecutive_hysteresis``) may also come as keyword arguments, as SMP allows."""
        self.optimizer = optimizer
        self._zero: Any = None
        st = state.get()
        self.loss_scaler = precision.loss_scaler(
            st.config, static_loss_scale, dynamic_loss_scale, {**(dynamic_loss_args or {}), **more_dynamic_loss_args},
            world_group=lambda: state.get().group("world"))
        self.overflow = False  # SMP's fp16 optimizer: True when the last step() was skipped for an overflow
        self._global_grad_norm: torch.Tensor | None = None  # SMP's sharded optimizer: the last step's gradient norm
        st.optimizer = self
        self._sharded = st.config.shard_optimizer_state and st.topology.rdp > 1
        if self._sharded:
            if st.model is None:
                raise RuntimeError("create the smp.DistributedModel before a DistributedOptimizer with "
                                   "shard_optimizer_state=True")
            st.model.register_post_partition_hook(lambda model, _: self._shard(model))

    def _shard(self, model: Any) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # What the optimizer's class takes: AdamW keeps decoupled_weight_decay among its defaults (it is Adam's
        # subclass) but its constructor does not take it; the groups below carry every key all the same.
        takes = inspect.signature(type(self.optimizer).__init__).parameters
        every = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
        defaults = {k: v for k, v in self.optimizer.defaults.items() if k != "params" and (every or k in takes)}
        local = {id(p) for p in model.local_parameters() if p.requires_grad}
        # The wrapped optimizer's param groups, restricted to this rank's parameters (groups keep their own
        # hyperparameters); _zero_groups[i] is the wrapped group that ZeRO group i mirrors.
        groups, self._zero_groups = [], []
        for i, g in enumerate(self.optimizer.param_groups):
            params = [p for p in g["params"] if id(p) in local]
            if params:
                groups.append({**{k: v for k, v in g.items() if k not in ("params", "initial_lr")}, "params": params})
                self._zero_groups.append(i)
        # Parameters as views of one bucket per owner rank: the step's weights go out in one broadcast per rank, not
        # one per parameter (a broadcast costs gloo 2 to 3 ms between ops: GPT-2's step took 2.2x plain dp's).
        self._zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(self.optimizer),
                                             process_group=state.get().group("reduced-data-parallel"),
                                             parameters_as_bucket_view=True, **defaults)

    @property
    def state_sharded(self) -> bool:
        """Is this rank's optimizer state one shard over its reduced-data-parallel replicas (``shard_optimizer_state``,
        once partitioned)?"""
        return self._zero is not None

    def _sync_zero_hyperparameters(self) -> None:
        """lr schedulers change the wrapped optimizer's groups: carry lr & co. over to ZeRO's before it steps."""
        for zg, i in zip(self._zero.param_groups, self._zero_groups):
            zg.update({k: v for k, v in self.optimizer.param_groups[i].items() if k not in ("params", "initial_lr")})

    # The optimizer's own attributes (param_groups, state, defaults): lr schedulers and GradScaler use them.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step; under fp16 loss scaling, unscaled and skipped on overflow; under sharded data
        parallelism, after clipping the global gradient norm to ``sdp_gradient_clipping`` (SMP's), the norm before
        clipping kept as ``_global_grad_norm`` (as SMP's sharded optimizer; SageMaker's GPT-2 script logs it). After a
        training-health check step, ||update|| / ||weight|| is measured per layer (:mod:`smp.health`)."""
        st = state.get()
        if st.sdp_mesh is not None:  # SMP clips under sdp (1.0 by default) and keeps the norm (scripts log it)
            clip = st.config.sdp_gradient_clipping
            self._global_grad_norm = self.clip_master_grads(clip if clip > 0 else math.inf)
        with profiling.span("optimizer.step", "optimizer"), health.session_of(st).around_update(st.model, st.device):
            if self.loss_scaler is not None:
                return self.loss_scaler.scaled_step(self, self._step, closure)
            return self._step(closure)

    def _step(self, closure: Any = None) -> Any:
        if self._zero is not None:
            self._sync_zero_hyperparameters()
            out = self._zero.step(closure)
            for zg, i in zip(self._zero.param_groups, self._zero_groups):  # a step count apex's optimizers keep
                if "step" in zg:
                    self.optimizer.param_groups[i]["step"] = zg["step"]
            return out
        return step_in_chunks(self.optimizer, closure)  # exact, without a whole-group foreach temporary

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients (unscaled first under fp16) to a global norm of at most ``max_norm`` over the
        whole model, as SMP's fp16 optimizer does; returns the norm before clipping. Call it on every rank."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_once(self)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return gradnorm.clip_grad_norm_(params, max_norm, norm_type, state.get())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this rank's parameters (as the wrapped optimizer's ``zero_grad``)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def local_state_dict(self, gather_if_shard: bool = False) -> dict[str, Any]:
        """This rank's optimizer state, keyed as the wrapped optimizer's own ``state_dict()``: ``"state"`` holds
        the entries of the parameters this rank steps, ``"param_groups"`` the hyperparameters. With sharded
        state those are the entries of this replica's shard, and the dict is marked ``ZERO_KEY`` and lists
        the shard's parameters (``SHARD_KEY``, :mod:`smp.checkpoint.state_dicts`), so it loads only into the same
        shard; ``gather_if_shard=True`` gathers the shards of this rank's replicas instead (a collective over the
        reduced-data-parallel group) into the state of its whole stage, which loads into any shard of it. SMP's
        default is True; here it is False, so that ``smp.save`` writes each replica's shard without moving it.
        Under tensor parallelism (tp > 1) it is this tp rank's, marked ``TP_KEY``."""
        wrapped = self.optimizer.state_dict()
        mesh = state.get().sdp_mesh
        if mesh is not None:  # sharded data parallelism: this rank's shards, which load into the same place only
            wrapped = {**wrapped, "state": optimizer_shards(wrapped["state"]), SDP_KEY: marker(mesh)}
        out = wrapped
        if self._zero is not None and gather_if_shard:
            st = state.get()
            index = self._index()
            parts: list[Any] = [None] * st.topology.rdp
            shard = {index[id(p)]: v for p, v in self._zero.optim.state.items()}
            dist.all_gather_object(parts, on_cpu(shard), group=st.enter("reduced-data-parallel",
                                                                         "optimizer.local_state_dict()"))
            out = {"state": dict(sorted((k, v) for part in parts for k, v in part.items())),
                   "param_groups": wrapped["param_groups"]}
        elif self._zero is not None:
            index = self._index()
            out = {"state": dict(sorted((index[id(p)], v) for p, v in self._zero.optim.state.items())),
                   "param_groups": wrapped["param_groups"], ZERO_KEY: True, SHARD_KEY: self._shard_keys()}
        layout, _ = self._tensor_parallel()
        if layout.degree > 1:
            out[TP_KEY] = layout.marker()
        if self._experts():  # this ep rank's experts' state
            degree, rank = state.get().ep_coordinates()
            out[EP_KEY] = {"degree": degree, "rank": rank}
        return self._with_scaler(out)

    def _with_scaler(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the fp16 loss scaler's state (scale, schedule), as SMP's fp16 optimizer saved it."""
        return state_dict if self.loss_scaler is None else {**state_dict, SCALER_KEY: self.loss_scaler.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state of every stage, merged (on every rank), keyed as the wrapped optimizer's own
        ``state_dict()`` would be on one device: a collective over the model-parallel group (pp x tp ranks). With
        sharded state the replicas hold disjoint parts of each stage's state, so the parts are gathered over the
        whole world instead. The state of a tensor-parallel shard is put together from every tp rank's."""
        st = state.get()
        local = self.local_state_dict()
        if st.sdp_mesh is not None:  # sharded state gathered whole over each sharding group first
            local["state"] = optimizer_whole(self.optimizer.state_dict()["state"])
        layout, params = self._tensor_parallel()
        group, size = (None, dist.get_world_size()) if self._zero is not None else \
            (st.group("model-parallel"), st.topology.mp)
        experts = self._experts()
        if experts:  # an ep rank's experts' state: gathered whole over its ep group, which calls this too
            with named_failures("gathering the experts' optimizer state over the expert-parallel group (every rank of "
                                "it calls the optimizer's state_dict())", [r for r in st.ep_ranks if r != st.rank],
                                st.rank, st.config.timeout_s):
                local["state"] = {i: {k: gather_rows(v, experts[i], st.ep_group) for k, v in entry.items()}
                                  if i in experts else entry for i, entry in local["state"].items()}
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, (layout.rank, on_cpu(local["state"])), group=group)
        merged = whole_optimizer_state(parts, params, layout.degree)
        return self._with_scaler({"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (``state_dict()``) or this rank's (``local_state_dict()``) optimizer state (and the fp16 loss
        scaler's, at once). Each rank keeps the entries of the parameters it steps (its stages', or its shard's),
        never another stage's. Under tensor
        parallelism a full dict's whole state tensors are cut to this rank's shards, and a local dict saved by
        another tp rank or degree is refused. Before the first step the load is applied right after partitioning,
        when those are known."""
        st = state.get()
        saved_tp = state_dict.get(TP_KEY)
        if state_dict.get(SDP_KEY) is not None:
            check_shards(state_dict[SDP_KEY], st.sdp_mesh, "this optimizer state")
        if saved_tp is not None:
            check_partial(int(saved_tp["degree"]), int(saved_tp["rank"]),
                          TPLayout(st.topology.tp, st.topology.tp_rank(st.rank)), "this optimizer state")
        if state_dict.get(EP_KEY) is not None:
            check_experts(state_dict[EP_KEY], *st.ep_coordinates(), "this optimizer state")
        if state_dict.get(ZERO_KEY) and not self._sharded:
            raise CheckpointError("this optimizer state was saved with shard_optimizer_state=True over several "
                                  "reduced-data-parallel replicas; load it with the same config and degrees "
                                  f"(this run: shard_optimizer_state={st.config.shard_optimizer_state}, "
                                  f"{st.topology.rdp} replica(s) per shard)")
        if state_dict.get(SCALER_KEY) is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict[SCALER_KEY])
        model = st.model
        if model is not None and not model.partitioned:
            model.after_partition(lambda: self._load(state_dict))
        else:
            self._load(state_dict)

    def _load(self, state_dict: dict[str, Any]) -> None:
        index = self._index()
        layout, sharded = self._tensor_parallel()
        if self._zero is None:
            model = state.get().model
            held = None if model is None else {index[id(p)] for p in model.local_parameters() if id(p) in index}
            mine = {k: v for k, v in state_dict["state"].items() if held is None or k in held}
            experts = self._experts()  # an ep rank's experts: its rows of whole state (a partial dict has them)
            mine = {i: {k: cut_rows(v, experts[i]) for k, v in entry.items()} if i in experts else entry
                    for i, entry in mine.items()}
            self.optimizer.load_state_dict({"state": cut_optimizer_state(mine, sharded, layout),  # tp: this shard
                                            "param_groups": state_dict["param_groups"]})
            shard_state(self.optimizer, whole=SDP_KEY not in state_dict)  # sdp: the state laid out as its parameter
            return
        if state_dict.get(ZERO_KEY) and state_dict[SHARD_KEY] != self._shard_keys():
            raise CheckpointError("this sharded optimizer state belongs to another shard (the data-parallel replica "
                                  "that saved it held other parameters): load each replica's own file "
                                  "(PATH_<pp_rank>_<rdp_rank>, or PATH_<pp_rank>_<tp_rank>_<rdp_rank> with tensor "
                                  "parallelism), with the degrees it was saved with")
        # The hyperparameters into the wrapped groups (ZeRO's follow them at each step), and to ZeRO's shard only
        # the state of the parameters it holds.
        for g, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        shard = self._zero.optim.state_dict()
        params = [p for g in self._zero.optim.param_groups for p in g["params"]]
        keys = set(self._shard_keys())
        kept = cut_optimizer_state({k: v for k, v in state_dict["state"].items() if k in keys}, sharded, layout)
        shard["state"] = {i: kept[index[id(p)]] for i, p in enumerate(params) if index[id(p)] in kept}
        self._zero.optim.load_state_dict(shard)

    def _shard_keys(self) -> list[int]:
        """The wrapped optimizer's keys of the parameters in this replica's ZeRO shard."""
        index = self._index()
        return sorted(index[id(p)] for g in self._zero.optim.param_groups for p in g["params"])

    def _tensor_parallel(self) -> tuple[TPLayout, dict[int, ShardedParam]]:
        """This rank's tensor-parallel layout, and its sharded parameters by their key in the wrapped optimizer."""
        st = state.get()
        model = st.model
        if model is None or not model.partitioned:
            return TPLayout(st.topology.tp, st.topology.tp_rank(st.rank)), {}
        layout = model.tensor_parallel_layout()
        index = self._index()
        return layout, {index[id(p)]: ShardedParam(layout.shards[name], tuple(p.shape))
                        for name, p in model.module.named_parameters(remove_duplicate=False)
                        if name in layout.shards and id(p) in index}

    def _experts(self) -> dict[int, tuple[int, int, int]]:
        """Under expert parallelism, the wrapped optimizer's key of each stacked expert weight this rank holds rows
        of -> its rows ``(start, stop, whole)``."""
        model = state.get().model
        specs = model.expert_shards() if model is not None else {}
        index = self._index()
        return {index[id(p)]: specs[name] for name, p in model.module.named_parameters()
                if name in specs and id(p) in index} if specs else {}

    def _index(self) -> dict[int, int]:
        """Parameter (by id) -> its key in the wrapped optimizer's ``state_dict()``."""
        return {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

