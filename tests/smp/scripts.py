"""SMP v1-style training scripts run by the tests on spawned ranks (importable, so spawn can pickle them)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class MnistCNN(nn.Module):
    """The classic MNIST model-parallel example's shape: two convs, pooling, two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def build(name: str, batch: int, seed: int):
    """(model, loss_fn, batches(step) -> (args, kwargs, target)) for a model name."""
    from smp import zoo

    if name == "cnn":
        torch.manual_seed(seed)
        model = MnistCNN()

        def batches(step: int):
            g = torch.Generator().manual_seed(1000)  # one batch, so the loss must fall
            return (torch.randn(batch, 1, 28, 28, generator=g),), {}, torch.randint(0, 10, (batch,), generator=g)
        return model, lambda out, t: F.nll_loss(out, t), batches
    zm = zoo.build(name, batch=batch, seed=seed)
    return zm.model, zm.loss_fn, lambda step: zoo.make_batch(name, batch, seed=1000)


def _shard(value, index: int, count: int):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.chunk(count)[index] if isinstance(x, torch.Tensor) and x.dim() else x, value)


def train(rank: int, world: int, config: dict, name: str, steps: int, batch: int):
    """Train ``steps`` steps with smp; return per-step losses, the reference's, and max param errors."""
    import smp

    smp.init(config)
    model, loss_fn, batches = build(name, batch, seed=0)
    reference = copy.deepcopy(model)
    # SGD with momentum: linear in the gradient, so float-level gradient noise stays float-level. (Adam
    # turns the ~1e-10 noise on mathematically-zero gradients, e.g. attention key biases, into +-lr steps.)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    @smp.step
    def train_step(model, args, kwargs, target):
        out = model(*args, **kwargs)
        loss = loss_fn(out, target)
        model.backward(loss)
        return loss

    # Sharded data parallelism clips the global gradient norm (SMP's sdp_gradient_clipping, 1.0 by default).
    clip = config.get("sdp_gradient_clipping", 1.0) if config.get("sharded_data_parallel_degree", 1) > 1 else 0
    losses, ref_losses, norms = [], [], []
    for step in range(steps):
        args, kwargs, target = batches(step)
        ref_loss = loss_fn(reference(*args, **kwargs), target)
        ref_opt.zero_grad()
        ref_loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))
        d, n = smp.dp_rank(), smp.dp_size()
        out = train_step(model, _shard(args, d, n), _shard(kwargs, d, n), _shard(target, d, n))
        shard_losses = smp.allgather(float(out.reduce_mean()), smp.CommGroup.DP_GROUP)
        losses.append(sum(shard_losses) / len(shard_losses))
        opt.step()
        opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    # Under tensor parallelism a rank holds shards of what the reference holds whole: compare the gathered model.
    held = [(k, v) for k, v in model.state_dict().items() if k in ref_params] if smp.tp_size() > 1 else \
        model.local_named_parameters()
    for pname, p in held:
        r = ref_params[pname]
        p = p.full_tensor() if isinstance(p, DTensor) else p  # a sharded parameter, gathered (sdp)
        worst = max(worst, float(((p - r).abs() / (r.abs() + 1e-3)).max().detach()))
    return {"losses": losses, "ref_losses": ref_losses, "param_rel_err": worst, "ref_norms": norms,
            "ranks": (smp.rank(), smp.pp_rank(), smp.dp_rank(), smp.get_mp_group(), smp.get_dp_group())}


# Placed by hand: every rank builds its stages itself, so no rank waits for rank 0 to partition the model in the
# first step (the tests with timeouts of a few seconds need that on a busy host). Use with MANUAL in the config.
MANUAL = {"auto_partition": False, "default_partition": 0}


def two_stage_mlp(*widths: int) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with ReLU between (seed 0), the last one on stage 1."""
    import smp

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    net = nn.Sequential(*layers[:-1])
    smp.set_partition(net[-1], 1)
    return net


def mlp_step(config: dict, widths: tuple[int, ...] = (16, 16, 4), after_backward=None):
    """``smp.init`` (2 stages, 2 microbatches, manual placement, ``config`` on top), a :func:`two_stage_mlp` and
    an ``@smp.step`` training step ``train_step`` over one fixed batch; returns ``(model, step)``, where
    ``step()`` runs it. ``after_backward()``, if given, runs in the step right after ``model.backward``."""
    import torch.nn.functional as F

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **MANUAL, **config})
    model = smp.DistributedModel(two_stage_mlp(*widths))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, widths[0], generator=g), torch.randint(widths[-1], (8,), generator=g)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        if after_backward is not None:
            after_backward()
        return loss

    return model, lambda: train_step(model, x, y)


def outcome(fn) -> tuple[str, str, float]:
    """Call ``fn()``: ("ok", "", seconds), or the exception's class name, message and the seconds until it."""
    import time

    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0
