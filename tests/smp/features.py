"""The model and training loop that the SMP feature tests share (module level: spawned ranks import them).

Exactness checks follow test_training: a single-process copy of the model trained on the same global
batches is the reference, parameters must agree to rel 1e-4 (SGD; Adam where noted)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

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


def make_batch(step: int, batch: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 16, generator=g), torch.randint(4, (batch,), generator=g)


def make_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def param_err(model, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.local_named_parameters():
        r = ref[name]
        p = p.full_tensor() if isinstance(p, DTensor) else p  # sharded data parallelism: the whole parameter
        worst = max(worst, float(((p - r).abs() / (r.abs() + 1e-3)).max().detach()))
    return worst


def module_stages(plan) -> dict[str, list[int]]:
    """Top-level module name -> the stages holding its ops."""
    out: dict[str, set[int]] = {}
    for name, module in zip(plan.graph.names, plan.graph.modules):
        if module:
            out.setdefault(module.split(".")[0], set()).add(plan.assignment[name])
    return {k: sorted(v) for k, v in out.items()}


def train(net: Net, steps: int, *, checkpoint: str | tuple[str, ...] = (), hook=None, batch: int = 8):
    """Train ``net`` with smp (already initialised) and a copy in one process (SGD + momentum); ``checkpoint``:
    the top-level module(s) whose activations are recomputed."""
    import smp

    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for name in (checkpoint,) if isinstance(checkpoint, str) else checkpoint:
        smp.set_activation_checkpointing(getattr(net, name))
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
        x, y = make_batch(step, batch)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
        losses.append(float(train_step(model, x, y).reduce_mean()))
        opt.step()
        opt.zero_grad()
    return model, {"losses": losses, "ref_losses": ref_losses, "param_err": param_err(model, reference)}


def loss_and_outputs_step():
    """A fresh ``@smp.step`` function ``(model, x, y) -> (loss, outputs)`` that trains on the cross-entropy, as SMP v1
    scripts write one (after ``smp.init``)."""
    import smp

    @smp.step
    def train_step(model, x, y):
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        return loss, out
    return train_step


def assert_exact(r: dict) -> None:
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (r["losses"], r["ref_losses"])
    assert r["param_err"] < PARAM_TOL, r["param_err"]


def shard_grad_error(model, grads: dict) -> tuple[float, int]:
    """The largest gradient difference (relative to the largest gradient) between a partitioned
    ``smp.DistributedModel`` and the single-process ``grads`` (by parameter name), each tensor-parallel shard
    against its slice of the whole gradient; and how many of this rank's parameters are shards."""
    import smp
    from partitioner.capture.program import tensor_aliases
    from partitioner.tp.shard_program import shard_tensor
    graph = model.partition_plan().traced_graph()
    alias = tensor_aliases(graph.fx.module)
    shards = {alias.get(t, t): s for t, s in graph.fx.sharding.params.items()} if smp.tp_size() > 1 else {}
    scale = max(float(g.abs().max()) for g in grads.values())
    worst, split = 0.0, 0
    for name, p in model.module.named_parameters():
        if p.is_meta:
            continue
        spec = shards.get(alias.get(name, name))
        split += spec is not None
        expected = grads[name] if spec is None else shard_tensor(grads[name], spec, smp.tp_size(), smp.tp_rank())
        worst = max(worst, float((p.grad - expected).abs().max()) / scale)
    return worst, split


def lm_run(config: dict, net: nn.Module, steps, batch, load: tuple | None = None, keep=None) -> tuple:
    """A fresh ``smp.init(config)`` training the language model ``net`` (loss from ``labels=ids``) with AdamW
    (lr 1e-2) on ``batch(k)`` for each step k of ``steps``: with ``load`` (a model and an optimizer state dict),
    from those; ``keep(model, optimizer)`` after step 0 is returned deep-copied (as smp.save's files are: state
    dicts hold live tensors that the next step updates). Returns (model, optimizer, step function, kept)."""
    import smp
    from smp.runtime import state

    state.reset()
    smp.init(config)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if load is not None:
        model.load_state_dict(load[0])
        opt.load_state_dict(load[1])

    @smp.step
    def train_step(model, ids):
        out = model(ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    kept = None
    for k in steps:
        train_step(model, batch(k))
        opt.step()
        opt.zero_grad()
        if k == 0 and keep is not None:
            kept = copy.deepcopy(keep(model, opt))
    return model, opt, train_step, kept


def shifted(net: nn.Module) -> nn.Module:
    """``net`` with every weight moved by 1: other weights, for a load to overwrite."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    return net


def with_reference(config: dict, net: nn.Module) -> tuple:
    """``smp.init(config)``, then ``net`` as an ``smp.DistributedModel`` with an AdamW (lr 1e-2) and an untouched copy
    of it with its own: (model, optimizer, reference, reference optimizer), to train side by side."""
    import smp

    smp.init(config)
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2)


def refusal(fn, *args) -> str:
    """The message ``fn(*args)`` raises, or "" when it does not raise (the message is what a test reads)."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - any refusal: its message is the result
        return str(exc)
    return ""


def advance(*optimizers) -> None:
    """One step of each optimizer, then its gradients zeroed (a model and its reference, side by side)."""
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
