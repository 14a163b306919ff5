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

Hugging Face generative models (Llama, Mistral, Qwen2, T5, BART, Whisper) return a ``DynamicCache`` of past
keys and values when their config's ``use_cache`` is on, which it is by default; the cache is not a tensor
tree torch.export can return, and a training step never reads it. So every config in the model has
``use_cache`` turned off for the duration of the export and restored after (:func:`_without_kv_cache`): the
stages run the traced graph, never the model's own forward, so the cache stays off in them for good.

Every byte count (activations, memory traffic, values, parameters) also records its floating-point part,
the part a 16-bit training precision halves (:mod:`partitioner.precision`); token ids and masks keep theirs.
"""
from __future__ import annotations

import copy
import heapq
import itertools
import operator
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from .errors import EngineError
from .flops import float_bytes, op_flops_and_bytes, tensor_bytes
from .graph import OpGraph
from .mutation import colocated_groups

__all__ = ["trace", "TraceError", "TracedProgram", "flatten_inputs", "tensor_aliases", "set_device"]

_DEVICE_ARGS = "smp_device_args"  # node.meta key: the args/kwargs of a node that hold the traced device


class TraceError(EngineError, RuntimeError):
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


@contextmanager
def _without_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Turn ``use_cache`` off in every (Hugging Face) config the model's modules hold, restore it after."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "use_cache", False) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    try:
        with _without_kv_cache(model):
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
    """Trace ``model(*args, **kwargs)`` into an :class:`OpGraph` whose ``fx`` field can rebuild stages.

    The export runs on a weightless copy of the model (its parameters and buffers on the meta device, with the
    example inputs moved there too), then the traced program is pointed back at the model's own tensors: a
    trace costs no memory for weights, a model built on meta (how a model larger than this machine is
    planned) traces like any other, and the exporter's fake-tensor caches never hold the model's tensors,
    which the engine later materialises or releases in place (:func:`torch.utils.swap_tensors`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trace() needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    shadow = _weightless_copy(model)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (tuple(args), kwargs))
    ep = _export(shadow, tuple(args), kwargs)
    gm = ep.module()
    _point_at(gm, model)
    for graph_module in _graph_modules(gm):  # device constants the trace baked in: meta, to be retargeted
        for node in graph_module.graph.nodes:
            spots = [k for k, v in itertools.chain(enumerate(node.args), node.kwargs.items())
                     if isinstance(v, torch.device) and v.type == "meta"]
            if spots:
                node.meta[_DEVICE_ARGS] = spots
    home = next((t.device for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta), "cpu")
    set_device(gm, home)
    return _build(gm, ep.call_spec.in_spec, ep.call_spec.out_spec, model.training)


def set_device(module: torch.fx.GraphModule, device: torch.device | str) -> None:
    """Point the device constants the trace baked into ``module``'s graph (``arange(..., device=...)``,
    ``.to(device)``, metadata asserts) at ``device``: the device the module's stage runs on."""
    dev = torch.device(device)
    for graph_module in _graph_modules(module):
        for node in graph_module.graph.nodes:
            for spot in node.meta.get(_DEVICE_ARGS, ()):
                if isinstance(spot, int):
                    node.args = (*node.args[:spot], dev, *node.args[spot + 1:])
                else:
                    node.kwargs = {**node.kwargs, spot: dev}
        graph_module.recompile()


