"""The op graph collapsed to module level, for pictures of a plan (:mod:`smp.cli.drawing`).

Ops are grouped by module path cut at the repeated-block level (``transformer.h.3``, ``blocks.4``), so a
12-layer transformer becomes about 17 nodes; a group split between stages appears once per stage. Edges carry
the bytes of the distinct tensors they move per microbatch, and ``cut`` edges cross stages.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["stage_color", "is_ancestor", "group_ops", "module_graph"]

_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
            "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]


def stage_color(stage: int, num_stages: int) -> str:
    """Hex colour of a stage: matplotlib's tab10/tab20, then evenly spaced hues for more stages."""
    if num_stages <= len(_PALETTE):
        return _PALETTE[stage]
    import colorsys

    h = (stage * 0.618033988749895) % 1.0
    r, g, b = colorsys.hsv_to_rgb(h, 0.55, 0.9)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


_BLOCK_AT = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")


def is_ancestor(a: str, b: str) -> bool:
    """Module path ``a`` contains ``b`` (the root ``""`` contains everything)."""
    return a != b and (a == "" or b.startswith(a + "."))


def _group_key(module: str) -> str:
    """A module path truncated after its first numbered segment (``transformer.h.3.attn`` -> ``transformer.h.3``),
    else to two levels (``bert.embeddings.LayerNorm`` -> ``bert.embeddings``)."""
    hit = _BLOCK_AT.match(module)
    if hit:
        return hit.group(1)
    return ".".join(module.split(".")[:2])


def group_ops(modules: Sequence[str], small: int = 4) -> list[str]:
    """Group key of every op (in topological order).

    Keys are module paths truncated at the repeated-block level (:func:`_group_key`). A short run (fewer than
    ``small`` ops) of a container's own ops between its children (GPT-2's position ids, UNet's pooling, the
    final output) joins the run before it (the run after it, at the very start); a longer one (GPT-2's
    attention-mask arithmetic) stays a group of its own, named after the container.
    """
    keys = [_group_key(m) for m in modules]
    runs: list[list] = []  # [key, start, length]
    for i, k in enumerate(keys):
        if runs and runs[-1][0] == k:
            runs[-1][2] += 1
        else:
            runs.append([k, i, 1])

    def container(j: int) -> bool:
        k = runs[j][0]
        near = [runs[x][0] for x in (j - 1, j + 1) if 0 <= x < len(runs)]
        return runs[j][2] < small and any(is_ancestor(k, o) for o in near)

    names = [r[0] for r in runs]
    for j in range(len(runs)):
        if container(j) and j > 0:
            names[j] = names[j - 1]
    for j in range(len(runs) - 1, -1, -1):
        if j == 0 or names[j] != runs[j][0] or not container(j):
            continue
        if j + 1 < len(runs):  # a container run at the very start joins what follows
            names[j] = names[j + 1]
    lead = 0
    while lead + 1 < len(runs) and container(lead):
        lead += 1
    for j in range(lead):
        names[j] = names[lead]
    out: list[str] = []
    for name, (_, _, length) in zip(names, runs):
        out.extend([name] * length)
    return out


def module_graph(plan: Any, graph: Any) -> tuple[list[dict], list[dict]]:
    """The op graph collapsed to module level: one node per (module group, stage), edges with the bytes of
    the distinct tensors they carry per microbatch; ``cut`` edges cross stages."""
    n = graph.num_nodes
    eff = group_ops(graph.modules)
    stage = plan.stage_of_ops(graph).tolist()
    try:
        from partitioner import DeviceRates, estimate

        cost = estimate(graph, DeviceRates(**plan.rates) if plan.rates else None).total_s
    except (TypeError, ValueError):  # rates of another version: a picture without timings is still a picture
        cost = None
    ids: dict[tuple[str, int, int], int] = {}
    nodes: list[dict] = []
    op_group = []
    occurrence: dict[str, int] = {}  # a module run again later (T5's shared dropout) is a new node
    for i in range(n):
        if i == 0 or eff[i] != eff[i - 1]:
            occurrence[eff[i]] = occurrence.get(eff[i], -1) + 1
        key = (eff[i], stage[i], occurrence[eff[i]])
        if key not in ids:
            ids[key] = len(nodes)
            nodes.append({"id": len(nodes), "module": eff[i] or "(root)", "stage": stage[i], "ops": 0,
                          "flops": 0.0, "cost_s": 0.0})
        g = ids[key]
        op_group.append(g)
        nodes[g]["ops"] += 1
        nodes[g]["flops"] += float(graph.flops[i])
        if cost is not None:
            nodes[g]["cost_s"] += float(cost[i])
    stages_of: dict[str, set[int]] = {}
    for m, s, _ in ids:
        stages_of.setdefault(m or "(root)", set()).add(s)
    for node in nodes:
        split_here = len(stages_of[node["module"]]) > 1
        node["label"] = node["module"] + (f" [s{node['stage']}]" if split_here else "")
    seen: set[tuple[int, int, int]] = set()
    edge_b: dict[tuple[int, int], int] = {}
    for s, d, v in zip(graph.src.tolist(), graph.dst.tolist(), graph.value.tolist()):
        a, b = op_group[s], op_group[d]
        if a == b or (v, a, b) in seen:
            continue
        seen.add((v, a, b))
        edge_b[(a, b)] = edge_b.get((a, b), 0) + int(graph.value_bytes[v])
    edges = [{"src": a, "dst": b, "bytes": nb, "cut": nodes[a]["stage"] != nodes[b]["stage"]}
             for (a, b), nb in sorted(edge_b.items())]
    return nodes, edges

