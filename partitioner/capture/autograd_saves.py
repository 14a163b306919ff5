"""What autograd keeps for backward: the activations a training forward leaves alive, per traced op.

Method: each ATen op's backward reads a few of its inputs and outputs, and autograd saves exactly those when the
op runs with gradients on. Which ones is torch's own derivative formula for the op (``tools/autograd/
derivatives.yaml`` in the torch source; composite ops such as ``linear``, ``layer_norm``, ``dropout`` and
``scaled_dot_product_attention`` by the ops they decompose into): the rules of
:mod:`partitioner.capture.save_rules`, applied here op by op in graph order.

A tensor is counted by its storage: the fake tensors torch.export records on every node share storage the way
the real ones will (a view, a no-op cast or a ``split`` sees its base's storage), so a storage that several ops
save -- q, k and v sliced from one projection, a residual read by a norm and by a multiply -- counts once, on
the first op in graph order that saves it, with the bytes of the whole storage, as the memory it pins. Parameters,
buffers and constants and their views count nothing (they are held anyway). An op saves nothing when its
output needs no gradient: under ``torch.no_grad`` (``wrap_with_set_grad_enabled``), or when no input needs one
(masks, positions, the embedding's ids). Ops not in the table save their outputs (the conservative rule), and
are reported (:attr:`Saved.unknown`): nothing is under-counted silently.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .flops import op_name
from .save_rules import DROPOUTS, NO_GRAD, SAVES, SAVES_NOTHING, SPECIAL, Value, nth

__all__ = ["Saved", "saved_bytes"]


@dataclass
class Saved:
    """Per fx node name, the bytes of the storages it is the first to save for backward and their floating-point
    part; ``unknown``: the kinds of the ops that needed a gradient but have no rule
    (:mod:`~partitioner.capture.save_rules`), counted by their outputs."""

    by_node: dict[str, tuple[int, int]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)


def saved_bytes(gm: torch.fx.GraphModule, inputs_require_grad: bool = False) -> Saved:
    """What each op of the exported graph ``gm`` saves for backward (see the module docstring).
    ``inputs_require_grad``: whether the graph's floating-point inputs need gradients (a loss applied to a
    model's output: yes; a model's data: no)."""
    saved = Saved()
    walker = _Walker(gm, saved)
    env: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = walker.value(node, inputs_require_grad and _is_float(node.meta.get("val")))
    walker.walk(gm, env, True, owner=None)
    return saved


def _is_float(v: Any) -> bool:  # what can need a gradient
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _storage_key(v: Any) -> Any:
    try:
        return ("storage", v.untyped_storage()._cdata)
    except Exception:  # no storage to speak of (a symbolic or sparse tensor): the node's own value
        return None


def _nbytes(v: torch.Tensor) -> int:
    try:
        return int(v.untyped_storage().nbytes())
    except Exception:
        return v.numel() * v.element_size()


class _Walker:
    """Walks an fx graph (and the bodies of its grad-mode and autocast regions) in order, recording saves."""

    def __init__(self, gm: torch.fx.GraphModule, saved: Saved):
        self.saved, self.claimed = saved, set[Any]()
        self.alias: dict[Any, Any] = {}   # storage key of a region's or getitem's fake -> the key it stands for
        self.held: set[Any] = set()       # storage keys of parameters, buffers and constants

    def value(self, node: torch.fx.Node, grad: bool, held: bool = False, v: Any = None) -> Any:
        """The :class:`Value` (or tuple of them) of ``node``'s result ``v`` (default: its traced value)."""
        v = node.meta.get("val") if v is None else v
        if isinstance(v, (tuple, list)):
            return tuple(self.value(node, grad, held, x) for x in v)
        if not isinstance(v, torch.Tensor):
            return None
        key = _storage_key(v)
        key = self.alias.get(key, key) if key is not None else ("node", node.name, id(v))
        return Value(key, _nbytes(v), _nbytes(v) if _is_float(v) else 0, grad and _is_float(v), held)

    def claim(self, owner: str, value: Any) -> None:
        """``owner`` saves ``value`` (a :class:`Value`, or a new buffer as ``(key, bytes, float bytes)``)."""
        if isinstance(value, tuple):
            if not value or isinstance(value[0], Value) or value[0] is None:
                for v in value:
                    self.claim(owner, v)
                return
            value = Value(value[0], value[1], value[2], False)
        if not isinstance(value, Value) or value.held or value.key in self.held or value.key in self.claimed:
            return
        self.claimed.add(value.key)
        b, f = self.saved.by_node.get(owner, (0, 0))
        self.saved.by_node[owner] = (b + value.nbytes, f + value.float_bytes)

    def walk(self, gm: torch.fx.GraphModule, env: dict[str, Any], grad_on: bool, owner: str | None) -> Any:
        """Record the saves of ``gm``'s nodes (placeholders already in ``env``), attributed to ``owner`` if
        given (a region's body: its outer node); the graph's output values."""
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                attr = operator.attrgetter(node.target)(gm)
                if isinstance(attr, torch.Tensor):
                    env[node.name] = self.value(node, isinstance(attr, torch.nn.Parameter) and attr.requires_grad,
                                                held=True)
                    self.held.update(v.key for v in _flat([env[node.name]]) if isinstance(v, Value))
                else:
                    env[node.name] = attr
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env.get(n.name))
            elif node.op == "call_function":
                if node.target is torch._C._set_grad_enabled:
                    grad_on = bool(node.args[0])
                    continue
                env[node.name] = self.call(gm, node, env, grad_on, owner or node.name)
        return None

    def call(self, gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], grad_on: bool,
             owner: str) -> Any:
        """Record what ``node`` saves; its result's :class:`Value`."""
        target, name = node.target, op_name(node)
        args: Any = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env.get(n.name))
        if target is operator.getitem:
            parent, own = args[0][0], self.value(node, False)
            got = parent[args[0][1]] if isinstance(parent, (tuple, list)) else None
            if isinstance(own, Value) and isinstance(got, Value) and own.key != got.key:
                self.alias[own.key] = got.key  # a region's result: the storage inside the region
            return got if isinstance(got, Value) else own
        if name in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
            enabled = bool(args[0][0]) if name == "wrap_with_set_grad_enabled" else grad_on
            at = 1 if name == "wrap_with_set_grad_enabled" else 4
            body = args[0][at]
            return self.region(body, node, args[0][at + 1:], grad_on and enabled, owner)
        if (slot := getattr(target, "smp_region", None)) is not None:  # an axis's op standing for a region (ep)
            return self.region(args[0][slot], node, args[0][slot + 1:], grad_on, owner)
        if name in DROPOUTS and not (nth(_bind(target, *args), 1) and nth(_bind(target, *args), 2)):
            return args[0][0]  # dropout that is off returns its input itself (the fake kernel copies it)
        inputs = [v for v in _flat(args) if isinstance(v, Value)]
        grad = grad_on and name not in NO_GRAD and any(v.grad for v in inputs)
        held = bool(inputs) and all(v.held for v in inputs) and name in SAVES_NOTHING  # a view of a weight
        out = self.value(node, grad, held)
        if not grad:
            return out
        bound = _bind(target, args[0], args[1])
        outs = out if isinstance(out, tuple) else (out,)
        if name in SPECIAL:
            metas = torch.fx.node.map_arg(_bind(target, node.args, node.kwargs), lambda n: n.meta.get("val"))
            for item in SPECIAL[name](metas, bound, outs, node.name):
                self.claim(owner, item)
        elif name in SAVES:
            for rule in SAVES[name]:
                what, _, when = rule.partition(" if ")
                if when and not any(v.grad for v in _flat([bound.get(when)]) if isinstance(v, Value)):
                    continue
                self.claim(owner, _pick(what, bound, outs))
        elif name not in SAVES_NOTHING:
            if name not in self.saved.unknown:
                self.saved.unknown.append(name)
            self.claim(owner, outs)
        return out

    def region(self, body: torch.fx.GraphModule, node: torch.fx.Node, args: tuple, grad_on: bool,
               owner: str) -> Any:
        """A grad-mode or autocast region: its body walked with its placeholders bound to the outer values."""
        env: dict[str, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for p, outer in zip(placeholders, args):
            env[p.name] = outer
            key = _storage_key(p.meta.get("val"))
            if isinstance(outer, Value) and key is not None:
                self.alias[key] = outer.key
        result = self.walk(body, env, grad_on, owner)
        return tuple(result) if isinstance(result, (list, tuple)) else result


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)) and not isinstance(x, Value):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return _flat(list(x.values()))
    return [x]


def _bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their schema (ATen op) or signature (Python function) names, in that order,
    defaults filled in."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        defaults = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    else:
        try:
            defaults = {k: None if p.default is inspect.Parameter.empty else p.default
                        for k, p in inspect.signature(target).parameters.items()}
        except (TypeError, ValueError):
            defaults = {}
    return {**defaults, **dict(zip(defaults, args)), **kwargs}


def _pick(what: str, bound: dict[str, Any], outs: tuple) -> Any:
    if what.startswith("out"):
        i = int(what[3:] or 0)
        return outs[i] if i < len(outs) else None
    v = bound.get(what)
    return tuple(x for x in _flat([v]) if isinstance(x, Value)) or None
