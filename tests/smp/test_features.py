"""SMP features beyond the plain training loop, on spawned ranks: activation checkpointing, autocast, the
loss scaler, sharded optimizer state, the rank helpers and placements, manual placement, eval / no_grad
steps and what a step returns.

Exactness checks follow test_training: a single-process copy of the model trained on the same global
batches is the reference, parameters must agree to rel 1e-4 (SGD; Adam where noted)."""
from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.spawn import run_ranks
from smp.step import StepOutput
from smp.topology import Topology

PARAM_TOL = 1e-4


# --- models and helpers (module level: the spawned ranks import them) ---------------------------------------


class Net(nn.Module):
    """embed -> block1 -> block2 -> head; ``placed`` builds it under smp.partition contexts (``"nested"``:
    the first half's block inside the second's, where the inner one must win)."""

    def __init__(self, placed: bool | str = False, dropout: float = 0.0) -> None:
        super().__init__()
        import contextlib

        if placed:
            import smp
            first, second = smp.partition(0), smp.partition(1)
        else:
            first = second = contextlib.nullcontext()
        nested = placed == "nested"
        with second if nested else contextlib.nullcontext():
            with first:
                self.embed = nn.Linear(16, 32)
                self.block1 = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(dropout))
            with contextlib.nullcontext() if nested else second:
                self.block2 = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(dropout))
                self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(torch.relu(self.embed(x)))))


def _batch(step: int, batch: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 16, generator=g), torch.randint(4, (batch,), generator=g)


