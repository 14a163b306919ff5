"""Executable stages: one ``torch.fx.GraphModule`` per stage, cut out of the traced graph.

Each stage graph copies its ops from the traced graph in their original order; a value it reads from an
earlier stage, or a model input, becomes a placeholder named after the value. Each stage returns the values
that later stages read (a tensor that skips stages is returned once and delivered to every reader), and the
last stage returns the model's flat outputs. Model inputs that are tensors enter at stage 0, which also
returns those that later stages read (labels for a loss computed in the model, attention masks): only the
first pipeline rank needs the step's data. Inputs that are not tensors were traced in as constants. Parameters
are fetched with ``get_attr`` from the model's own tensors (``GraphModule`` copies attribute *references*), so
a stage trains the user's ``nn.Parameter`` objects in place, and a weight used on two stages (tied embeddings)
is one tensor whose gradient sums over both when the stages run in one process.

We build the stage graphs ourselves rather than with ``torch.fx.passes.split_module`` because the runtime
needs, per stage, exactly which values it receives from and sends to which stage; that is the
bookkeeping this file does.

torch.export bakes the model's train/eval mode into the graph as a literal flag of each mode-dependent op
(dropout, batch and instance norm, rrelu) and as BatchNorm's ``num_batches_tracked += 1``, which Python
runs only in training. The stages read that flag from their own ``training`` attribute instead, so
``stage.eval()`` / ``stage.train()`` behave as on the original model, whatever mode it was traced in.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import EngineError
from .chunk import merge_weight_slices
from .graph import OpGraph
from .mutation import written_inputs
from .program import TracedProgram, flatten_inputs, tensor_aliases

__all__ = ["Stage", "SplitModel", "split", "MODEL_INPUT", "MetaTensorError", "check_runnable"]

class MetaTensorError(EngineError, RuntimeError):
    """Something was asked to run on a model built on the meta device, whose tensors hold no data."""


def check_runnable(module: torch.nn.Module, what: str, inputs: Any = ()) -> None:
    """Raise :class:`MetaTensorError` naming the first few meta tensors of ``module`` (or of ``inputs``):
    a model built on the meta device can be traced and planned, but nothing of it can run or be timed."""
    meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    meta += [f"input {i}" for i, t in enumerate(pytree.tree_leaves(inputs))
             if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise MetaTensorError(f"cannot {what}: {shown} are on the meta device (built without weights), so there is "
                              "nothing to run; plan on meta, then run the model materialised (smp.DistributedModel "
                              "materialises each rank's own stages; or build it on a real device)")


MODEL_INPUT = -1  # the "stage" a model input comes from: the step's data on stage 0, a traced constant elsewhere


@dataclass
class Stage:
    """One executable stage and its wiring."""

    index: int
    module: torch.fx.GraphModule
    inputs: list[str]                    # placeholder order: value names
    outputs: list[str]                   # return order: value names (for the last stage, model outputs)
    sources: dict[str, int]              # input value -> producing stage, MODEL_INPUT for the step's data
                                         # (stage 0) and traced constants (any stage)
    consumers: dict[str, list[int]]      # output value -> stages that read it (empty on the last stage)
    param_names: dict[str, str] = field(default_factory=dict)  # local attribute path -> canonical name


@dataclass
class SplitModel:
    """The stages of a plan, the traced program they came from, and the example value of every value that
    crosses stages (its shape and dtype size the receive buffers)."""

    stages: list[Stage]
    program: TracedProgram
    value_meta: dict[str, Any]           # value name -> example value (shape/dtype of what crosses stages)

    def as_module(self) -> "StagedModule":
        """All stages as one module with the model's signature (see :class:`StagedModule`)."""
        check_runnable(self.program.module, "run the staged model")
        return StagedModule(self)

    def check_inputs(self, flat: list[Any]) -> None:
        """Stages are specialised to the traced shapes: say so plainly instead of failing inside an op."""
        for name, got, want in zip(self.program.input_names, flat, self.program.input_meta):
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor):
                    raise TypeError(f"input {name!r} was traced as a tensor, got {type(got).__name__}")
                if tuple(got.shape) != tuple(want.shape):
                    whole = (got.ndim == want.ndim > 0 and got.shape[1:] == want.shape[1:] and 0 < got.shape[0]
                             < want.shape[0] and want.shape[0] % got.shape[0] == 0)
                    raise ValueError(f"input {name!r} has shape {tuple(got.shape)} but the model was traced "
                                     f"with {tuple(want.shape)}; stages are specialised to the traced shapes: "
                                     "keep the (micro)batch shape fixed or partition again for the new shape"
                                     + (f"; it was traced on {want.shape[0] // got.shape[0]} microbatches (the whole "
                                        f"batch?): example inputs are one microbatch, {name}[:{got.shape[0]}] here"
                                        if whole else ""))
                if got.dtype != want.dtype:
                    raise ValueError(f"input {name!r} has dtype {got.dtype} but the model was traced with "
                                     f"{want.dtype}; convert the input or partition again with that dtype")
            elif isinstance(got, torch.Tensor) or not _same_constant(got, want):
                raise ValueError(f"input {name!r} was traced as the constant {want!r} and the stages are "
                                 f"specialised to it, but got {got!r}; partition again with that value")


