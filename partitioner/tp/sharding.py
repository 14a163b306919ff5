"""Which ops and parameters tensor parallelism shards: Megatron's pattern, found on the traced op graph.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053) splits a transformer block with no communication inside
it: the first matmul of a block is column-parallel (each of the ``tp`` ranks computes a slice of the output
features: attention heads, or MLP columns), everything up to the next matmul works on those slices alone,
and that matmul is row-parallel (each rank multiplies its slice by the matching rows of the weight, and one
all-reduce sums the partial results). The word embedding and the LM head split the vocabulary.

:func:`find_sharding` finds this on any traced model, not on named module classes: a matmul whose weight is
a parameter and whose input every rank holds whole starts a *region* (column-parallel), the sharded dimension
is followed op by op (views, transposes, head splits, attention, elementwise ops), and a matmul that
contracts the sharded dimension ends it (row-parallel). A region that meets an op it cannot follow (a norm
over the sharded features, a slice across heads, sizes that do not divide), or whose weights are also read
whole elsewhere, is left replicated, and :attr:`Sharding.replicated` says why. A fused projection that one
``split`` cuts into q, k and v (GPT-2's ``c_attn``) is sharded block by block (``groups``), so that each rank
holds its heads of all three. The vocabulary-parallel head may end in the traced loss (a vocabulary-parallel
cross-entropy) or at the graph's outputs (gathered there). The analysis is pure: :mod:`partitioner.tp.shard_program`
writes one tp rank's graph from it.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Collection

import torch
import torch.fx

from ..capture.flops import op_name
from .shard_rules import ELEMENTWISE, VIEWS, Shard, carry, node_args, node_inputs, shard_of, value_of

__all__ = ["Shard", "Sharding", "find_sharding", "ELEMENTWISE"]




@dataclass
class Sharding:
    """The result of :func:`find_sharding` for one tensor-parallel degree ``tp``."""

    tp: int
    params: dict[str, Shard] = field(default_factory=dict)   # get_attr target -> its shard
    values: dict[str, Shard] = field(default_factory=dict)   # fx node name -> the shard of its output
    roles: dict[str, str] = field(default_factory=dict)      # node -> column | row | embedding | loss
    copies: list[str] = field(default_factory=list)          # whole values read by sharded ops (Megatron's f)
    gathers: list[str] = field(default_factory=list)         # sharded values the graph outputs (gathered)
    scatters: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)  # node -> whole inputs it slices
    replicated: dict[str, str] = field(default_factory=dict)  # matmul or embedding left whole -> why
    sequence: bool = False  # the program written from it runs its whole regions on a slice of the sequence
    deferred: tuple[str, ...] = ()  # ... and these weights, read whole there, sum their gradients once per step

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: degree, sharded parameters, roles, what stayed replicated and sequence parallelism."""
        return {"tp": self.tp, "params": {k: asdict(v) for k, v in sorted(self.params.items())},
                "roles": dict(sorted(self.roles.items())), "replicated": dict(sorted(self.replicated.items())),
                "sequence": self.sequence}


class _Restart(Exception):
    """A fused projection turned out to need block-wise sharding: propagate again with it."""


def _param(n: Any, gm: torch.fx.GraphModule) -> bool:
    if not (isinstance(n, torch.fx.Node) and n.op == "get_attr"):
        return False
    try:
        return isinstance(gm.get_parameter(str(n.target)), torch.nn.Parameter)
    except AttributeError:
        return False