def _net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def _param_err(model, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.local_named_parameters():
        r = ref[name]
        worst = max(worst, float(((p - r).abs() / (r.abs() + 1e-3)).max().detach()))
    return worst


def _module_stages(plan) -> dict[str, list[int]]:
    """Top-level module name -> the stages holding its ops."""
    out: dict[str, set[int]] = {}
    for name, module in zip(plan.graph.names, plan.graph.modules):
        if module:
            out.setdefault(module.split(".")[0], set()).add(plan.assignment[name])
    return {k: sorted(v) for k, v in out.items()}


def _train(net: Net, steps: int, *, checkpoint: str | None = None, hook=None, batch: int = 8):
    """Train ``net`` with smp (already initialised) and a copy in one process (SGD + momentum)."""
    import smp

    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    if checkpoint:
        smp.set_activation_checkpointing(getattr(net, checkpoint))
    model = smp.DistributedModel(net)
    if hook:
        model.register_post_partition_hook(hook)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    losses, ref_losses = [], []
    for step in range(steps):
        x, y = _batch(step, batch)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
        losses.append(float(train_step(model, x, y).reduce_mean()))
        opt.step()
        opt.zero_grad()
    return model, {"losses": losses, "ref_losses": ref_losses, "param_err": _param_err(model, reference)}


def _assert_exact(r: dict) -> None:
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (r["losses"], r["ref_losses"])
    assert r["param_err"] < PARAM_TOL, r["param_err"]


# --- activation checkpointing -------------------------------------------------------------------------------


def _checkpointing(rank: int, world: int):
    import smp

    calls: Counter = Counter()

    def count_forwards(model, optimizer) -> None:  # the stage modules exist once partitioned
        calls.update([type(optimizer).__name__])  # SMP hands hooks the DistributedOptimizer
        for st in model.runner.local_stages:
            st.module.register_forward_pre_hook(lambda mod, args, s=st.index: calls.update([s]))

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model, out = _train(_net(), 2, checkpoint="block1", hook=count_forwards)
    out["checkpointed"] = sorted(model.runner.executor.checkpointed)
    out["block1_stages"] = _module_stages(model.runner.plan)["block1"]
    out["local"] = [st.index for st in model.runner.local_stages]
    out["calls"] = dict(calls)
    return out


def test_activation_checkpointing_recomputes_and_stays_exact():
    m, steps = 4, 2
    results = run_ranks(_checkpointing, 2, timeout=240)
    for r in results:
        _assert_exact(r)
        assert r["checkpointed"] == r["block1_stages"] and r["checkpointed"], r
        assert r["calls"]["DistributedOptimizer"] == 1, r["calls"]
        for s in r["local"]:  # a checkpointed stage runs its forward again in backward
            want = (2 if s in r["checkpointed"] else 1) * m * steps
            assert r["calls"][s] == want, (s, r["calls"], r["checkpointed"])


# --- autocast -----------------------------------------------------------------------------------------------


def _autocast(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    net = _net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.cross_entropy(out.float(), y)
        model.backward(loss)
        return loss, out

    @smp.step
    def fp32_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    losses, ref_losses, dtypes = [], [], set()
    finite = True
    for step in range(3):
        x, y = _batch(step)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
        loss, out = train_step(model, x, y)
        losses.append(float(loss.reduce_mean()))
        dtypes |= {str(o.dtype) for o in out.outputs}
        finite &= all(bool(torch.isfinite(p.grad).all()) for p in model.local_parameters())
        opt.step()
        opt.zero_grad()
    boundary = sorted({str(v.dtype) for v in model.runner.split_model.value_meta.values()
                       if isinstance(v, torch.Tensor) and v.is_floating_point()})
    try:  # the stages were built for bf16 boundaries: a step without autocast must say so, not garble
        fp32_step(model, *_batch(0))
        switched = "no error"
    except RuntimeError as exc:
        switched = str(exc)
    return {"losses": losses, "ref_losses": ref_losses, "out_dtypes": sorted(dtypes), "boundary": boundary,
            "finite": finite, "param_dtypes": sorted({str(p.dtype) for p in model.local_parameters()}),
            "switched": switched}


@pytest.mark.slow  # the smp path (config bf16) is tested on two ranks in tests/smp/test_precision.py
def test_autocast_bf16_on_two_ranks():
    for r in run_ranks(_autocast, 2, timeout=240):
        assert r["out_dtypes"] == ["torch.bfloat16"], r  # the model's matmuls ran in bf16
        assert "torch.bfloat16" in r["boundary"], r    # and what crossed stages was bf16
        assert r["param_dtypes"] == ["torch.float32"] and r["finite"], r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert math.isfinite(got) and abs(got - want) <= 2e-2 * abs(want), (r["losses"], r["ref_losses"])
        assert "partitioned under torch.autocast('cpu', dtype=torch.bfloat16)" in r["switched"], r["switched"]


# --- loss scaling -------------------------------------------------------------------------------------------


def _scaler(rank: int, world: int, inf_on: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    net = _net()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = smp.amp.GradScaler(init_scale=2.0 ** 12, growth_interval=2)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    changed, scales = [], []
    for step in range(4):
        x, y = _batch(step)
        train_step(model, x, y)
        if step == 1 and smp.pp_rank() == inf_on:  # an overflow on one stage only
            next(p for p in model.local_parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        if step != 1:  # the reference takes every step but the skipped one
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
        before = [p.detach().clone() for p in model.local_parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.local_parameters())))
        scales.append(scaler.get_scale())
    return {"changed": changed, "scales": scales, "param_err": _param_err(model, reference)}


@pytest.mark.parametrize("inf_on", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_grad_scaler_skips_on_every_rank(inf_on):
    results = run_ranks(_scaler, 2, inf_on, timeout=240)
    for r in results:
        assert r["changed"] == [True, False, True, True], r  # step 1 skipped on both stages
        assert r["param_err"] < PARAM_TOL, r
    s0 = 2.0 ** 12
    # growth_interval=2: grows after two good steps, halves on the overflow
    assert results[0]["scales"] == results[1]["scales"] == [s0, s0 / 2, s0 / 2, s0], [r["scales"] for r in results]


# --- sharded optimizer state (pp=2 x dp=2) ------------------------------------------------------------------


def _sharded(rank: int, world: int, scaled: bool):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "shard_optimizer_state": True})
    net = _net()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # ZeRO must follow the schedule too
    # A power-of-two scale that never changes: unscaling is exact, so the run still equals the reference.
    scaler = smp.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=10 ** 6, enabled=scaled)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    d, n = smp.dp_rank(), smp.dp_size()
    for step in range(3):
        x, y = _batch(step)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        train_step(model, x.chunk(n)[d], y.chunk(n)[d])
        scaler.step(opt)  # through the DistributedOptimizer, so the sharded step runs
        scaler.update()
        opt.zero_grad()
        sched.step()
    local = [p for p in model.local_parameters() if p.requires_grad]
    held = len(opt._zero.optim.state) if opt._zero is not None else len(opt.optimizer.state)
    saved = opt.local_state_dict()  # this replica's part of the state, and back
    opt.load_state_dict(saved)
    # The full state, gathered from every stage and replica, matches the single-device optimizer's, and
    # loads back into the shards (each takes its part, nothing more).
    full, want = opt.state_dict(), ref_opt.state_dict()
    state_err = max(float((full["state"][i]["exp_avg_sq"] - v["exp_avg_sq"]).abs().max() /
                          v["exp_avg_sq"].abs().max()) for i, v in want["state"].items())
    opt.load_state_dict(full)
    reloaded = opt.state_dict()
    model_sd, ref_sd = model.state_dict(), reference.state_dict()
    return {"param_err": _param_err(model, reference), "local_params": len(local), "state_entries": held,
            "pp_rank": smp.pp_rank(), "sharded": opt._zero is not None and saved.get("_smp_zero", False),
            "state_keys": sorted(full["state"]) == sorted(want["state"]), "state_err": state_err,
            "lr": full["param_groups"][0]["lr"] == want["param_groups"][0]["lr"],
            "reloaded": all(torch.equal(reloaded["state"][i]["exp_avg"], v["exp_avg"])
                            for i, v in full["state"].items())
            and len(opt._zero.optim.state) == held,
            "model_sd": sorted(model_sd) == sorted(ref_sd)
            and all(torch.allclose(model_sd[k], v, rtol=1e-4, atol=1e-6) for k, v in ref_sd.items())}


