"""Exactness: a pipelined step equals a single-process run of the unpartitioned model on the same
microbatches — loss, every parameter's gradient and every buffer (BatchNorm statistics) — for every
schedule, several rank counts and microbatch counts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp.testing import run_ranks

SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _reference(zm, m: int):
    """Single process, unpartitioned: microbatches in order, gradients of the mean microbatch loss."""
    from pipeline import microbatch

    model = zm.model
    model.zero_grad(set_to_none=True)
    mbs = microbatch.split(zm.args, zm.kwargs, m)
    targets = [t[0][0] for t in microbatch.split((zm.target,), {}, m)]
    losses = []
    for (a, kw), t in zip(mbs, targets):
        loss = zm.loss_fn(model(*a, **kw), t)
        (loss / m).backward()
        losses.append(float(loss))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    return losses, grads, buffers


def _compare(rank, runner, zm, res, ref, label):
    losses, grads, buffers = ref
    errors = []
    if not torch.allclose(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-5, atol=1e-7):
        errors.append(f"{label}: losses {res.losses} != {losses}")
    names = {id(p): n for n, p in zm.model.named_parameters()}
    local = runner.local_parameters()
    # A plan with more stages than parameterised ops may leave a rank with activations only.
    if not local and any(runner.plan.stages[st.index].param_bytes for st in runner.local_stages):
        errors.append(f"{label}: rank {rank} holds no parameters, but its plan stages own some")
    for p in local:
        n = names[id(p)]
        if p.grad is None or not torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6):
            diff = None if p.grad is None else float((p.grad - grads[n]).abs().max())
            errors.append(f"{label}: grad of {n} differs on rank {rank} (max abs diff {diff})")
    local_buffers = {id(b) for st in runner.local_stages for b in st.module.buffers()}
    for n, b in zm.model.named_buffers():
        if id(b) in local_buffers and not torch.allclose(b, buffers[n], rtol=1e-5, atol=1e-6):
            errors.append(f"{label}: buffer {n} differs on rank {rank}")
    return errors


def _exactness(rank: int, world: int, name: str, ms: tuple[int, ...], schedules: tuple[str, ...], virtual: int):
    from partitioner import partition, trace
    from pipeline import PipelineRunner, microbatch
    from smp import zoo

    zm = zoo.build(name, batch=8)
    start = {k: v.clone() for k, v in zm.model.state_dict().items()}
    errors: list[str] = []
    for m in ms:
        ref = _reference(zm, m)
        zm.model.load_state_dict(start)
        mb_args, mb_kwargs = microbatch.split(zm.args, zm.kwargs, m)[0]
        graph = trace(zm.model, mb_args, mb_kwargs)
        runs = [(s, 1) for s in schedules]
        runs += [("interleaved-virtual", virtual)] if virtual > 1 and m % world == 0 else []
        for sched, v in runs:
            # All ranks make the same plan: the cost rates are fixed here, not measured per process.
            from partitioner import DeviceRates
            plan = partition(graph, world * v, rates=DeviceRates(), microbatches=m)
            runner = PipelineRunner(plan, schedule=sched, microbatches=m, virtual_stages=v, timeout_s=30)
            res = runner.step(zm.args, zm.kwargs, target=zm.target, loss_fn=zm.loss_fn)
            errors += _compare(rank, runner, zm, res, ref, f"{name} p={world} m={m} {sched} v={v}")
            zm.model.zero_grad(set_to_none=True)
            zm.model.load_state_dict(start)
    return errors


@pytest.mark.parametrize("name", ["mlp", pytest.param("unet", marks=pytest.mark.slow), "gpt2"])
def test_two_ranks_every_schedule(name):
    errors = run_ranks(_exactness, 2, name, (1, 4), SCHEDULES, 2, timeout=180)
    assert errors == [[], []], "\n".join(sum(errors, []))


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_more_ranks_mlp(world):
    errors = run_ranks(_exactness, world, "mlp", (2, 8), SCHEDULES, 1, timeout=180)
    assert all(e == [] for e in errors), "\n".join(sum(errors, []))


class _Shifted(nn.Module):
    """Stage 1: two parameters added to the boundary path, so autograd hands them (and the path) one and
    the same gradient tensor; one output is saved by an op of the stage that reads it too, the other is a
    view."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        self.shift1 = nn.Parameter(torch.randn(4, 8))
        self.shift2 = nn.Parameter(torch.randn(4, 8))

    def forward(self, h):
        y = self.lin(h) + self.shift1 + self.shift2
        return y, self.out(y).view(h.shape[0], 2, 4)