def _matmul(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[Any, Any, Any, int] | None:
    """(input, weight, bias, the weight's output-feature dim) of a matmul by a 2-d parameter, else None."""
    name = op_name(node)
    if name == "linear" and len(node_args(node)) >= 2 and _param(node_args(node)[1], gm):
        bias = node_args(node)[2] if len(node_args(node)) > 2 else node.kwargs.get("bias")
        return node_args(node)[0], node_args(node)[1], bias if _param(bias, gm) else None, 0
    if name == "addmm" and len(node_args(node)) == 3 and not node.kwargs and _param(node_args(node)[2], gm) \
            and _param(node_args(node)[0], gm):
        return node_args(node)[1], node_args(node)[2], node_args(node)[0], 1
    if name == "mm" and _param(node_args(node)[1], gm):
        return node_args(node)[0], node_args(node)[1], None, 1
    return None


def _from_input(n: Any) -> bool:
    """Whether ``n`` is a graph input seen through views (the token ids an embedding looks up)."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and op_name(n) in VIEWS | {"to", "_to_copy"}:
        n = node_args(n)[0]
    return isinstance(n, torch.fx.Node) and n.op == "placeholder"


def _vocab_embeddings(gm: torch.fx.GraphModule) -> set[str]:
    """The embedding lookups of the model's input ids with the largest table (the word embedding)."""
    found = {n.name: value_of(node_args(n)[0]).shape[0] for n in gm.graph.nodes if n.op == "call_function"
             and op_name(n) == "embedding" and _param(node_args(n)[0], gm) and _from_input(node_args(n)[1])
             and isinstance(value_of(node_args(n)[0]), torch.Tensor)}
    return {k for k, rows in found.items() if rows == max(found.values())}


class _Walk:
    """One propagation of shards through the graph (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, tp: int, disabled: dict[str, str], groups: dict[str, int]):
        self.gm, self.tp, self.disabled, self.groups = gm, tp, disabled, groups
        self.out = Sharding(tp)
        self.parent: dict[str, str] = {}
        self.region: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.split_outputs: dict[str, list[Shard | None]] = {}
        self.vocab = _vocab_embeddings(gm)

    def root(self, x: str) -> str:
        while self.parent.get(x, x) != x:
            x = self.parent[x]
        return x

    def join(self, nodes: list[torch.fx.Node]) -> str | None:
        roots = sorted({self.root(self.region[n.name]) for n in nodes if n.name in self.region})
        for r in roots[1:]:
            self.parent[r] = roots[0]
        return roots[0] if roots else None

    def fail(self, nodes: list[torch.fx.Node], why: str) -> None:
        for n in nodes:
            if n.name in self.region:
                self.failed.setdefault(self.root(self.region[n.name]), why)

    def shard(self, node: torch.fx.Node, s: Shard, sources: list[torch.fx.Node]) -> None:
        self.out.values[node.name] = s
        self.region[node.name] = self.join(sources) or node.name
        self.parent.setdefault(self.region[node.name], self.region[node.name])

    def run(self) -> Sharding:
        for node in self.gm.graph.nodes:
            if node.op == "output":
                for a in node_inputs(node):
                    if a.name in self.out.values:
                        self.out.gathers.append(a.name)
            elif node.op == "call_function":
                self.visit(node)
        return self.out

    def visit(self, node: torch.fx.Node) -> None:
        ins = [n for n in node_inputs(node) if n.name in self.out.values or n.name in self.split_outputs]
        mm = _matmul(node, self.gm)
        name = op_name(node)
        if mm is not None and node.name not in self.disabled:
            return self.matmul(node, mm)
        if name == "embedding" and node.name in self.vocab and node.name not in self.disabled:
            self.out.roles[node.name] = "embedding"
            self.region[node.name] = node.name
            self.parent.setdefault(node.name, node.name)
            return None
        if not ins or name == "_assert_tensor_metadata":
            return None
        try:
            result = self.rule(node, name)
        except _Restart:
            raise
        except (ValueError, IndexError) as exc:
            return self.fail(ins, f"{node.name} ({name}): {exc}")
        if result is None:
            return self.fail(ins, f"{node.name} ({name}) cannot work on a slice of the features")
        if isinstance(result, list):
            self.split_outputs[node.name] = result
            self.region[node.name] = self.join(ins) or node.name
            return None
        if name == "cross_entropy_loss":
            self.out.roles[node.name] = "loss"
            self.region[node.name] = self.join(ins) or node.name
            return None
        return self.shard(node, result, ins)

    def matmul(self, node: torch.fx.Node, mm: tuple[Any, Any, Any, int]) -> None:
        x, weight, _, out_dim = mm
        xs = self.out.values.get(x.name)
        w = value_of(weight)
        if xs is None:  # column-parallel: the start of a region
            rows = w.shape[out_dim]
            self.out.roles[node.name] = "column"
            self.region[node.name] = node.name
            self.parent.setdefault(node.name, node.name)
            self.out.values[node.name] = Shard(value_of(node).dim() - 1, rows, self.groups.get(node.name, 1))
            return
        if xs.dim == value_of(x).dim() - 1 and xs.groups == 1:
            self.out.roles[node.name] = "row"
            self.region[node.name] = self.join([x]) or node.name
            return
        self.fail([x], f"{node.name} multiplies a tensor split along dim {xs.dim}, not its features")

    def rule(self, node: torch.fx.Node, name: str) -> Shard | list[Shard | None] | None:
        """The shard of ``node``'s output from its inputs' (None: the op cannot run on shards)."""
        a = node_args(node)
        if node.target is operator.getitem and a[0].name in self.split_outputs:
            return self.split_outputs[a[0].name][a[1]]
        if name in ("split", "split_with_sizes") and shard_of(a[0], self.out.values):
            return self.split(node, self.out.values[a[0].name], list(value_of(a[0]).shape))
        if name == "cross_entropy_loss":
            return self.loss(node)
        return carry(node, name, self.out.values, self.tp, self.out.scatters)

    def split(self, node: torch.fx.Node, s: Shard, ishape: list[int]) -> list[Shard | None] | None:
        a = node_args(node)
        dim: Any = a[2] if len(a) > 2 else node.kwargs.get("dim", 0)
        d = int(dim) % len(ishape)
        outs = list(value_of(node))
        if d != s.dim:
            return [s] * len(outs)
        sizes = [int(t.shape[d]) for t in outs]
        if len(set(sizes)) != 1 or sizes[0] % self.tp:
            return None
        if s.groups == 1 and len(sizes) > 1:
            origin = [k for k, r in self.out.roles.items() if r == "column" and self.root(k) == self.root(
                self.region[a[0].name])]
            if len(origin) == 1 and origin[0] not in self.groups:
                self.groups[origin[0]] = len(sizes)
                raise _Restart
            return None
        return [Shard(d, sizes[0], 1)] * len(outs) if s.groups == len(sizes) else None

    def loss(self, node: torch.fx.Node) -> Shard | None:
        s = self.out.values.get(node_args(node)[0].name)
        a = list(node_args(node)) + [None] * 6
        if s is None or value_of(node_args(node)[0]).dim() != 2 or s.dim != 1 or s.groups != 1 or a[2] is not None \
                or (a[5] or node.kwargs.get("label_smoothing", 0.0)) or node.kwargs.get("weight") is not None:
            return None
        return Shard(0, 0)  # marker; the loss itself is whole


def find_sharding(gm: torch.fx.GraphModule, tp: int, shardable: Collection[str] | None = None) -> Sharding:
    """Megatron's sharding of the traced graph ``gm`` for ``tp`` ranks (see the module docstring). ``shardable``:
    the parameters that may be split (None: all); matmuls and embeddings by others stay whole, unreported."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be at least 1, got {tp}")
    excluded = _excluded(gm, shardable)
    disabled: dict[str, str] = dict(excluded)
    groups: dict[str, int] = {}
    while True:
        walk = _Walk(gm, tp, disabled, groups)
        try:
            out = walk.run()
        except _Restart:
            continue
        failed = dict(walk.failed)
        failed.update(_param_conflicts(gm, walk, tp))
        if not failed:
            break
        for node in [k for k in walk.out.roles if walk.root(walk.region.get(k, k)) in failed]:
            if walk.out.roles[node] in ("column", "embedding", "row"):
                disabled[node] = failed[walk.root(walk.region.get(node, node))]
    out.replicated = {k: v for k, v in disabled.items() if k not in excluded}
    _finish(gm, out)
    return out


