"""Pictures of a plan: the module graph as PNG/SVG (matplotlib) or Graphviz DOT, and the simulated schedule as a
Gantt chart or Chrome trace (:mod:`pipeline.timeline`).

The PNG lays the module graph (:mod:`smp.cli.graph`) out in topological layers, top to bottom, coloured by
stage; an edge that skips layers runs down a lane beside the drawing, one lane per source (a bus), so a tensor
read by every block stays readable. Cut edges are bold and labelled with their bytes per microbatch.
"""
from __future__ import annotations

import os
from typing import Any

from partitioner.units import format_bytes
from smp.cli.errors import CLIError
from smp.cli.graph import module_graph, stage_color
from smp.cli.text import ms

__all__ = ["write_dot", "write_graph_png", "write_graph", "write_timeline"]

def _node_text(node: dict) -> str:
    return f"{node['label']}\n{node['ops']} ops" + (f", {ms(node['cost_s'])} ms" if node["cost_s"] else "")


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_dot(plan: Any, graph: Any, path: str) -> None:
    """Graphviz text: one cluster per stage (filled with the stage's colour), cut edges labelled with bytes."""
    nodes, edges = module_graph(plan, graph)
    k = plan.num_stages
    out = ["digraph smp_plan {",
           f"  graph [rankdir=TB, fontname=Helvetica, label={_dot_quote(_graph_title(plan))}];",
           '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
           "  edge [fontname=Helvetica, fontsize=9, color=\"#555555\"];"]
    for s in range(k):
        col = stage_color(s, k)
        st = plan.stages[s]
        out.append(f"  subgraph cluster_stage{s} {{")
        out.append(f"    label={_dot_quote(f'stage {s}: {st.nodes} ops, {ms(st.cost_s)} ms')}; "
                   f"color={_dot_quote(col)}; penwidth=2;")
        for node in nodes:
            if node["stage"] == s:
                out.append(f"    n{node['id']} [label={_dot_quote(_node_text(node))}, fillcolor={_dot_quote(col)}];")
        out.append("  }")
    for e in edges:
        if e["cut"]:
            out.append(f"  n{e['src']} -> n{e['dst']} [label={_dot_quote(format_bytes(e['bytes']))}, color=black, "
                       "penwidth=2.5];")
        else:
            out.append(f"  n{e['src']} -> n{e['dst']};")
    out.append("}")
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")


def _graph_title(plan: Any) -> str:
    target = plan.extra.get("target", "model")
    return (f"{target}: {plan.num_stages} stages ({plan.method}), balance {plan.balance:.3f}, "
            f"cut {format_bytes(plan.cut_bytes)} per microbatch")


