"""Property tests: random DAG models and random op graphs always give complete, acyclic, exact plans.

* Random ``nn.Module`` DAGs (chains, branches, long skips, merges, an in-place update, an in-place update
  through a slice of a value read later, a ``Linear`` reused in two places, a parameter read by several
  ops, one or two outputs), every method, a random stage count: the
  plan assigns every op to exactly one stage in range, no edge goes backwards, and the staged model gives the
  same outputs and gradients as the model -- run in one process and run the way a pipeline runs it.
* Random synthetic :class:`OpGraph` s (no torch): the same structural guarantees, determinism, an honest lower
  bound, and on chains the DP is optimal among all contiguous partitions (checked by brute force).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import partitioner
from partitioner import METHODS, OpGraph
from partitioner.capture.stage_modules import split
from partitioner.cut.baselines import BASELINES, all_baselines
from partitioner.cut.objective import NEAR, dominates, evaluate
from partitioner.cut.portfolio import make_problem
from partitioner.cut.segments import grid_comm
from tests.conftest import assert_complete_and_acyclic, assert_same_step, pipeline_step, stage_array, train_step

KINDS = ("linear", "add", "mul", "tanh", "scale", "iadd", "slice_iadd", "cat")


@dataclass(frozen=True)
class DagSpec:
    width: int
    n_linears: int
    ops: tuple[tuple[str, int, int, int], ...]   # (kind, input a, input b, linear index)
    outputs: tuple[int, ...]


class RandomDAG(nn.Module):
    """Values start as the two inputs; every op appends one value computed from earlier values."""

    def __init__(self, spec: DagSpec):
        super().__init__()
        self.spec = spec
        self.linears = nn.ModuleList(nn.Linear(spec.width, spec.width) for _ in range(spec.n_linears))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, spec.width))
        self.mix = nn.Linear(2 * spec.width, spec.width, bias=False)

    def forward(self, x, y):
        vals = [x, y]
        for kind, a, b, li in self.spec.ops:
            u, v = vals[a], vals[b]
            if kind == "linear":
                r = self.linears[li](u)
            elif kind == "add":
                r = u + v
            elif kind == "mul":
                r = u * torch.tanh(v)
            elif kind == "tanh":
                r = torch.tanh(u)
            elif kind == "scale":     # one parameter read by many ops
                r = u * self.scale
            elif kind == "iadd":      # an in-place update of a fresh value
                r = u * 0.5
                r += v
            elif kind == "slice_iadd":  # an in-place update through a view, read later through the base
                r = u.clone()
                r[:, :1] += v[:, 1:2]
            else:                     # "cat": widen and project back
                r = self.mix(torch.cat([u, v], dim=-1))
            vals.append(r)
        outs = tuple(vals[i] for i in self.spec.outputs)
        return outs if len(outs) > 1 else outs[0]


@st.composite
def dag_specs(draw) -> DagSpec:
    width = draw(st.sampled_from([3, 8]))
    n_linears = draw(st.integers(1, 3))
    n_ops = draw(st.integers(2, 14))
    ops = []
    for i in range(n_ops):
        avail = 2 + i
        kind = draw(st.sampled_from(KINDS))
        # Mostly recent inputs (chains), sometimes anything earlier (skips and merges).
        a = draw(st.one_of(st.integers(max(0, avail - 2), avail - 1), st.integers(0, avail - 1)))
        b = draw(st.integers(0, avail - 1))
        ops.append((kind, a, b, draw(st.integers(0, n_linears - 1))))
    # Linear 0 used in two places (a shared parameter across possible stages), merged at the end.
    last = 2 + len(ops) - 1
    early = draw(st.integers(0, last))
    ops += [("linear", last, last, 0), ("linear", early, early, 0), ("add", last + 1, last + 2, 0)]
    final = 2 + len(ops) - 1
    extra = draw(st.one_of(st.none(), st.integers(2, final - 1)))
    outputs = (final,) if extra is None else (final, extra)
    return DagSpec(width, n_linears, tuple(ops), outputs)


def _loss(out, target):
    outs = out if isinstance(out, tuple) else (out,)
    return sum(((o - target) ** 2).mean() for o in outs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=dag_specs(), data=st.data())
def test_random_dag_modules_give_complete_acyclic_exact_plans(spec, data):
    torch.manual_seed(0)
    model = RandomDAG(spec)
    x, y = torch.randn(4, spec.width), torch.randn(4, spec.width)
    target = torch.randn(4, spec.width)
    args = (x, y)
    g = partitioner.trace(model, args)
    ops = sum(k != "output" for k in g.kinds)
    want = train_step(model, model, args, {}, _loss, target)
    k = data.draw(st.integers(1, min(6, ops)), label="num_stages")
    for method in METHODS:
        weight = data.draw(st.sampled_from([0.0, 0.2]), label="memory_weight")
        plan = partitioner.partition(g, k, method=method, memory_weight=weight)
        stage = assert_complete_and_acyclic(plan, g)
        if method != "metis":  # METIS alone may leave a stage of a tiny graph idle; the DP never does
            real = [s for s, kind in zip(stage.tolist(), g.kinds) if kind != "output"]
            assert set(real) == set(range(k)), f"{method}: a stage without ops ({sorted(set(real))})"
        assert plan.num_stages == k and plan.method in ("dp", "metis", *BASELINES)
        assert plan.bottleneck >= plan.lower_bound * (1 - 1e-9)
        assert_same_step(train_step(model, plan.as_module(), args, {}, _loss, target), want)
        assert_same_step(pipeline_step(model, split(g, plan.assignment, k), args, {}, _loss, target), want)
        # Shared parameters are reported exactly when their users sit on several stages.
        for q, name in enumerate(g.param_names):
            holders = set(stage[g.use_node[g.use_param == q]].tolist())
            assert (len(holders) > 1) == (name in plan.shared_params)
    # Any acyclic assignment runs exactly, not only the ones the partitioner picks: cut the op order at
    # random places (stages may hold a single cheap op, e.g. the in-place add without its producer).
    cuts = sorted(data.draw(st.sets(st.integers(1, g.num_nodes - 1), min_size=k - 1, max_size=k - 1), label="cuts"))
    stage = np.searchsorted([0] + cuts, np.arange(g.num_nodes), side="right") - 1
    sm = split(g, dict(zip(g.names, stage.tolist())), k)
    assert_same_step(pipeline_step(model, sm, args, {}, _loss, target), want)
    assert_same_step(train_step(model, sm.as_module(), args, {}, _loss, target), want)


def test_in_place_update_shares_an_op_with_the_value_it_updates():
    """``r = u * 0.5; r += v``: the in-place add joins the multiply that made ``r`` (one op for the partitioner,
    so no plan can put them on different stages), and every cut of the op order runs exactly."""
    spec = DagSpec(3, 1, (("linear", 1, 1, 0), ("iadd", 2, 0, 0), ("tanh", 3, 3, 0), ("linear", 4, 4, 0)), (5,))
    torch.manual_seed(0)
    model = RandomDAG(spec)
    args, target = (torch.randn(4, 3), torch.randn(4, 3)), torch.randn(4, 3)
    g = partitioner.trace(model, args)
    fused = [m for m in g.members if "add_" in m]
    assert fused and "mul" in fused[0], g.members
    want = train_step(model, model, args, {}, _loss, target)
    for cut in range(1, g.num_nodes):
        stage = (np.arange(g.num_nodes) >= cut).astype(np.int64)
        sm = split(g, dict(zip(g.names, stage.tolist())), 2)
        assert_same_step(pipeline_step(model, sm, args, {}, _loss, target), want)


# --- synthetic op graphs -------------------------------------------------------------------------------


def synthetic_graph(n: int, rng: np.random.Generator, skip_prob: float = 0.3, fanout_prob: float = 0.2) -> OpGraph:
    """A chain of ``n`` ops (the last is the output) with random skips and fan-outs, random costs and bytes."""
    src, dst, value = [], [], []
    for j in range(1, n):
        src.append(j - 1)
        dst.append(j)
        if j >= 2 and rng.random() < skip_prob:
            src.append(int(rng.integers(0, j - 1)))
            dst.append(j)
    src, dst = np.array(src, np.int64), np.array(dst, np.int64)
    # Every producer's output is one value; some producers' values also feed a second reader further on.
    extra_s, extra_d = [], []
    for s in range(n - 2):
        if rng.random() < fanout_prob:
            extra_s.append(s)
            extra_d.append(int(rng.integers(s + 1, n)))
    src = np.concatenate([src, np.array(extra_s, np.int64)])
    dst = np.concatenate([dst, np.array(extra_d, np.int64)])
    pairs = np.unique(np.stack([src, dst], 1), axis=0)
    src, dst = pairs[:, 0], pairs[:, 1]
    value = src.copy()  # one value per producer
    used = np.unique(value)
    remap = np.full(n, -1, np.int64)
    remap[used] = np.arange(len(used))
    value = remap[value]
    flops = rng.uniform(1e5, 1e8, n)
    flops[-1] = 0
    out = rng.integers(1, 1 << 20, n)
    out[-1] = 0
    n_params = max(1, n // 3)
    use_node = rng.integers(0, n - 1, n_params)
    return OpGraph(
        names=[f"op{i}" for i in range(n)], kinds=["aten.mm"] * (n - 1) + ["output"], modules=[""] * n,
        flops=flops, out_bytes=out, act_bytes=out.copy(), move_bytes=out * 3,
        src=src, dst=dst, value=value, value_bytes=out[used].astype(np.int64),
        param_names=[f"p{i}" for i in range(n_params)], param_bytes=rng.integers(1, 1 << 22, n_params),
        param_trainable=np.ones(n_params, bool), use_node=use_node, use_param=np.arange(n_params),
    )


RATES = partitioner.DeviceRates()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 300), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_random_op_graphs_give_complete_acyclic_deterministic_plans(n, seed, data):
    g = synthetic_graph(n, np.random.default_rng(seed))
    k = data.draw(st.integers(1, min(9, n - 1)), label="num_stages")
    method = data.draw(st.sampled_from(METHODS), label="method")
    w = data.draw(st.sampled_from([0.0, 0.2, 1.0]), label="memory_weight")
    plan = partitioner.partition(g, k, method=method, memory_weight=w, rates=RATES, microbatches=4)
    stage = assert_complete_and_acyclic(plan, g)
    assert plan.balance >= 1 - 1e-9 and plan.bottleneck >= plan.lower_bound * (1 - 1e-9)
    assert plan.to_json() == partitioner.partition(g, k, method=method, memory_weight=w, rates=RATES,
                                                   microbatches=4).to_json()
    p = make_problem(g, k, memory_weight=w, rates=RATES, microbatches=4)
    ev = evaluate(p, stage)
    assert plan.cut_bytes == ev.cut_bytes and plan.bottleneck == pytest.approx(ev.bottleneck)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(4, 60), seed=st.integers(0, 2**31 - 1))
def test_segment_communication_table_matches_the_objective(n, seed):
    """The DP's per-segment communication is what objective.evaluate charges (exactly, for two stages;
    for the received side, for any number of stages)."""
    g = synthetic_graph(n, np.random.default_rng(seed), skip_prob=0.5, fanout_prob=0.4)
    cand = np.arange(n + 1)
    p2 = make_problem(g, 2, memory_weight=0.0, rates=RATES)
    comm, recv = grid_comm(p2, cand)
    for c in range(1, n):
        ev = evaluate(p2, (np.arange(n) >= c).astype(np.int64))
        assert comm[0, c] == pytest.approx(ev.comm_s[0], rel=1e-9, abs=1e-15)
        assert comm[c, n] == pytest.approx(ev.comm_s[1], rel=1e-9, abs=1e-15)
        assert recv[c, n] == ev.bytes_in[1] and recv[0, c] == 0
    rng = np.random.default_rng(seed)
    p3 = make_problem(g, 3, memory_weight=0.0, rates=RATES)
    for _ in range(10):
        a, b = sorted(rng.choice(np.arange(1, n), 2, replace=False))
        ev = evaluate(p3, np.searchsorted([0, a, b], np.arange(n), side="right") - 1)
        assert [recv[0, a], recv[a, b], recv[b, n]] == ev.bytes_in.tolist()


def chain_graph(n: int, rng: np.random.Generator) -> OpGraph:
    return synthetic_graph(n, rng, skip_prob=0.0, fanout_prob=0.0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 10), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_dp_is_optimal_among_contiguous_partitions_of_a_chain(n, seed, data):
    g = chain_graph(n, np.random.default_rng(seed))
    k = data.draw(st.integers(2, min(4, n - 1)), label="num_stages")
    p = make_problem(g, k, memory_weight=0.0, rates=RATES)
    plans = [evaluate(p, np.searchsorted((0,) + cuts, np.arange(n), side="right") - 1)
             for cuts in itertools.combinations(range(1, n), k - 1)]
    best = min(ev.bottleneck for ev in plans if not ev.empty)  # a stage of the output alone idles a device
    # The least cut among plans within 1% of the best bottleneck (a chain's segments cost what evaluate says).
    fewest = min(ev.cut_bytes for ev in plans if not ev.empty and ev.bottleneck <= best * (1 + NEAR))
    for method in ("dp", "auto"):
        plan = partitioner.partition(g, k, method=method, memory_weight=0.0, rates=RATES)
        assert plan.bottleneck <= best * (1 + NEAR) * (1 + 1e-9)
        assert plan.cut_bytes <= fewest
    # ... so no baseline (all contiguous) that gives every device work is as good on every axis and better on one.
    ours = partitioner.partition(g, k, memory_weight=0.0, rates=RATES)
    for name, b in all_baselines(p).items():
        assert evaluate(p, stage_array(b, g)).empty or not dominates(b.axes, ours.axes), name