@pytest.mark.parametrize("scaled", [pytest.param(False, marks=pytest.mark.slow), True])
def test_shard_optimizer_state_pp2_dp2(scaled):
    results = run_ranks(_sharded, 4, scaled, timeout=300)
    for r in results:
        assert r["sharded"], r
        assert r["param_err"] < PARAM_TOL, r
        assert 0 < r["state_entries"] < r["local_params"], r  # each replica keeps only its part of the state
        assert r["state_keys"] and r["state_err"] < 1e-3 and r["lr"], r  # full state_dict() == one device's
        assert r["reloaded"], r
        assert r["model_sd"], r  # the gathered model state_dict() == the reference's
    for stage in (0, 1):  # the replicas of a stage hold disjoint parts that cover its parameters
        rs = [r for r in results if r["pp_rank"] == stage]
        assert sum(r["state_entries"] for r in rs) == rs[0]["local_params"], rs


# --- rank helpers and placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize("placement,mp,dp", [
    ("cluster", [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("spread", [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_topology_8_ranks(placement, mp, dp):
    t = Topology(8, 2, placement)
    assert t.dp == 4 and t.mp_groups() == mp and t.dp_groups() == dp
    for r in range(8):
        assert t.pp_rank(r) == next(g.index(r) for g in mp if r in g)
        assert t.dp_rank(r) == next(g.index(r) for g in dp if r in g)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_degree"):
        Topology(6, 4)


def _ranks(rank: int, world: int, placement: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "ddp": True, "placement_strategy": placement})
    me = {"rank": smp.rank(), "size": smp.size(), "local_rank": smp.local_rank(), "local_size": smp.local_size(),
          "pp_rank": smp.pp_rank(), "pp_size": smp.pp_size(), "mp_rank": smp.mp_rank(), "mp_size": smp.mp_size(),
          "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(), "rdp_rank": smp.rdp_rank(),
          "mp_group": smp.get_mp_group(), "dp_group": smp.get_dp_group()}
    # broadcast / recv_from in each numbering: the group's rank 0 sends, the others receive
    if smp.rank() == 0:
        me["world_msg"] = smp.broadcast("from world rank 0", smp.CommGroup.WORLD)
    else:
        me["world_msg"] = smp.recv_from(0, smp.RankType.WORLD_RANK)
    if smp.mp_rank() == 0:
        me["mp_msg"] = smp.broadcast(f"stage 0 of replica {smp.dp_rank()}", smp.CommGroup.MP_GROUP)
    else:
        me["mp_msg"] = smp.recv_from(0, smp.RankType.MP_RANK)
    if smp.dp_rank() == 0:
        me["dp_msg"] = smp.broadcast(f"replica 0 of stage {smp.pp_rank()}", smp.CommGroup.DP_GROUP)
    else:
        me["dp_msg"] = smp.recv_from(0, smp.RankType.DP_RANK)
    smp.barrier()
    smp.barrier(smp.CommGroup.MP_GROUP)
    me["gather_world"] = smp.allgather(smp.rank())
    me["gather_mp"] = smp.allgather(smp.rank(), smp.CommGroup.MP_GROUP)
    me["gather_dp"] = smp.allgather(smp.rank(), smp.CommGroup.DP_GROUP)
    return me


@pytest.mark.parametrize("placement,mp,dp", [
    ("cluster", [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    pytest.param("spread", [[0, 2], [1, 3]], [[0, 1], [2, 3]], marks=pytest.mark.slow),
])
def test_rank_helpers_pp2_dp2(placement, mp, dp):
    results = run_ranks(_ranks, 4, placement, timeout=240)
    for r, me in enumerate(results):
        mine_mp = next(g for g in mp if r in g)
        mine_dp = next(g for g in dp if r in g)
        assert (me["rank"], me["size"], me["local_rank"], me["local_size"]) == (r, 4, r, 4)
        assert me["mp_group"] == mine_mp and me["dp_group"] == mine_dp
        assert me["pp_rank"] == me["mp_rank"] == mine_mp.index(r) and me["pp_size"] == me["mp_size"] == 2
        assert me["dp_rank"] == me["rdp_rank"] == mine_dp.index(r) and me["dp_size"] == 2
        assert me["world_msg"] == "from world rank 0"
        assert me["mp_msg"] == f"stage 0 of replica {me['dp_rank']}"
        assert me["dp_msg"] == f"replica 0 of stage {me['pp_rank']}"
        assert me["gather_world"] == [0, 1, 2, 3]
        assert me["gather_mp"] == mine_mp and me["gather_dp"] == mine_dp


# --- manual placement ---------------------------------------------------------------------------------------------


def _manual(rank: int, world: int, case: str):
    import smp

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    if case in ("contexts", "nested"):  # smp.partition(i) around the construction of the submodules
        smp.init(config)
        net = _net(placed=True if case == "contexts" else case)
    elif case == "default":  # only embed placed (on 0): everything unplaced goes to default_partition=1
        smp.init({**config, "default_partition": 1})
        net = _net()
        smp.set_partition(net.embed, 0)
    elif case == "backwards":  # head placed before block2: data would flow from partition 1 back to 0
        smp.init(config)
        net = _net()
        smp.set_partition(net.block2, 1)
        smp.set_partition(net.head, 0)
    else:
        raise ValueError(case)
    try:
        model, out = _train(net, 2)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out["modules"] = _module_stages(model.runner.plan)
    return out


@pytest.mark.parametrize("case,want", [
    ("contexts", {"embed": [0], "block1": [0], "block2": [1], "head": [1]}),
    ("nested", {"embed": [0], "block1": [0], "block2": [1], "head": [1]}),
    ("default", {"embed": [0], "block1": [1], "block2": [1], "head": [1]}),
])
def test_manual_placement_is_followed_and_exact(case, want):
    for r in run_ranks(_manual, 2, case, timeout=240):
        assert "error" not in r, r
        assert r["modules"] == want, r["modules"]
        _assert_exact(r)


def test_placement_that_is_not_a_pipeline_is_an_error():
    for r in run_ranks(_manual, 2, "backwards", timeout=240):
        err = r.get("error", "")
        assert "this placement is not a pipeline" in err, r
        assert "block2" in err and "head" in err and "partition 1" in err and "partition 0" in err, err


# --- eval mode / no_grad ------------------------------------------------------------------------------------------


def _forward_only(rank: int, world: int, dropout: float):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    net = _net(dropout=dropout)
    reference = copy.deepcopy(net).eval()
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def predict(model, x):
        return model(x)

    x, y = _batch(0)
    out = {}
    if dropout:  # partition in train mode, then switch to eval (no optimizer step: the weights stay put)
        train_step(model, x, y)
        model.zero_grad(set_to_none=True)
    model.eval()
    first = predict(model, x).concat()
    out["eval_err"] = float((first - reference(x)).abs().max().detach())
    out["eval_repeatable"] = torch.equal(first, predict(model, x).concat())
    out["eval_grads"] = [p.grad is not None for p in model.local_parameters()]
    model.train()
    with torch.no_grad():
        got = predict(model, x)
    out["no_grad_err"] = float((got.concat() - reference(x)).abs().max().detach())
    out["no_grad_requires_grad"] = any(o.requires_grad for o in got.outputs)
    out["no_grad_grads"] = [p.grad is not None for p in model.local_parameters()]
    return out


def test_eval_and_no_grad_steps_run_forward_only():
    for r in run_ranks(_forward_only, 2, 0.0, timeout=240):
        assert r["eval_err"] < 1e-6 and r["eval_repeatable"], r
        assert r["no_grad_err"] < 1e-6 and not r["no_grad_requires_grad"], r
        assert not any(r["eval_grads"]) and not any(r["no_grad_grads"]), r  # no backward ran


def test_eval_after_training_turns_dropout_off():
    for r in run_ranks(_forward_only, 2, 0.5, timeout=240):
        assert r["eval_repeatable"] and r["eval_err"] < 1e-6, r


# --- what a step returns -------------------------------------------------------------------------------------------


def test_step_output_reductions():
    out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert torch.equal(out.reduce_mean(), torch.tensor([2.0, 4.0]))
    assert torch.equal(out.reduce_sum(), torch.tensor([4.0, 8.0]))
    assert torch.equal(out.concat(), torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert torch.equal(out.stack(), torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    scalars = StepOutput([1.5, 2.5])
    assert scalars.outputs == [1.5, 2.5] and float(scalars.reduce_mean()) == 2.0 and len(scalars) == 2


def _returns(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    net = _net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x, y, extra):
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        got = {"loss": loss, "out": out, "scalar": loss.item(), "count": int(y.numel()), "flag": bool(extra)}
        if extra:
            got["note"] = f"extra {extra}"
        return got

    x, y = _batch(0)
    want_out = reference(x).detach()
    want_losses = [float(F.cross_entropy(o, t)) for o, t in zip(want_out.chunk(4), y.chunk(4))]
    steps = []
    # The first call sends the values pickled; the second (same structure) as raw bytes; the third returns
    # one more leaf (a string), so it falls back to pickling.
    for extra in (0, 0, 7):
        got = train_step(model, x, y, extra)
        steps.append({
            "types": {k: type(v).__name__ for k, v in got.items()},
            "mean": float(got["loss"].reduce_mean()), "sum": float(got["loss"].reduce_sum()),
            "stack_shape": tuple(got["out"].stack().shape),
            "concat_err": float((got["out"].concat() - want_out).abs().max()),
            "scalar": got["scalar"].outputs, "count": got["count"].outputs, "flag": got["flag"].outputs,
            "note": got["note"].outputs if "note" in got else None,
            "requires_grad": any(o.requires_grad for o in got["out"].outputs),
        })
    return {"steps": steps, "want_losses": want_losses}


def test_step_returns_on_every_rank():
    results = run_ranks(_returns, 2, timeout=240)
    for r in results:  # the last stage computed them; every rank of the pipeline gets them
        want = r["want_losses"]
        for i, got in enumerate(r["steps"]):
            keys = ["loss", "out", "scalar", "count", "flag"] + (["note"] if i == 2 else [])
            assert got["types"] == {k: "StepOutput" for k in keys}, got
            assert got["scalar"] == pytest.approx(want, rel=1e-6) and isinstance(got["scalar"], list)
            assert all(type(v) is float for v in got["scalar"]), got["scalar"]
            assert got["count"] == [2, 2, 2, 2] and all(type(v) is int for v in got["count"])
            assert got["flag"] == [i == 2] * 4 and all(type(v) is bool for v in got["flag"])
            assert got["note"] == (["extra 7"] * 4 if i == 2 else None)
            assert got["mean"] == pytest.approx(sum(want) / 4, rel=1e-6)
            assert got["sum"] == pytest.approx(sum(want), rel=1e-6)
            assert got["stack_shape"] == (4, 2, 4) and got["concat_err"] < 1e-6
            assert not got["requires_grad"]  # detach_outputs=True by default
    assert results[0]["steps"] == results[1]["steps"]
