"""Building the op graph from an exported program: folding fx nodes into ops, contracting co-located ones.

Folding keeps the op graph about ops: ``getitem`` of a tuple output, ``_assert_tensor_metadata`` and other
result-less checks join the op that produced their input; an in-place update of a buffer that reads no
other op (BatchNorm's ``num_batches_tracked += 1``) joins the next op of the same module, so a module's
state stays on one stage. Ops that must share a stage because of in-place mutations
(:mod:`partitioner.capture.mutation`) are then contracted into one, and the ops renumbered in a topological order.

An op's activations are the storages autograd saves for its backward (:mod:`partitioner.capture.autograd_saves`), each
counted once, on the first op that saves it. Every byte count (activations, memory traffic, values, parameters)
also records its floating-point part, the part a 16-bit training precision halves
(:mod:`partitioner.cost.precision`); token ids and masks keep theirs.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from .autograd_saves import saved_bytes
from .flops import float_bytes, op_flops_and_bytes, tensor_bytes
from .graph import OpGraph
from .mutation import colocated_groups
from .program import TracedProgram, tensor_aliases

__all__ = ["build_graph"]


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


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


def build_graph(gm: torch.fx.GraphModule, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                training: bool, inputs_require_grad: bool = False, folded: frozenset = frozenset()) -> OpGraph:
    """The op graph of an exported, unlifted program ``gm`` (see the module docstring); its ``fx`` field keeps
    what :mod:`partitioner.capture.stage_modules` needs to cut executable stages from ``gm``. ``inputs_require_grad``:
    whether the program's floating-point inputs need gradients (a loss on a model's output), which decides
    what its ops save for backward. ``folded``: the functions that join the op whose result they carry (a parallel
    axis's collectives, :attr:`TracedProgram.folded`), kept in the program for graphs rebuilt from it."""
    alias = tensor_aliases(gm)
    param_names = list(dict.fromkeys(alias.values()))
    key = {name: i for i, name in enumerate(param_names)}
    attr_param = {path: key[canonical] for path, canonical in alias.items()}
    named_params = dict(gm.named_parameters(remove_duplicate=False))  # once: per name it was quadratic in a 70B model
    tensors = {name: named_params[name] if name in named_params else gm.get_buffer(name) for name in param_names}
    param_bytes = [tensor_bytes(t) for t in tensors.values()]
    param_float = [float_bytes(t) for t in tensors.values()]
    trainable = [isinstance(t, torch.nn.Parameter) and t.requires_grad for t in tensors.values()]

    ops: list[_Op] = []
    op_of: dict[str, int] = {}
    pending_buffer_ops: dict[str, list[torch.fx.Node]] = {}  # module path -> result-less updates waiting
    inputs: list[torch.fx.Node] = []

    def params_of(node: torch.fx.Node) -> set[int]:
        return {attr_param[n.target] for n in _input_nodes(node) if n.op == "get_attr" and n.target in attr_param}

    def new_op(node: torch.fx.Node, kind: str, f: float, moved: int, moved_float: int) -> int:
        ops.append(_Op(node.name, kind, _module_path(node), f, tensor_bytes(node.meta.get("val")), 0, moved, 0,
                       moved_float, [node.name], set()))
        op_of[node.name] = len(ops) - 1
        return len(ops) - 1

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
            continue
        if node.op in ("get_attr", "call_module"):  # call_module: export's input guard, not part of the model
            continue
        if node.op == "output":
            new_op(node, "output", 0.0, 0, 0)
            continue
        op_ins = [n for n in _input_nodes(node) if n.name in op_of]
        params_used = params_of(node)
        if (node.target is operator.getitem or node.target in folded) and op_ins:
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
        ops[new_op(waiting, _kind(waiting), 0.0, 0, 0)].uses.update(params_of(waiting))

    for name, (saved, saved_float) in saved_bytes(gm, inputs_require_grad).by_node.items():
        ops[op_of[name]].act_bytes += saved
        ops[op_of[name]].act_float_bytes += saved_float

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
                       training=training, folded=folded)
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
    """Contract each co-located group (:mod:`partitioner.capture.mutation`) into one op named after its first member,
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
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target.overloadpacket.__name__}"
    return getattr(target, "__name__", str(target))
