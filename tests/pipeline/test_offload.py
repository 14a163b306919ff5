"""Activation offloading (``pipeline.offload``): exact, and the saved inputs of checkpointed stages really go to host
memory and back, each (stage, microbatch) once, loaded ``horizon`` backward passes ahead of its backward."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.offload import ActivationOffload, activation_offload
from pipeline.schedule import Action
from smp.testing import run_ranks

VOCAB, M = 101, 4
RUNS = [("1f1b", False, 4), ("1f1b", True, 2), ("gpipe", False, 4), ("gpipe", True, 1)]  # schedule, offload, horizon


def _loss(out, _target):
    return out.loss


def _gpt2(rank: int, world: int) -> dict:
    import transformers as T

    from partitioner import DeviceRates, partition, trace
    from pipeline import PipelineRunner

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16,
                                           bos_token_id=0, eos_token_id=0)).train()  # dropout 0.1
    ids = torch.randint(0, VOCAB, (2 * M, 8), generator=torch.Generator().manual_seed(1))
    plan = partition(trace(model, (ids[:2],), {"labels": ids[:2]}), world, rates=DeviceRates(), microbatches=M)
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict = {"runs": {}, "errors": []}
    for schedule, offload, horizon in RUNS:
        torch.manual_seed(1234)  # the same dropout masks in every run
        runner = PipelineRunner(plan, schedule=schedule, microbatches=M, timeout_s=60,
                                checkpoint_modules=("transformer.h",), offload_activations=offload,
                                activation_loading_horizon=horizon)
        inputs: dict[int, set] = defaultdict(set)  # stage -> (tensors, bytes) of its arguments, every call
        for st in runner.local_stages:
            st.module.register_forward_pre_hook(lambda _, args, seen=inputs[st.index]: seen.add(
                (sum(1 for a in args if isinstance(a, torch.Tensor) and a.numel()),
                 sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))))
        res = runner.step((ids,), {"labels": ids}, loss_fn=_loss)
        out["runs"][(schedule, offload, horizon)] = {
            "losses": res.losses, "grads": {names[id(p)]: p.grad.clone() for p in runner.local_parameters()},
            "events": list(runner.offload.events) if runner.offload else [],
            "actions": runner.schedule.actions[runner.rank], "checkpointed": set(runner.executor.checkpointed),
            "inputs": dict(inputs)}
        model.zero_grad(set_to_none=True)
        runner.close()
    for bad in ({"offload_activations": True}, {"activation_loading_horizon": 0},
                {"offload_activations": 1, "checkpoint_modules": ("transformer.h",)}):
        try:
            PipelineRunner(plan, microbatches=M, timeout_s=60, **bad)
            out["errors"].append(None)
        except ValueError as exc:
            out["errors"].append(str(exc))
    return out


@pytest.fixture(scope="module")
def gpt2_runs() -> list[dict]:
    return run_ranks(_gpt2, 2, timeout=240)


def test_offloading_is_exact_with_dropout(gpt2_runs):
    for r in gpt2_runs:
        for schedule, offload, horizon in RUNS:
            if not offload:
                continue
            got, want = r["runs"][(schedule, True, horizon)], r["runs"][(schedule, False, 4)]
            assert got["losses"] == want["losses"], schedule
            assert got["grads"].keys() == want["grads"].keys() and got["grads"]
            for name, grad in want["grads"].items():
                torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=0, msg=f"{schedule} {name}")


def _expected_loads(actions: list[Action], checkpointed: set[int], horizon: int) -> dict[tuple[int, int], int]:
    """(stage, microbatch) -> the index of the action before which its inputs must be loaded: the first after
    its forward at which its backward is among the next ``horizon`` backwards of checkpointed stages."""
    forward = {(a.stage, a.microbatch): i for i, a in enumerate(actions) if a.kind == "F"}
    backwards = [(i, (a.stage, a.microbatch)) for i, a in enumerate(actions)
                 if a.kind == "B" and a.stage in checkpointed]
    return {key: max(forward[key] + 1, backwards[n - horizon][0] + 1 if n >= horizon else 0)
            for n, (_, key) in enumerate(backwards)}


def test_every_saved_input_goes_to_host_and_back_once_in_backward_order_horizon_ahead(gpt2_runs):
    for rank, r in enumerate(gpt2_runs):
        ahead = 0
        for (schedule, offload, horizon), run in r["runs"].items():
            if not offload:
                assert run["events"] == []
                continue
            actions, checkpointed, events = run["actions"], run["checkpointed"], run["events"]
            where = f"rank {rank} {schedule} horizon {horizon}"
            assert checkpointed and all(s in checkpointed for s in run["inputs"]), where
            backwards = [(i, (a.stage, a.microbatch)) for i, a in enumerate(actions)
                         if a.kind == "B" and a.stage in checkpointed]
            assert len(backwards) == M * len(run["inputs"]), where
            by_kind: dict[str, list] = defaultdict(list)
            for e in events:
                by_kind[e.kind].append(e)
            # Packed during its forward: one event per tensor argument of the stage, all of its bytes.
            packs: dict[tuple[int, int], list] = defaultdict(list)
            for e in by_kind["pack"]:
                assert actions[e.at] == Action("F", e.stage, e.microbatch), (where, e)
                packs[(e.stage, e.microbatch)].append(e.nbytes)
            assert sorted(packs) == sorted(key for _, key in backwards), where
            for (stage, _), sizes in packs.items():
                assert run["inputs"][stage] == {(len(sizes), sum(sizes))}, (where, stage, sizes)
            # Loaded once per (stage, microbatch), all its bytes, exactly `horizon` backwards ahead.
            loads = {(e.stage, e.microbatch): e for e in by_kind["load"]}
            assert len(loads) == len(by_kind["load"]) == len(backwards), where
            want = _expected_loads(actions, checkpointed, horizon)
            assert {k: e.at for k, e in loads.items()} == want, where
            assert all(loads[k].nbytes == sum(packs[k]) for k in packs), where
            # Unpacked during its backward, every packed tensor once, in the schedule's backward order.
            unpacks: dict[tuple[int, int], list] = defaultdict(list)
            for e in by_kind["unpack"]:
                assert actions[e.at] == Action("B", e.stage, e.microbatch), (where, e)
                unpacks[(e.stage, e.microbatch)].append(e.nbytes)
            assert {k: Counter(v) for k, v in unpacks.items()} == {k: Counter(v) for k, v in packs.items()}, where
            assert list(dict.fromkeys((e.stage, e.microbatch) for e in by_kind["unpack"])) == \
                [key for _, key in backwards], where
            ahead += sum(loads[key].at < i - 1 for i, key in backwards)  # more than one action early
        assert ahead, f"rank {rank}: no load ran ahead of the action right before its backward"


def test_runner_options_are_checked_before_any_process_group(gpt2_runs):
    for r in gpt2_runs:
        no_checkpointing, horizon, not_bool = r["errors"]
        assert "no stage is checkpointed" in no_checkpointing and "smp.set_activation_checkpointing" in no_checkpointing
        assert "activation_loading_horizon=0 is not valid: a positive integer" in horizon
        assert "offload_activations=1 is not valid: True or False" in not_bool


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinned memory and a side stream need CUDA"))])
def test_saved_inputs_move_out_and_back_but_parameters_stay(device):
    """One process, one checkpointed function: a boundary leaf's storage is released after the forward and
    restored on load, a plain input is copied, parameters (and views of them) and empty tensors are not moved."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(device)
    x, ids = torch.randn(3, 4, device=device), torch.arange(3, device=device)

    def fn(h, i, w, w_view, empty):
        return torch.tanh(lin(h)) * i[:, None] + w.sum() * w_view.sum() + empty.sum()

    def run(offload: ActivationOffload | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        leaf = x.clone().requires_grad_()
        lin.zero_grad(set_to_none=True)
        args = (leaf, ids, lin.weight, lin.weight[:2], torch.zeros(0, device=device))
        if offload is None:
            out = checkpoint(fn, *args, use_reentrant=False)
        else:
            offload.start([Action("F", 0, 0), Action("B", 0, 0)], {0})
            offload.advance(0)
            with offload.saving(0, 0, lin, [leaf]):
                out = checkpoint(fn, *args, use_reentrant=False)
            assert leaf.untyped_storage().nbytes() == 0  # released: its bytes wait on the host
            offload.advance(1)
            assert torch.equal(leaf.detach(), x)  # restored before its backward
        out.sum().backward()
        return out.detach(), {"x": leaf.grad, "weight": lin.weight.grad, "bias": lin.bias.grad}

    want_out, want_grads = run(None)
    offload = ActivationOffload(device, horizon=1)
    got_out, got_grads = run(offload)
    assert torch.equal(got_out, want_out)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert [(e.kind, e.at, e.nbytes) for e in offload.events] == [
        ("pack", 0, 48), ("pack", 0, 24), ("load", 1, 72), ("unpack", 1, 48), ("unpack", 1, 24)]


@pytest.mark.parametrize("kwargs,needle", [
    ({"enabled": True, "horizon": 4, "checkpointed": set()}, "no stage is checkpointed"),
    ({"enabled": True, "horizon": -1, "checkpointed": {0}}, "activation_loading_horizon=-1 is not valid"),
    ({"enabled": True, "horizon": True, "checkpointed": {0}}, "activation_loading_horizon=True is not valid"),
    ({"enabled": "yes", "horizon": 4, "checkpointed": {0}}, "offload_activations='yes' is not valid"),
])
def test_bad_options_are_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        activation_offload(device="cpu", **kwargs)


def test_off_is_no_object():
    assert activation_offload(False, 4, "cpu", set()) is None