def _graph_modules(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    """The module's graph and the graphs of its higher-order ops (``wrap_with_autocast`` bodies, ...)."""
    return [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def _weightless_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same shapes (tied ones
    stay tied): the module structure and Python state without a byte of weights."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _point_at(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make the traced program's parameters and buffers the model's own tensors (same names, same objects)."""
    real: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    real.update(model.named_buffers(remove_duplicate=False))
    for kind in ("_parameters", "_buffers"):
        for path, owner in gm.named_modules(remove_duplicate=False):
            registry = getattr(owner, kind)
            for attr in list(registry):
                name = f"{path}.{attr}" if path else attr
                if name in real:
                    registry[attr] = real[name]


@dataclass
class _Op:
    """An op being built: one or more fx nodes (its members) that the partitioner places as one."""

    name: str
    kind: str
    module: str
    flops: float
    out_bytes: int
    act_bytes: int
    move_bytes: int
    act_float_bytes: int   # the floating-point part of act_bytes (what 16-bit training halves)
    move_float_bytes: int
    members: list[str]
    uses: set[int]


def tensor_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Every attribute path of a parameter or buffer -> the first path of the same tensor, so that a weight
    reached under two names (GPT-2's tied input and output embedding) has one canonical name."""
    first: dict[int, str] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return {name: first.setdefault(id(t), name) for name, t in named}


def _build(gm: torch.fx.GraphModule, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
           training: bool) -> OpGraph:
    alias = tensor_aliases(gm)
    param_names = list(dict.fromkeys(alias.values()))
    key = {name: i for i, name in enumerate(param_names)}
    attr_param = {path: key[canonical] for path, canonical in alias.items()}
    tensors = {name: gm.get_parameter(name) if name in dict(gm.named_parameters(remove_duplicate=False))
               else gm.get_buffer(name) for name in param_names}
    param_bytes = [tensor_bytes(t) for t in tensors.values()]
    param_float = [float_bytes(t) for t in tensors.values()]
    trainable = [isinstance(t, torch.nn.Parameter) and t.requires_grad for t in tensors.values()]

    ops: list[_Op] = []
    op_of: dict[str, int] = {}
    pending_buffer_ops: dict[str, list[torch.fx.Node]] = {}  # module path -> result-less updates waiting
    inputs: list[torch.fx.Node] = []

    def params_of(node: torch.fx.Node) -> set[int]:
        return {attr_param[n.target] for n in _input_nodes(node) if n.op == "get_attr" and n.target in attr_param}

    def new_op(node: torch.fx.Node, kind: str, f: float, moved: int, moved_float: int, is_view: bool) -> int:
        ob = tensor_bytes(node.meta.get("val"))
        fb = 0 if is_view else float_bytes(node.meta.get("val"))
        ops.append(_Op(node.name, kind, _module_path(node), f, ob, 0 if is_view else ob, moved, fb, moved_float,
                       [node.name], set()))
        op_of[node.name] = len(ops) - 1
        return len(ops) - 1

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
            continue
        if node.op in ("get_attr", "call_module"):  # call_module: export's input guard, not part of the model
            continue
        if node.op == "output":
            new_op(node, "output", 0.0, 0, 0, True)
            continue
        op_ins = [n for n in _input_nodes(node) if n.name in op_of]
        params_used = params_of(node)
        if node.target is operator.getitem and op_ins:
            idx = op_of[op_ins[0].name]
        elif not node.users and op_ins:
            idx = max(op_of[n.name] for n in op_ins)
        elif not node.users and not op_ins and params_used:
            pending_buffer_ops.setdefault(_module_path(node), []).append(node)
            continue
        else:
            idx = new_op(node, _kind(node), *op_flops_and_bytes(node))
            for waiting in pending_buffer_ops.pop(ops[idx].module, []):
                ops[idx].members.insert(0, waiting.name)
                op_of[waiting.name] = idx
                params_used |= params_of(waiting)
        if node.name not in op_of:
            op_of[node.name] = idx
            ops[idx].members.append(node.name)
        ops[idx].uses.update(params_used)

    for waiting in {n.name: n for ns in pending_buffer_ops.values() for n in ns}.values():
        ops[new_op(waiting, _kind(waiting), 0.0, 0, 0, True)].uses.update(params_of(waiting))

    nodes = list(gm.graph.nodes)
    succ = _op_successors(nodes, op_of, len(ops))
    ops, op_of = _fuse(ops, op_of, colocated_groups(nodes, op_of, succ), succ)

    # Values: every fx node read by an op other than its own; edges deduplicated per (src, dst, value).
    value_id: dict[str, int] = {}
    value_bytes: list[int] = []
    value_float: list[int] = []
    edges: set[tuple[int, int, int]] = set()
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
                value_bytes.append(tensor_bytes(inp.meta.get("val")))
                value_float.append(float_bytes(inp.meta.get("val")))
            edges.add((producer, consumer, value_id[inp.name]))
    e = np.array(sorted(edges), dtype=np.int64).reshape(-1, 3)
    use_pairs = np.array([(i, p) for i, op in enumerate(ops) for p in sorted(op.uses)], np.int64).reshape(-1, 2)
    fx = TracedProgram(module=gm, in_spec=in_spec, out_spec=out_spec, op_of=op_of,
                       input_names=[n.name for n in inputs], input_meta=[n.meta.get("val") for n in inputs],
                       training=training)
    return OpGraph(
        names=[o.name for o in ops], kinds=[o.kind for o in ops], modules=[o.module for o in ops],
        flops=np.array([o.flops for o in ops], np.float64),
        out_bytes=np.array([o.out_bytes for o in ops], np.int64),
        act_bytes=np.array([o.act_bytes for o in ops], np.int64),
        move_bytes=np.array([o.move_bytes for o in ops], np.int64),
        src=e[:, 0].copy(), dst=e[:, 1].copy(), value=e[:, 2].copy(),
        value_bytes=np.asarray(value_bytes, np.int64),
        param_names=param_names, param_bytes=np.asarray(param_bytes, np.int64),
        param_trainable=np.asarray(trainable, bool),
        act_float_bytes=np.array([o.act_float_bytes for o in ops], np.int64),
        move_float_bytes=np.array([o.move_float_bytes for o in ops], np.int64),
        value_float_bytes=np.asarray(value_float, np.int64), param_float_bytes=np.asarray(param_float, np.int64),
        use_node=use_pairs[:, 0].copy(), use_param=use_pairs[:, 1].copy(),
        members=[tuple(o.members) for o in ops], fx=fx,
    )


def _op_successors(nodes: list[torch.fx.Node], op_of: dict[str, int], num_ops: int) -> list[set[int]]:
    """Per op, the ops that read one of its values."""
    succ: list[set[int]] = [set() for _ in range(num_ops)]
    for node in nodes:
        b = op_of.get(node.name)
        if b is None or node.op == "placeholder":
            continue
        for inp in _input_nodes(node):
            a = op_of.get(inp.name)
            if a is not None and a != b:
                succ[a].add(b)
    return succ


def _fuse(ops: list[_Op], op_of: dict[str, int], groups: list[list[int]],
          succ: list[set[int]]) -> tuple[list[_Op], dict[str, int]]:
    """Contract each co-located group (:mod:`partitioner.mutation`) into one op named after its first member,
    then number the ops in a topological order again (Kahn's algorithm, earliest original index first, so
    the order moves no more than the contraction forces: an op that reads a member early may have to wait
    for the whole group)."""
    if not groups:
        return ops, op_of
    rep = list(range(len(ops)))
    for g in groups:
        for i in g:
            rep[i] = g[0]
    merged = {g[0]: _Op(ops[g[0]].name, ops[g[0]].kind, ops[g[0]].module, sum(ops[i].flops for i in g),
                        sum(ops[i].out_bytes for i in g), sum(ops[i].act_bytes for i in g),
                        sum(ops[i].move_bytes for i in g), sum(ops[i].act_float_bytes for i in g),
                        sum(ops[i].move_float_bytes for i in g), [m for i in g for m in ops[i].members],
                        set().union(*(ops[i].uses for i in g))) for g in groups}
    out_edges: dict[int, set[int]] = {}
    waiting: dict[int, int] = {r: 0 for r in set(rep)}
    for a, bs in enumerate(succ):
        for b in bs:
            ra, rb = rep[a], rep[b]
            if ra != rb and rb not in out_edges.setdefault(ra, set()):
                out_edges[ra].add(rb)
                waiting[rb] += 1
    ready = [r for r, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        r = heapq.heappop(ready)
        order.append(r)
        for b in out_edges.get(r, ()):
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, b)
    new_index = {r: i for i, r in enumerate(order)}
    return [merged.get(r, ops[r]) for r in order], {name: new_index[rep[i]] for name, i in op_of.items()}


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
