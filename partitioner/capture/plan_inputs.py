"""The example inputs a plan was made from: one microbatch's shapes and dtypes, recorded in the plan.

Example inputs are **one microbatch**, everywhere an API takes them to trace or plan a model
(:func:`partitioner.trace`, :func:`partitioner.partition`, ``smp.engine.planning.pipeline_runner``,
``pipeline.PipelineRunner.from_plan_file``, the factories of the ``smp`` command), as
``torch.distributed.pipelining.pipeline(module, mb_args)`` takes them: the plan is made per microbatch (its costs, cut
bytes and activation memory are per microbatch) and its stages run microbatches. Step inputs are the whole batch.

A plan records the tensor inputs of its trace as ``inputs``: placeholder name -> ``{"shape": [...], "dtype": ...}``.
``PartitionPlan.bind(graph, source, microbatches=m)`` compares them with a trace of the example inputs given, so a
plan used with inputs of other shapes (the whole batch, say) is a ``PlanMismatchError`` that names both shapes when
the runner is made, not a shape error in the first step. A dimension recorded as ``null`` matches any size (a
dynamic dimension); a plan without the record (older files, synthetic graphs) is not checked. A malformed record
is a ``PlanMismatchError`` (a ``PlanError``) naming the value when it is checked. :func:`traced_call` names the call
the record was traced from (``model(input_ids)``), which ``smp plan --config`` prints when it writes a plan.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["input_record", "inputs_mismatch", "inputs_named_apart", "record_at_batch", "traced_call"]


def input_record(graph: Any) -> dict[str, dict[str, Any]]:
    """Name -> ``{"shape": [sizes], "dtype": "float32"}`` of every tensor input of ``graph``'s trace (empty for a
    graph without one); a symbolic (dynamic) size is ``None``."""
    fx = getattr(graph, "fx", None)
    if fx is None:
        return {}
    return {name: {"shape": [d if isinstance(d, int) else None for d in meta.shape],
                   "dtype": str(meta.dtype).removeprefix("torch.")}
            for name, meta in zip(fx.input_names, fx.input_meta) if isinstance(meta, torch.Tensor)}


def record_at_batch(record: dict[str, dict[str, Any]], size: int) -> dict[str, dict[str, Any]]:
    """``record`` (:func:`input_record`) with its batch dimension at ``size``: the leading dimension of its first
    input with one, and of every input of that leading size (as :func:`partitioner.layout.costs.with_batch` rescales
    example inputs); for a plan priced at a microbatch size it was not traced at."""
    leads = [e["shape"][0] for e in record.values() if e["shape"]]
    if not leads or not isinstance(leads[0], int):
        return dict(record)
    return {name: {**e, "shape": [size, *e["shape"][1:]]} if e["shape"] and e["shape"][0] == leads[0] else dict(e)
            for name, e in record.items()}


def inputs_mismatch(record: dict[str, Any], graph: Any, microbatches: int | None) -> str | None:
    """Why ``graph`` (a trace of example inputs meant as one microbatch of a step in ``microbatches``) does not have
    the shapes and dtypes of ``record`` (a plan's ``inputs``), or None when it has them, when ``microbatches`` is
    None, or when there is nothing to compare; a malformed record says so, naming the value. Inputs named
    differently are left to the check of the ops (another model's inputs)."""
    if microbatches is None or not record:
        return None
    bad = [f"inputs[{name!r}]: expected {{'shape': [sizes], 'dtype': '...'}}, got {entry!r}"
           for name, entry in record.items() if not _well_formed(entry)]
    if bad:
        return f"has a malformed record of its example inputs: plan key {bad[0]}"
    wrong = [(name, record[name], got) for name, got in input_record(graph).items()
             if name in record and not _fits(record[name], got)]
    if not wrong:
        return None
    listed = "; ".join(f"input {name!r} is {_show(got)} here but {_show(want)} in the plan"
                       for name, want, got in wrong)
    return f"was made for example inputs of other shapes: {listed}. {_hint(wrong[0], microbatches)}"


def inputs_named_apart(record: dict[str, Any], graph: Any) -> str:
    """What to say of a plan whose ops are not ``graph``'s, as the end of a sentence that starts with "; ": which
    tensor inputs ``graph``'s trace has that ``record`` (a plan's ``inputs``) has not and the other way round (a step
    that passes ``labels=`` to a model planned from ``(input_ids,)`` traces the loss too, so the plan misses those
    ops), or, when the names agree or there is no record, that the plan was made for another model."""
    here = input_record(graph)
    extra, absent = [n for n in here if n not in record], [n for n in record if n not in here]
    if not record or not here or (not extra and not absent):
        return ("; it was made for another model or other inputs. Make the plan from this model: smp replan on a "
                "profile of it, or partitioner.partition")
    said = [f"this call passes {extra} that the plan's example inputs did not" if extra else "",
            f"the plan's example inputs had {absent} that this call does not pass" if absent else ""]
    return (f"; the inputs differ: {' and '.join(s for s in said if s)} (the plan: {sorted(record)}; this call: "
            f"{sorted(here)}). Call the model with the inputs the plan was made from, or make the plan from a "
            "factory that returns the inputs the step passes (smp plan / smp inspect TARGET)")


def traced_call(record: dict[str, Any]) -> str:
    """The call a plan was traced from, by its ``inputs`` record (:func:`input_record`): ``model(input_ids)``, each
    tensor input by name; a step that calls the model with other inputs (``labels=`` too) runs other ops."""
    return f"model({', '.join(record)})"


def _well_formed(entry: Any) -> bool:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    return (isinstance(shape, list) and isinstance(entry.get("dtype"), str)
            and all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape))


def _fits(want: dict[str, Any], got: dict[str, Any]) -> bool:
    ws, gs = want["shape"], got["shape"]
    return (want["dtype"] == got["dtype"] and len(ws) == len(gs)
            and all(w is None or g is None or w == g for w, g in zip(ws, gs)))


def _show(entry: dict[str, Any]) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in entry["shape"])
    return f"{entry['dtype']} ({dims}{',' if len(entry['shape']) == 1 else ''})"


def _hint(first: tuple[str, dict[str, Any], dict[str, Any]], microbatches: int) -> str:
    """What to do: pass one microbatch of the plan's shapes (the whole batch named as such), or re-plan."""
    name, want, got = first
    ws, gs = want["shape"], got["shape"]
    whole = (len(ws) == len(gs) > 0 and isinstance(ws[0], int) and isinstance(gs[0], int) and ws[0] > 0
             and gs[0] == ws[0] * microbatches > ws[0] and ws[1:] == gs[1:])
    again = "make a plan from these inputs (partitioner.partition, smp inspect --json)"
    if whole:
        return (f"These look like the whole batch of {gs[0]} ({microbatches} microbatches of {ws[0]}): example inputs "
                f"are one microbatch, {name}[:{ws[0]}] here; or {again}")
    return f"Example inputs are one microbatch, of the shapes the plan was made from; or {again}"
