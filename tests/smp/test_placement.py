"""Manual placement (``smp.partition``, ``smp.set_partition``, ``default_partition``) and activation
checkpointing (``smp.set_activation_checkpointing``): followed, and exact against one process."""
from __future__ import annotations

from collections import Counter

import pytest

from smp.testing import run_ranks
from tests.smp.features import assert_exact, make_net, module_stages, train

# --- activation checkpointing -------------------------------------------------------------------------------


def _checkpointing(rank: int, world: int):
    import smp

    calls: Counter = Counter()

    def count_forwards(model, optimizer) -> None:  # the stage modules exist once partitioned
        calls.update([type(optimizer).__name__])  # SMP hands hooks the DistributedOptimizer
        for st in model.runner.local_stages:
            st.module.register_forward_pre_hook(lambda mod, args, s=st.index: calls.update([s]))

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model, out = train(make_net(), 2, checkpoint="block1", hook=count_forwards)
    out["checkpointed"] = sorted(model.runner.executor.checkpointed)
    out["block1_stages"] = module_stages(model.runner.plan)["block1"]
    out["local"] = [st.index for st in model.runner.local_stages]
    out["calls"] = dict(calls)
    return out


def test_activation_checkpointing_recomputes_and_stays_exact():
    m, steps = 4, 2
    results = run_ranks(_checkpointing, 2, timeout=240)
    for r in results:
        assert_exact(r)
        assert r["checkpointed"] == r["block1_stages"] and r["checkpointed"], r
        assert r["calls"]["DistributedOptimizer"] == 1, r["calls"]
        for s in r["local"]:  # a checkpointed stage runs its forward again in backward
            want = (2 if s in r["checkpointed"] else 1) * m * steps
            assert r["calls"][s] == want, (s, r["calls"], r["checkpointed"])


# --- manual placement ---------------------------------------------------------------------------------------------


def _manual(rank: int, world: int, case: str):
    import smp

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    if case in ("contexts", "nested"):  # smp.partition(i) around the construction of the submodules
        smp.init(config)
        net = make_net(placed=True if case == "contexts" else case)
    elif case == "default":  # only embed placed (on 0): everything unplaced goes to default_partition=1
        smp.init({**config, "default_partition": 1})
        net = make_net()
        smp.set_partition(net.embed, 0)
    elif case == "backwards":  # head placed before block2: data would flow from partition 1 back to 0
        smp.init(config)
        net = make_net()
        smp.set_partition(net.block2, 1)
        smp.set_partition(net.head, 0)
    else:
        raise ValueError(case)
    try:
        model, out = train(net, 2)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out["modules"] = module_stages(model.runner.plan)
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
        assert_exact(r)


def test_placement_that_is_not_a_pipeline_is_an_error():
    for r in run_ranks(_manual, 2, "backwards", timeout=240):
        err = r.get("error", "")
        assert "this placement is not a pipeline" in err, r
        assert "block2" in err and "head" in err and "partition 1" in err and "partition 0" in err, err


def test_smp_v1_checkpointing_keywords_are_accepted_checked_and_said_to_change_nothing(monkeypatch):
    import torch

    import smp
    from smp.runtime import state
    from smp.runtime.compat import NoEffectWarning
    from smp.runtime.config import load_config
    from smp.runtime.topology import Topology
    st = state.State(config=load_config({"partitions": 1}), topology=Topology(1, 1, placement="cluster"), rank=0,
                     mp_group=None, dp_group=None, device=torch.device("cpu"))
    monkeypatch.setattr(state, "_state", st)
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    smp.set_activation_checkpointing(layers[0], preserve_rng_state=True, strategy="each")
    with pytest.warns(NoEffectWarning, match="pack_args_as_tuple=True"):
        smp.set_activation_checkpointing(layers[1], pack_args_as_tuple=True)
    with pytest.warns(NoEffectWarning, match="strategy='group_2'"):
        smp.set_activation_checkpointing(layers, strategy="group_2")
    assert st.checkpointed == {layers, layers[0], layers[1]}
    with pytest.raises(ValueError, match="use 'each', 'contiguous' or 'group_N'"):
        smp.set_activation_checkpointing(layers, strategy="group_x")
    with pytest.raises(ValueError, match="applies to an nn.Sequential"):
        smp.set_activation_checkpointing(layers[0], strategy="contiguous")
