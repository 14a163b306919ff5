"""``--tp T`` of ``smp inspect`` and ``smp simulate``: plan the graph that one tensor-parallel rank runs, and say
what tensor parallelism costs and what it leaves whole.

The graph is tp rank 0's (:func:`partitioner.tp.rank_zero.rank_zero_graph`): Megatron's pattern found on the traced
graph and written for rank 0, whose ops, parameters and activations have their local sizes and whose shards are its
group's largest, so a plan of it counts memory per rank, and its stage costs include the tp collectives on the link
within a node (:mod:`partitioner.tp.pricing`). What stays whole on every rank (sizes that do not divide, a weight tied
outside the embedding/head pair) is listed as a warning on stderr; a degree that leaves some rank no slice of a sharded
weight is refused (:func:`partitioner.tp.rank_zero.thin_params`). ``--tp 1`` changes nothing.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.errors import CLIError

__all__ = ["shard_target", "replicated_warnings", "warn", "tp_lines", "MAX_LISTED"]

MAX_LISTED = 12  # replicated layers named one per line; the rest are counted


def shard_target(graph: Any, tp: int, progress: Callable[[str], None] = lambda m: None,
                 sequence: bool = False) -> tuple[Any, Any]:
    """``(graph tp rank 0 runs, its Sharding)`` for degree ``tp`` (:func:`partitioner.tp.rank_zero.rank_zero_graph`;
    ``sequence``: ``--sequence-parallel``), what cannot be sharded refused in the command line's terms; ``(graph,
    None)`` for ``tp`` 1."""
    if tp == 1:
        return graph, None
    if graph.fx is None:
        raise CLIError(f"--tp {tp} needs a traced model, not a synthetic graph")
    from partitioner.tp.rank_zero import rank_zero_graph, thin_params

    progress(f"sharding for tensor parallelism of degree {tp} (Megatron's pattern)")
    try:
        local, sharding = rank_zero_graph(graph, tp, sequence)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise CLIError(f"--tp {tp}: cannot shard this model: {type(exc).__name__}: {exc}") from None
    thin = thin_params(sharding)
    if thin:
        size, name = thin[0]
        raise CLIError(f"--tp {tp} is more ranks than {name} has slices to share ({size} along the split "
                       f"dimension): ranks {size}..{tp - 1} would hold none of it; use --tp {size} or fewer")
    progress(f"tp rank 0 of {tp}: {local.describe()}")
    return local, sharding


def replicated_warnings(sharding: Any) -> list[str]:
    """One line per layer that ``sharding`` leaves whole on every tp rank, and why (at most :data:`MAX_LISTED`)."""
    tp = sharding.tp
    lines = []
    if not sharding.params:
        lines.append(f"warning: --tp {tp} splits no layer of this model (no column/row-parallel matmul pair or "
                     f"vocabulary with sizes that {tp} ranks can share): every tp rank holds and computes it all")
    items = sorted(sharding.replicated.items())
    if items:
        lines.append(f"warning: --tp {tp} leaves {len(items)} layer(s) whole on every tp rank (replicated):")
        lines += [f"  {node}: {why}" for node, why in items[:MAX_LISTED]]
        if len(items) > MAX_LISTED:
            lines.append(f"  ... and {len(items) - MAX_LISTED} more")
    return lines


def warn(lines: Sequence[str]) -> None:
    """Print warning lines on stderr (even with --quiet: they change what the numbers mean)."""
    for line in lines:
        print(f"smp: {line}", file=sys.stderr, flush=True)


def tp_lines(record: dict[str, Any], rates: dict[str, Any], microbatches: int, full_weights: float,
             local_weights: float, dtype: str, step_s: float | None = None) -> list[str]:
    """What tensor parallelism does to a plan: the degree and the sharding, the weights (in ``dtype``) a rank
    holds next to the whole model's, and the tp collectives' seconds per microbatch and per step (from a plan's
    ``tensor_parallel`` record, :func:`partitioner.tp.pricing.tensor_parallel_record`)."""
    if not record:
        return []
    tp, comm = record["degree"], list(record.get("comm_s", []))
    sharding = record.get("sharding", {})
    roles = list(sharding.get("roles", {}).values())
    counts = ", ".join(f"{roles.count(r)} {r}" for r in ("column", "row", "embedding", "loss") if roles.count(r))
    share = local_weights / full_weights if full_weights else 1.0
    lines = [f"tensor parallelism: degree {tp} (Megatron's pattern: {counts or 'nothing'} sharded, "
             f"{len(sharding.get('replicated', {}))} left whole); every number above is per rank (tp rank 0 of "
             "each stage, the largest shards)",
             f"  weights per tp rank {format_bytes(local_weights)} of the model's {format_bytes(full_weights)} in "
             f"{dtype} ({share:.3f} = 1/{1 / share if share else 0:.2f}); gradients and optimizer state scale with "
             "them" + ("; sequence parallelism: the activations between tp regions are 1/T of the sequence"
                       if sharding.get("sequence") else
                       ", activations only inside tp regions (no sequence parallelism)")]
    if comm:
        worst = max(range(len(comm)), key=comm.__getitem__)
        link = (f"{rates.get('link', '?')}, {format_bytes(rates.get('link_bytes_per_s', 0))}/s + "
                f"{format_seconds(rates.get('link_latency_s', 0))} per ring step")
        of_step = f", {100 * microbatches * comm[worst] / step_s:.1f}% of the predicted step" if step_s else ""
        lines.append(f"  tp all-reduces and gathers ({link}; inside the stages' fwd/bwd ms): "
                     f"{format_seconds(comm[worst])} per microbatch on stage {worst}, "
                     f"{format_seconds(microbatches * comm[worst])} per step (x {microbatches} microbatches) on "
                     f"its ranks{of_step}")
    return lines
