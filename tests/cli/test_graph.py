"""``smp.cli.graph``: the op graph collapsed to module level."""
from __future__ import annotations

from partitioner import partition, trace
from smp import zoo
from smp.cli.graph import group_ops, module_graph


def test_module_graph_collapses_blocks_and_labels_cuts() -> None:
    # Container ops between children join their neighbours; blocks collapse to their number.
    assert group_ops(["transformer", "transformer.wte", "transformer", "transformer.wpe",
                       "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.0",
                       "transformer.h.1.mlp", "transformer.ln_f", "lm_head", ""]) == [
        "transformer.wte", "transformer.wte", "transformer.wte", "transformer.wpe", "transformer.h.0",
        "transformer.h.0", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head", "lm_head"]
    z = zoo.build("unet")
    graph = trace(z.model, z.args, z.kwargs)
    plan = partition(graph, 3)
    nodes, edges = module_graph(plan, graph)
    assert len(nodes) <= 12  # 7 blocks + head, some split across two stages
    assert {n["stage"] for n in nodes} == {0, 1, 2}
    assert sum(n["ops"] for n in nodes) == graph.num_nodes
    cut = [e for e in edges if e["cut"]]
    assert cut and all(e["bytes"] > 0 for e in cut)
    assert all(nodes[e["src"]]["stage"] <= nodes[e["dst"]]["stage"] for e in edges)
    # UNet's skip connections cross from the down path to the up path.
    names = {n["id"]: n["module"] for n in nodes}
    assert any(names[e["src"]] == "blocks.0" and names[e["dst"]] == "blocks.6" for e in edges)