def _layers(nodes: list[dict], edges: list[dict]) -> list[int]:
    """Topological layer of every node: longest path from a source (networkx; cycles are condensed), with
    nodes that read nothing (T5's decoder mask) moved down to just above their first reader."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(len(nodes)))
    g.add_edges_from((e["src"], e["dst"]) for e in edges)
    if nx.is_directed_acyclic_graph(g):
        layer_of = {v: i for i, gen in enumerate(nx.topological_generations(g)) for v in gen}
        layer = [layer_of[v] for v in range(len(nodes))]
    else:
        c = nx.condensation(g)
        layer_c = {v: i for i, gen in enumerate(nx.topological_generations(c)) for v in gen}
        layer = [layer_c[c.graph["mapping"][v]] for v in range(len(nodes))]
    for v in range(len(nodes)):
        if g.in_degree(v) == 0 and g.out_degree(v) > 0:
            layer[v] = max(layer[v], min(layer[w] for w in g.successors(v)) - 1)
    return layer


def write_graph_png(plan: Any, graph: Any, path: str) -> None:
    """Draw the module graph with matplotlib: layers top to bottom, nodes coloured by stage, cut edges bold
    and labelled with the bytes they carry per microbatch. An edge that skips layers runs down a lane beside
    the drawing, one lane per source (a bus), so a tensor read by every block stays readable.
    ``.svg`` or ``.png`` by the file name."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise CLIError("drawing --graph as an image needs matplotlib: pip install 'smp-engine[viz]' "
                       "(or write .dot)") from None
    nodes, edges = module_graph(plan, graph)
    k = plan.num_stages
    layer = _layers(nodes, edges)
    by_layer: dict[int, list[int]] = {}
    for v in sorted(range(len(nodes)), key=lambda v: (layer[v], v)):
        by_layer.setdefault(layer[v], []).append(v)
    gap = 3.2
    pos: dict[int, tuple[float, float]] = {}
    for ly, members in by_layer.items():
        for j, v in enumerate(members):
            pos[v] = ((j - (len(members) - 1) / 2) * gap, -float(ly))
    # Long edges: one bus per source; buses whose layer spans overlap get different lanes, right then left.
    short = [e for e in edges if layer[e["dst"]] - layer[e["src"]] <= 1]
    buses: dict[int, list[dict]] = {}
    for e in edges:
        if layer[e["dst"]] - layer[e["src"]] > 1:
            buses.setdefault(e["src"], []).append(e)
    lane_end: list[int] = []
    lane_of: dict[int, int] = {}
    for src in sorted(buses, key=lambda s: (layer[s], s)):
        lo, hi = layer[src], max(layer[e["dst"]] for e in buses[src])
        free = next((i for i, end in enumerate(lane_end) if end < lo), None)
        if free is None:
            lane_end.append(hi)
            free = len(lane_end) - 1
        lane_end[free] = hi
        lane_of[src] = free
    width = max(len(m) for m in by_layer.values())
    span_x = (width - 1) * gap
    lane_gap = 0.42
    side_lanes = (len(lane_end) + 1) // 2
    half_x = span_x / 2 + 1.4 + lane_gap * side_lanes + 0.6
    fig_w = max(7.0, 0.8 * 2 * half_x + 2.6)
    fig_h = max(4.0, 0.62 * len(by_layer) + 1.6)
    fig = Figure(figsize=(fig_w, fig_h), dpi=min(110.0, 30000.0 / fig_h))  # stay far below Agg's size limit
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Fixed margins (no tight_layout afterwards): sizes below are converted between points and data units.
    fig.subplots_adjust(left=0.02, right=1.0 - 2.3 / fig_w, top=1.0 - 0.45 / fig_h, bottom=0.02)
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(-half_x, half_x)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    bbox = ax.get_window_extent()
    x_per_pt = (2 * half_x) / (bbox.width * 72.0 / fig.dpi)
    fontsize = 8
    half_pt = {n["id"]: 0.31 * fontsize * max(len(s) for s in _node_text(n).split("\n")) + 6 for n in nodes}
    label_box = dict(boxstyle="round,pad=0.15", fc="#ffffdd", ec="#999999", lw=0.5)

    def style(cut: bool) -> dict:
        return dict(color="black" if cut else "#888888", lw=2.0 if cut else 0.9)

    for e in short:
        (x0, y0), (x1, y1) = pos[e["src"]], pos[e["dst"]]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", shrinkA=11, shrinkB=11, **style(e["cut"])))
        if e["cut"]:
            ax.text((x0 + x1) / 2 + 0.12, (y0 + y1) / 2, format_bytes(e["bytes"]), fontsize=7.5, ha="left", va="center",
                    bbox=label_box, zorder=3)
    labels_at: dict[tuple[int, int], int] = {}
    for src, bus in buses.items():
        lane = lane_of[src]
        side = 1 if lane % 2 == 0 else -1
        xs_edge = span_x / 2 + 1.4 + lane_gap * (lane // 2)
        lx = side * xs_edge
        (x0, y0) = pos[src]
        y_last = min(pos[e["dst"]][1] for e in bus)
        cut_any = any(e["cut"] for e in bus)
        # Down half a layer first, so the trunk runs between rows rather than through this row's nodes.
        ax.plot([x0, x0, lx, lx], [y0, y0 - 0.5, y0 - 0.5, y_last], zorder=0, solid_joinstyle="round",
                **style(cut_any))
        for e in bus:
            x1, y1 = pos[e["dst"]]
            ax.annotate("", xy=(x1, y1), xytext=(lx, y1), zorder=1,
                        arrowprops=dict(arrowstyle="-|>", shrinkA=0, shrinkB=half_pt[e["dst"]], **style(e["cut"])))
            if e["cut"]:
                n = labels_at.get((e["dst"], side), 0)
                labels_at[(e["dst"], side)] = n + 1
                edge_x = x1 + side * (half_pt[e["dst"]] * x_per_pt + 0.05)
                ax.text(edge_x, y1 + 0.13 + 0.2 * n, format_bytes(e["bytes"]), fontsize=7, va="bottom",
                        ha="left" if side > 0 else "right", bbox=label_box, zorder=3)
    for node in nodes:
        x, y = pos[node["id"]]
        ax.text(x, y, _node_text(node), ha="center", va="center", fontsize=fontsize, zorder=2,
                bbox=dict(boxstyle="round,pad=0.35", fc=stage_color(node["stage"], k), ec="black", lw=0.6))
    ax.axis("off")
    handles = [Patch(facecolor=stage_color(s, k), edgecolor="black",
                     label=f"stage {s}: {ms(plan.stages[s].cost_s)} ms") for s in range(k)]
    handles.append(Patch(facecolor="white", edgecolor="black", label="bold: cut (bytes/microbatch)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(_graph_title(plan), fontsize=10)
    fig.savefig(path)


def write_graph(plan: Any, graph: Any, path: str) -> None:
    """``--graph``: the module graph as DOT, PNG or SVG, by the file name."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".dot":
        write_dot(plan, graph, path)
    elif ext in (".png", ".svg"):
        write_graph_png(plan, graph, path)
    else:
        raise CLIError(f"--graph {path!r}: write .png, .svg or .dot")


def write_timeline(sim: Any, path: str, title: str | None = None) -> None:
    """``--timeline``: the simulated schedule as a Gantt chart (.png) or a Chrome trace (.json)."""
    from pipeline import timeline

    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        timeline.to_chrome_trace(sim.events, path)
    elif ext == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--timeline .png needs matplotlib: pip install 'smp-engine[viz]' (or write .json)") from None
        timeline.to_png(sim.events, path, title=title)
    else:
        raise CLIError(f"--timeline {path!r}: write .png (Gantt chart) or .json (Chrome trace)")


