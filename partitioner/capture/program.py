"""The traced program: the exported graph the stages are cut from, its inputs and the device it runs on.

:func:`partitioner.trace` returns an :class:`OpGraph` whose ``fx`` field is a :class:`TracedProgram`: the
unlifted exported graph (``ExportedProgram.module()``), pointed at the model's own parameters and buffers
so the stages built from it train the user's tensors in place, and how the model's ``(args, kwargs)``
flatten into its placeholders. Device constants the trace baked into the graph (``arange(device=...)``,
``.to(device)``) are marked, so that :func:`set_device` can point a stage at the device it runs on.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["TracedProgram", "flatten_inputs", "tensor_aliases", "set_device", "graph_modules", "copy_graph",
           "rewritten_module", "keep_plain_constants", "DEVICE_ARGS"]

DEVICE_ARGS = "smp_device_args"  # node.meta key: the args/kwargs of a node that hold the traced device


@dataclass
class TracedProgram:
    """What :mod:`partitioner.capture.stage_modules` needs to rebuild executable stages from an op graph."""

    module: torch.fx.GraphModule          # unlifted exported graph; get_attr targets are the model's tensors
    in_spec: pytree.TreeSpec               # how (args, kwargs) flatten into the graph's placeholders
    out_spec: pytree.TreeSpec              # how the flat outputs rebuild the model's output object
    op_of: dict[str, int]                  # fx node name -> op index (folded nodes map to their op)
    input_names: list[str]                 # placeholder names, in flat order
    input_meta: list[Any]                  # example value of each flat input (tensor metadata or constant)
    training: bool = True                  # the model's mode when traced: the mode stages start in
    split_ops: dict[str, int] = field(default_factory=dict)  # linears cut into column chunks (capture.chunk)
    loss: tuple[Any, Any] | None = None    # (loss_fn, one microbatch's target) priced on the output op, if traced
    tp_comm: Any = None                    # a tensor-parallel rank's program: its TPComm (partitioner.tp.shard_program)
    sharding: Any = None                   # ... and the Sharding it was written from (partitioner.tp.sharding)
    ep_comm: Any = None                    # an expert-parallel rank's program: its EPComm (partitioner.ep.dispatch)
    experts: Any = None                    # ... and what it shards (partitioner.ep.expert_program.ExpertSharding)
    cp_comm: Any = None                    # a context-parallel rank's program: its CPComm (partitioner.cp.comm)
    context: Any = None                    # ... and what it splits (partitioner.cp.context_program.ContextSharding)
    # A parallel axis's collectives that join the op whose result they carry (tp: no cut between a row-parallel
    # matmul and its all-reduce), set by the axis that rewrote the program, so capture needs no axis.
    folded: frozenset = frozenset()
    # Per op, the forward and backward seconds of the collectives the program calls: (graph, rates, dtype,
    # needs_grad) -> (forward_s, backward_s), set by the axis that wrote them (partitioner.tp.pricing), summed by
    # the cost model (partitioner.cost.roofline), which so needs no axis either.
    collective_pricing: tuple[Callable[..., Any], ...] = ()


def tensor_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Every attribute path of a parameter or buffer -> the first path of the same tensor, so that a weight
    reached under two names (GPT-2's tied input and output embedding) has one canonical name."""
    first: dict[int, str] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return {name: first.setdefault(id(t), name) for name, t in named}


def set_device(module: torch.fx.GraphModule, device: torch.device | str) -> None:
    """Point the device constants the trace baked into ``module``'s graph (``arange(..., device=...)``,
    ``.to(device)``, metadata asserts) at ``device``: the device the module's stage runs on."""
    dev = torch.device(device)
    for graph_module in graph_modules(module):
        for node in graph_module.graph.nodes:
            for spot in node.meta.get(DEVICE_ARGS, ()):
                if isinstance(spot, int):
                    node.args = (*node.args[:spot], dev, *node.args[spot + 1:])
                else:
                    node.kwargs = {**node.kwargs, spot: dev}
        graph_module.recompile()


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A deep copy of ``graph`` to rewrite. Copying an exported graph's codegen rebuilds its pytree specs, which on
    torch 2.13 warns that ``LeafSpec`` is deprecated from inside torch's own objects: nothing the user can act on, so
    that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(graph)


def graph_modules(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    """The module's graph and the graphs of its higher-order ops (``wrap_with_autocast`` bodies, ...)."""
    return [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def flatten_inputs(fx: TracedProgram, args: tuple, kwargs: dict | None = None) -> list[Any]:
    """Flatten ``(args, kwargs)`` the way the traced graph's placeholders expect them."""
    import torch.fx._pytree as fx_pytree

    kwargs = dict(kwargs or {})
    want_args, want_kwargs = _signature(fx.in_spec)
    if want_args is not None and (len(args) != want_args or set(kwargs) != set(want_kwargs)):
        # tree_flatten_spec alone would silently drop extra inputs.
        raise TypeError(f"inputs do not match the traced signature: the model was traced with {want_args} "
                        f"positional input(s) and keyword input(s) {sorted(want_kwargs)}, but got {len(args)} "
                        f"positional and {sorted(kwargs)}; pass the same inputs as the example microbatch")
    try:
        return list(fx_pytree.tree_flatten_spec((tuple(args), kwargs), fx.in_spec))
    except Exception as exc:
        raise TypeError(f"inputs do not match the traced signature {fx.in_spec}: {exc}") from exc


def _signature(spec: pytree.TreeSpec) -> tuple[int | None, list[str]]:
    """Number of positional inputs and the keyword names of an ``(args, kwargs)`` input spec."""
    try:
        args_spec, kwargs_spec = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
        return args_spec.num_children, list(kwargs_spec.context or [])
    except Exception:  # not an (args, kwargs) spec: leave the check to tree_flatten_spec
        return None, []


def rewritten_module(source: torch.fx.GraphModule, graph: torch.fx.Graph,
                     attrs: dict[str, Any]) -> torch.fx.GraphModule:
    """A module running ``graph`` (a rewrite of ``source``'s) over ``source``'s tensors, with the attributes ``attrs``
    (an axis's communication handle, bodies of fused regions) it reads too (:func:`keep_plain_constants`)."""
    for name, value in attrs.items():
        setattr(source, name, value)
    try:
        module = torch.fx.GraphModule(source, graph)
    finally:
        for name in attrs:
            delattr(source, name)
    keep_plain_constants(module, source)
    return module


def keep_plain_constants(module: torch.nn.Module, source: torch.nn.Module) -> None:
    """``GraphModule`` registers every tensor it copies as a buffer; constants the export lifted (plain tensor
    attributes of ``source``, not the model's) stay plain attributes of ``module``, as in the traced program, so that
    no plan takes them for the model's buffers."""
    buffers = {name for name, _ in source.named_buffers(remove_duplicate=False)}
    for name, _ in list(module.named_buffers(remove_duplicate=False)):
        if name not in buffers:
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner)
            value = getattr(holder, leaf)
            delattr(holder, leaf)
            setattr(holder, leaf, value)