def _excluded(gm: torch.fx.GraphModule, shardable: Collection[str] | None) -> dict[str, str]:
    """The matmuls and embeddings whose weight is not in ``shardable``."""
    if shardable is None:
        return {}
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        mm = _matmul(node, gm)
        weight = mm[1] if mm is not None else node_args(node)[0] if op_name(node) == "embedding" else None
        if weight is not None and _param(weight, gm) and str(weight.target) not in shardable:
            out[node.name] = f"tensor parallelism is off for {weight.target}"
    return out


def _param_conflicts(gm: torch.fx.GraphModule, walk: _Walk, tp: int) -> dict[str, str]:
    """Regions whose weights another op reads whole or sharded differently (a tie outside embedding and head)."""
    wanted: dict[str, dict[str, Shard | None]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        role = walk.out.roles.get(node.name)
        mm = _matmul(node, gm)
        for n in node_inputs(node):
            if not _param(n, gm):
                continue
            shard: Shard | None = None
            if role == "column" and mm is not None and n is mm[1]:
                s = walk.out.values[node.name]
                shard = Shard(mm[3], s.size, s.groups)
            elif role == "column" and mm is not None and n is mm[2]:
                s = walk.out.values[node.name]
                shard = Shard(0, s.size, s.groups)
            elif role == "row" and mm is not None and n is mm[1]:
                shard = Shard(1 - mm[3], value_of(n).shape[1 - mm[3]])
            elif role == "embedding" and n is node_args(node)[0]:
                shard = Shard(0, value_of(n).shape[0])
            wanted.setdefault(str(n.target), {})[node.name] = shard
    failed: dict[str, str] = {}
    for target, uses in wanted.items():
        kinds = set(uses.values())
        if len(kinds) > 1:
            for user, shard in uses.items():
                if shard is not None and user in walk.region:
                    failed[walk.root(walk.region[user])] = (f"its weight {target} is also read "
                                                            f"{'whole' if None in kinds else 'split differently'} "
                                                            f"by {', '.join(sorted(u for u in uses if u != user))}")
        elif None not in kinds:
            walk.out.params[target] = kinds.pop()  # type: ignore[assignment]
    return failed


def _finish(gm: torch.fx.GraphModule, out: Sharding) -> None:
    """Record the whole floating-point values that sharded ops read: Megatron's ``f`` goes after each (not after
    those read in slices: the slices' backward gathers the whole gradient already)."""
    sharded_ops = {n for n, r in out.roles.items() if r in ("column", "row", "loss")} | set(out.values)
    sliced = {(user, name) for user, inputs in out.scatters.items() for name, _, _ in inputs}
    seen: list[str] = []
    for node in gm.graph.nodes:
        if node.name not in sharded_ops or out.roles.get(node.name) == "embedding":
            continue
        for n in node_inputs(node):
            v = value_of(n)
            if n.name not in out.values and n.op != "get_attr" and isinstance(v, torch.Tensor) \
                    and (node.name, n.name) not in sliced \
                    and v.is_floating_point() and n.name not in seen and out.roles.get(node.name) != "row":
                seen.append(n.name)
    out.copies = seen