def _same_constant(got: Any, want: Any) -> bool:
    try:
        return type(got) is type(want) and bool(got == want)
    except Exception:  # objects without a usable ==: trust the caller
        return True


class StagedModule(torch.nn.Module):
    """All stages in order, in one process, with the original model's call signature and output type."""

    def __init__(self, split_model: SplitModel):
        super().__init__()
        self.split_model = split_model
        self.stages = torch.nn.ModuleList([s.module for s in split_model.stages])
        self.train(split_model.program.training)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run every stage in order on the model's inputs; return the model's output object."""
        sm = self.split_model
        flat = flatten_inputs(sm.program, args, kwargs)
        sm.check_inputs(flat)
        values: dict[str, Any] = dict(zip(sm.program.input_names, flat))
        outs: tuple = ()
        for stage in sm.stages:
            outs = stage.module(*[values[n] for n in stage.inputs])
            values.update(zip(stage.outputs, outs))
        return pytree.tree_unflatten(list(outs), sm.program.out_spec)


def split(graph: OpGraph, assignment: dict[str, int], num_stages: int) -> SplitModel:
    """Cut the traced graph behind ``graph`` into ``num_stages`` executable stages."""
    prog: TracedProgram = graph.fx
    gm = prog.module
    stage_of_op = [assignment[name] for name in graph.names]
    stage_of: dict[str, int] = {name: stage_of_op[i] for name, i in prog.op_of.items()}
    last = num_stages - 1
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "output")]
    out_node = next(n for n in nodes if n.op == "output")
    stage_of[out_node.name] = last

    # Pass 1: what each stage must receive, and who reads what each stage produces. Model inputs that are
    # tensors enter at stage 0, which forwards those later stages read: only the first pipeline rank needs
    # the step's data (as in SMP, where pp_rank 0's inputs are the truth). Constants are traced in.
    for name, meta in zip(prog.input_names, prog.input_meta):
        if isinstance(meta, torch.Tensor):
            stage_of[name] = 0
    needed: list[dict[str, torch.fx.Node]] = [{} for _ in range(num_stages)]
    readers: dict[str, set[int]] = {}
    for node in nodes:
        s = stage_of[node.name]
        for inp in node.all_input_nodes:
            if inp.op == "placeholder" and inp.name not in stage_of:  # a constant: every stage has it
                needed[s].setdefault(inp.name, inp)
            elif inp.name in stage_of and stage_of[inp.name] != s:
                if stage_of[inp.name] > s:
                    raise ValueError(f"assignment is cyclic: {inp.name} on stage {stage_of[inp.name]} "
                                     f"feeds {node.name} on stage {s}")
                needed[s].setdefault(inp.name, inp)
                readers.setdefault(inp.name, set()).add(s)
            elif inp.op == "placeholder":
                needed[s].setdefault(inp.name, inp)
    for name in prog.input_names:  # stage 0 takes every model input it forwards
        if name in readers:
            needed[0].setdefault(name, next(n for n in gm.graph.nodes if n.name == name))

    # Pass 2: build each stage graph. A value received from another stage that this stage mutates in place
    # (HF ResNet's ``hidden += residual`` is ``aten.add_``) is cloned first: a pipeline stage gets its
    # inputs as fresh autograd leaves, and an in-place op on a leaf that requires grad is an error.
    mutated = [{n.name for n in written_inputs(node) if n.name in needed[stage_of[node.name]]
                and n.op != "placeholder"} for node in nodes]
    graphs = [torch.fx.Graph() for _ in range(num_stages)]
    envs: list[dict[str, torch.fx.Node]] = [{} for _ in range(num_stages)]
    for s in range(num_stages):
        written = set().union(*(m for node, m in zip(nodes, mutated) if stage_of[node.name] == s))
        for name, src in needed[s].items():
            ph = graphs[s].placeholder(name)
            ph.meta = dict(src.meta)
            envs[s][name] = ph
        for name in needed[s]:
            if name in written:
                copy = graphs[s].call_function(torch.ops.aten.clone.default, (envs[s][name],))
                copy.meta = dict(needed[s][name].meta)
                envs[s][name] = copy
    for node in nodes:
        s = stage_of[node.name]
        g, env = graphs[s], envs[s]

        def lookup(m: torch.fx.Node, g=g, env=env) -> torch.fx.Node:
            if m.name not in env:  # only get_attr is left: parameters and buffers
                env[m.name] = g.get_attr(m.target)
                env[m.name].meta = dict(m.meta)
            return env[m.name]

        if node.op == "output":
            g.output(torch.fx.node.map_arg(node.args[0], lookup))
        else:
            env[node.name] = _follow_module_mode(g.node_copy(node, lookup), g)

    alias = tensor_aliases(gm)
    stages: list[Stage] = []
    value_meta: dict[str, Any] = {}
    for s in range(num_stages):
        outputs = [n.name for n in nodes if stage_of[n.name] == s and n.name in readers and n.op != "output"]
        if s == 0:
            outputs = [n for n in prog.input_names if n in readers] + outputs
        if s != last:
            graphs[s].output(tuple(envs[s][n] for n in outputs))
        else:
            outputs = [a.name if isinstance(a, torch.fx.Node) else repr(a)
                       for a in pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: isinstance(x, torch.fx.Node))]
        merge_weight_slices(graphs[s], gm)
        module = torch.fx.GraphModule(gm, graphs[s], class_name=f"Stage{s}").train(prog.training)
        attrs = [n.target for n in graphs[s].nodes if n.op == "get_attr"
                 and isinstance(operator.attrgetter(n.target)(module), torch.Tensor)]
        for name, node in needed[s].items():
            value_meta[name] = node.meta.get("val")
        stages.append(Stage(
            index=s, module=module, inputs=list(needed[s]), outputs=outputs,
            sources={name: (MODEL_INPUT if node.op == "placeholder" and s == 0 or name not in stage_of
                            else stage_of[name]) for name, node in needed[s].items()},
            consumers={name: sorted(readers[name]) for name in outputs if name in readers} if s != last else {},
            param_names={a: alias.get(a, a) for a in attrs},
        ))
    return SplitModel(stages=stages, program=prog, value_meta=value_meta)


_MODE_ARGS = ("train", "training", "use_input_stats")


def _add_if_training(counter: torch.Tensor, other: Any, training: bool) -> None:
    if training:
        counter.add_(other)


def _follow_module_mode(node: torch.fx.Node, g: torch.fx.Graph) -> torch.fx.Node:
    """Make a copied op read the stage's ``self.training`` where the trace baked in a constant mode."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not node.args:
        return node
    counter = node.args[0]
    if node.target is torch.ops.aten.add_.Tensor and isinstance(counter, torch.fx.Node) \
            and counter.op == "get_attr" and isinstance(counter.target, str) \
            and counter.target.endswith("num_batches_tracked"):
        node.target, node.args = _add_if_training, (*node.args, _training(g, node))
        return node
    names = [a.name for a in schema.arguments]
    at = next((i for i, n in enumerate(names) if n in _MODE_ARGS), None)
    if at is None or _no_running_stats(node, names):
        return node
    # Arguments the trace left to their defaults (eval-mode rrelu has none after the input) are spelled out.
    args = list(node.args) + [node.kwargs.get(a.name, a.default_value) for a in schema.arguments[len(node.args):at]]
    node.args = (*args[:at], _training(g, node), *args[at + 1:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if names.index(k) > at}
    return node


def _no_running_stats(node: torch.fx.Node, names: list[str]) -> bool:
    """A norm without running statistics uses batch statistics in both modes: its flag stays as traced."""
    if "running_mean" not in names:
        return False
    i = names.index("running_mean")
    return (node.args[i] if i < len(node.args) else node.kwargs.get("running_mean")) is None


def _training(g: torch.fx.Graph, user: torch.fx.Node) -> torch.fx.Node:
    """The stage module's ``training`` flag: one ``get_attr`` per graph, placed before its first user."""
    found = next((n for n in g.nodes if n.op == "get_attr" and n.target == "training"), None)
    if found is None:
        with g.inserting_before(user):
            found = g.get_attr("training")
    return found