class _Side(nn.Module):
    """Stage 2: a second output that depends on a parameter only, not on the stage's inputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.randn(4, 8))

    def forward(self, y, u):
        return self.lin(u.reshape(u.shape[0], 8)) + y, torch.tanh(self.offset)


class _SplitEdges(nn.Module):
    STAGES = {"first": 0, "mid": 1, "side": 2}  # module -> stage; the rest (the head) on stage 3

    def __init__(self):
        super().__init__()
        self.first, self.mid, self.side, self.head = nn.Linear(8, 8), _Shifted(), _Side(), nn.Linear(8, 3)

    def forward(self, x):
        a, b = self.side(*self.mid(self.first(x)))
        return self.head(a * b)


def _split_backward_edges(rank: int, world: int, m: int):
    from partitioner import DeviceRates, trace
    from partitioner.cut.portfolio import fixed_plan
    from pipeline import PipelineRunner

    torch.manual_seed(0)
    model = _SplitEdges()
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 3)
    zm = SimpleNamespace(model=model, args=(x,), kwargs={}, target=y, loss_fn=F.mse_loss)
    ref = _reference(zm, m)
    graph = trace(model, (x[:4],))
    plan = fixed_plan(graph, world, [_SplitEdges.STAGES.get(mod.split(".")[0], 3) for mod in graph.modules],
                      rates=DeviceRates(), microbatches=m)
    errors = []
    for checkpointed in ((), ("first", "mid")):
        runner = PipelineRunner(plan, schedule="zb-h1", microbatches=m, timeout_s=30, checkpoint_modules=checkpointed)
        res = runner.step((x,), target=y, loss_fn=F.mse_loss)
        errors += _compare(rank, runner, zm, res, ref, f"zb-h1 m={m} checkpointed={checkpointed}")
        model.zero_grad(set_to_none=True)
    return errors


def test_zero_bubble_split_backward_edges():
    """ZB-H1's split backward on each kind of stage: the first (no input gradient: all in W), outputs that
    are views or saved for W and parameters sharing one gradient tensor, an output that needs no input
    (fused backward in B), the loss stage; and with activation checkpointing."""
    errors = run_ranks(_split_backward_edges, 4, 3, timeout=180)
    assert all(e == [] for e in errors), "\n".join(sum(errors, []))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", ["mlp", "unet", "gpt2"])
def test_full_matrix(name, world):
    errors = run_ranks(_exactness, world, name, (1, 2, 4, 8), SCHEDULES, 2, timeout=600)
    assert all(e == [] for e in errors), "\n".join(sum(errors, []))


def _outputs(rank: int, world: int) -> list[str]:
    from partitioner import DeviceRates, partition, trace
    from pipeline import PipelineRunner, microbatch
    from smp import zoo

    zm = zoo.build("mlp", batch=8)
    runner = PipelineRunner(partition(trace(zm.model, *microbatch.split(zm.args, zm.kwargs, 4)[0]), world,
                                      rates=DeviceRates(), microbatches=4), microbatches=4, timeout_s=30)
    kept = runner.step(zm.args, zm.kwargs, target=zm.target, loss_fn=zm.loss_fn)
    grads = [p.grad.clone() for p in runner.local_parameters()]
    zm.model.zero_grad(set_to_none=True)
    dropped = runner.step(zm.args, zm.kwargs, target=zm.target, loss_fn=zm.loss_fn, return_outputs=False)
    errors = [] if dropped.losses == kept.losses else [f"losses {dropped.losses} != {kept.losses}"]
    if not all(torch.equal(g, p.grad) for g, p in zip(grads, runner.local_parameters())):
        errors.append(f"rank {rank}: gradients differ without outputs")
    if dropped.outputs is not None or dropped.microbatch_outputs is not None:
        errors.append(f"rank {rank}: return_outputs=False kept outputs")
    if rank == world - 1 and not torch.allclose(kept.outputs, zm.model(*zm.args, **zm.kwargs), atol=1e-6):
        errors.append("the kept outputs are not the model's")
    runner.close()
    return errors


def test_outputs_are_kept_only_when_asked_and_the_step_is_the_same_without():
    errors = run_ranks(_outputs, 2, timeout=120)
    assert errors == [[], []], "\n".join(sum(errors, []))


class _Skips(nn.Module):
    """Stage 1 reads three values of stage 0: two float skips and an integer index (two dtypes)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h1 = torch.relu(self.a(x))
        h2 = torch.relu(self.b(h1))
        pick = h2.argmax(-1)
        out = self.c(h2) + h1
        return out + torch.gather(h1, -1, pick.unsqueeze(-1))


def _coalesced(rank: int, world: int) -> list[str]:
    from partitioner import DeviceRates, trace
    from partitioner.cut.portfolio import fixed_plan
    from pipeline import PipelineRunner

    torch.manual_seed(0)
    model, x, y = _Skips(), torch.randn(8, 8), torch.randn(8, 8)
    want = [float(F.mse_loss(model(x[i:i + 2]), y[i:i + 2])) for i in range(0, 8, 2)]
    sum(F.mse_loss(model(x[i:i + 2]), y[i:i + 2]) / 4 for i in range(0, 8, 2)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    graph = trace(model, (x[:2],))
    first = next(i for i, m in enumerate(graph.modules) if m == "c")
    plan = fixed_plan(graph, 2, [0 if i < first else 1 for i in range(graph.num_nodes)], rates=DeviceRates())
    runner = PipelineRunner(plan, microbatches=4, timeout_s=30)
    sends: list[int] = []
    isend = runner.transport.isend
    runner.transport.isend = lambda t, *a: (sends.append(t.numel()), isend(t, *a))[1]
    res = runner.step((x,), target=y, loss_fn=F.mse_loss)
    close = torch.allclose(torch.tensor(res.losses), torch.tensor(want), rtol=1e-6)
    errors = [] if close else [f"{res.losses} != {want}"]
    names = {id(p): n for n, p in model.named_parameters()}
    errors += [f"gradient of {names[id(p)]}" for p in runner.local_parameters()
               if not torch.allclose(p.grad, grads[names[id(p)]], atol=1e-6)]
    # Per microbatch (2 rows): stage 0 sends one float message (h1 and h2, 2 x 8 each) and one integer one
    # (the index); stage 1 sends the two skips' gradients back in one message.
    want_sends = [32, 2] * 4 if rank == 0 else [32] * 4
    if sorted(sends) != sorted(want_sends):
        errors.append(f"rank {rank} sent {sends}, expected {want_sends}")
    runner.close()
    return errors


def test_the_values_of_one_edge_travel_as_one_message_per_dtype():
    errors = run_ranks(_coalesced, 2, timeout=120)
    assert errors == [[], []], "\n".join(sum(errors, []))
