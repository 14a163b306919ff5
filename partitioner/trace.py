"""Tracing a torch model into an :class:`~partitioner.graph.OpGraph`.

We use ``torch.export.export(..., strict=False)``: it runs the model's Python under fake tensors and
records an ATen-level graph with shapes on every node, and it handles real HF transformers models
(GPT-2, BERT, ViT, ResNet, T5) where ``torch.fx.symbolic_trace`` fails on their Python control flow. The
unlifted graph (``ExportedProgram.module()``) refers to the model's own ``nn.Parameter`` objects, so the
stages built from it train the user's parameters in place.

Folding keeps the op graph about ops: ``getitem`` of a tuple output, ``_assert_tensor_metadata`` and other
result-less checks join the op that produced their input; an in-place update of a buffer that reads no
other op (BatchNorm's ``num_batches_tracked += 1``) joins the next op of the same module, so a module's
state stays on one stage.
"""
from __future__ import annotations

import operator
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from .cost import op_flops_and_bytes, tensor_bytes
from .graph import OpGraph

__all__ = ["trace", "TraceError", "TracedProgram", "flatten_inputs"]


class TraceError(RuntimeError):
    """The model could not be traced into a static op graph; the message names the module and the fix."""


@dataclass
class TracedProgram:
    """What :mod:`partitioner.split` needs to rebuild executable stages from an op graph."""

    module: torch.fx.GraphModule          # unlifted exported graph; get_attr targets are the model's tensors
    in_spec: pytree.TreeSpec               # how (args, kwargs) flatten into the graph's placeholders
    out_spec: pytree.TreeSpec              # how the flat outputs rebuild the model's output object
    op_of: dict[str, int]                  # fx node name -> op index (folded nodes map to their op)
    input_names: list[str]                 # placeholder names, in flat order
    input_meta: list[Any]                  # example value of each flat input (tensor metadata or constant)
    training: bool = True                  # the model's mode when traced: the mode stages start in


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _offending_module(model: torch.nn.Module, exc: BaseException) -> str:
    """The deepest module of ``model`` whose ``forward`` was on the stack when tracing failed."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            frame = traceback.extract_tb(tb, limit=1)[0]
            found = f"{names[id(owner)]} ({type(owner).__name__}, {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
        tb = tb.tb_next
    return found or type(model).__name__


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # torch raises many types here; all get the same treatment
        where = _offending_module(model, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        data_dependent = any(s in str(exc) for s in ("data-dependent", "data dependent", "GuardOnDataDependent",
                                                     "Could not guard", "Could not extract specialized"))
        hint = ("the model branches on tensor values (data-dependent control flow); make the branch depend on "
                "shapes or config, express it with torch.cond, or move it out of forward"
                if data_dependent else
                "check that the example inputs are what forward expects (one microbatch, the right shapes, dtypes "
                "and types); if they are, simplify that module's forward for torch.export (see the torch.export "
                "docs on non-strict tracing)")
        raise TraceError(f"cannot trace {type(model).__name__}: {type(exc).__name__} in module {where}: "
                         f"{first.rstrip('.')}. Fix: {hint}.") from exc


def trace(model: torch.nn.Module, args: tuple | list | Any = (), kwargs: dict | None = None) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` into an :class:`OpGraph` whose ``fx`` field can rebuild stages."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trace() needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    ep = _export(model, tuple(args), kwargs)
    gm = ep.module()
    return _build(gm, ep.call_spec.in_spec, ep.call_spec.out_spec, model.training)


def _build(gm: torch.fx.GraphModule, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
           training: bool) -> OpGraph:
    # Parameters and buffers, keyed by the tensor object: tied weights reached by two names are one key.
    key_of: dict[int, int] = {}
    param_names: list[str] = []
    param_bytes: list[int] = []
    trainable: list[bool] = []
    attr_param: dict[str, int] = {}
    for name, tensor in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if id(tensor) not in key_of:
            key_of[id(tensor)] = len(param_names)
            param_names.append(name)
            param_bytes.append(tensor.numel() * tensor.element_size())
            trainable.append(isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad)
        attr_param[name] = key_of[id(tensor)]

    names: list[str] = []
    kinds: list[str] = []
    modules: list[str] = []
    flops: list[float] = []
    out_b: list[int] = []
    act_b: list[int] = []
    move_b: list[int] = []
    members: list[list[str]] = []
    uses: list[set[int]] = []
    op_of: dict[str, int] = {}
    pending_buffer_ops: dict[str, list[torch.fx.Node]] = {}  # module path -> result-less updates waiting
    inputs: list[torch.fx.Node] = []

    def new_op(node: torch.fx.Node, kind: str, f: float, moved: int, is_view: bool) -> int:
        idx = len(names)
        names.append(node.name)
        kinds.append(kind)
        modules.append(_module_path(node))
        flops.append(f)
        ob = tensor_bytes(node.meta.get("val"))
        out_b.append(ob)
        act_b.append(0 if is_view else ob)
        move_b.append(moved)
        members.append([node.name])
        uses.append(set())
        op_of[node.name] = idx
        return idx

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
            continue
        if node.op in ("get_attr", "call_module"):  # call_module: export's input guard, not part of the model
            continue
        if node.op == "output":
            idx = new_op(node, "output", 0.0, 0, True)
            continue
        ins = _input_nodes(node)
        op_ins = [n for n in ins if n.name in op_of]
        params_used = {attr_param[n.target] for n in ins if n.op == "get_attr" and n.target in attr_param}
        if node.target is operator.getitem and op_ins:
            idx = op_of[op_ins[0].name]
        elif not node.users and op_ins:
            idx = max(op_of[n.name] for n in op_ins)
        elif not node.users and not op_ins and params_used:
            pending_buffer_ops.setdefault(_module_path(node), []).append(node)
            continue
        else:
            f, moved, is_view = op_flops_and_bytes(node)
            idx = new_op(node, _kind(node), f, moved, is_view)
            for waiting in pending_buffer_ops.pop(modules[idx], []):
                members[idx].insert(0, waiting.name)
                op_of[waiting.name] = idx
                params_used |= {attr_param[n.target] for n in _input_nodes(waiting) if n.op == "get_attr"}
        if node.name not in op_of:
            op_of[node.name] = idx
            members[idx].append(node.name)
        uses[idx].update(params_used)

    for waiting in {n.name: n for ns in pending_buffer_ops.values() for n in ns}.values():
        idx = new_op(waiting, _kind(waiting), 0.0, 0, True)
        uses[idx].update(attr_param[n.target] for n in _input_nodes(waiting) if n.op == "get_attr")

    # Values: every fx node read by an op other than its own; edges deduplicated per (src, dst, value).
    value_id: dict[str, int] = {}
    value_bytes: list[int] = []
    edges: set[tuple[int, int, int]] = set()
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.name not in op_of or node.op == "placeholder":
            continue
        consumer = op_of[node.name]
        for inp in _input_nodes(node):
            producer = op_of.get(inp.name)
            if producer is None or producer == consumer:
                continue
            if inp.name not in value_id:
                value_id[inp.name] = len(value_bytes)
                value_bytes.append(tensor_bytes(by_name[inp.name].meta.get("val")))
            edges.add((producer, consumer, value_id[inp.name]))
    e = np.array(sorted(edges), dtype=np.int64).reshape(-1, 3)
    use_pairs = np.array([(i, p) for i, ps in enumerate(uses) for p in sorted(ps)], np.int64).reshape(-1, 2)
    fx = TracedProgram(module=gm, in_spec=in_spec, out_spec=out_spec, op_of=op_of,
                       input_names=[n.name for n in inputs], input_meta=[n.meta.get("val") for n in inputs],
                       training=training)
    return OpGraph(
        names=names, kinds=kinds, modules=modules,
        flops=np.asarray(flops, np.float64), out_bytes=np.asarray(out_b, np.int64),
        act_bytes=np.asarray(act_b, np.int64), move_bytes=np.asarray(move_b, np.int64),
        src=e[:, 0].copy(), dst=e[:, 1].copy(), value=e[:, 2].copy(),
        value_bytes=np.asarray(value_bytes, np.int64),
        param_names=param_names, param_bytes=np.asarray(param_bytes, np.int64),
        param_trainable=np.asarray(trainable, bool),
        use_node=use_pairs[:, 0].copy(), use_param=use_pairs[:, 1].copy(),
        members=[tuple(m) for m in members], fx=fx,
    )


def _kind(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return f"{target.namespace}.{packet.__name__}"
    return getattr(target, "__name__", str(target))


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
