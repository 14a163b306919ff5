"""The rules of the ops a parallel axis writes into a program (:mod:`partitioner.capture.save_rules`) against what
autograd really saves: each op runs on 2 real ranks (gloo) under saved-tensor hooks, and the walker
(:func:`partitioner.capture.autograd_saves.saved_bytes`) prices a one-op graph of it to the byte. The collectives of
tensor and sequence parallelism (DTensor redistributions) keep nothing; the vocabulary-parallel cross-entropy keeps
two storages the size of the rank's logit shard; context parallelism's token selections keep only their index and
its losses the log-softmax and the count they divide by."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from smp.testing import run_ranks

ROWS, WIDTH = 2, 16                 # a (batch, sequence, hidden) activation of SEQ tokens
SEQ, VOCAB = 8, 20
TOKENS = (1, 1, 1)                  # its sequence on dimension 1 (partitioner.tp.collectives.Tokens)
TP_COLLECTIVES = ("copy_to", "reduce_from", "gather_from", "scatter_to", "seq_reduce_scatter", "seq_gather",
                  "seq_scatter", "seq_gather_whole")


def _cases(tp: Any, cp: Any, rank: int, world: int) -> dict[str, tuple[Callable, tuple, dict]]:
    """Per case: the op, its tensor arguments (floating ones need a gradient) and the rest, by keyword."""
    from partitioner.cp import comm as C
    from partitioner.tp import collectives as T

    x = torch.randn(ROWS, SEQ, WIDTH)
    logits, target = torch.randn(ROWS * SEQ, VOCAB // world), torch.randint(0, VOCAB, (ROWS * SEQ,))
    start = rank * (VOCAB // world)
    return {
        "copy_to": (T.copy_to, (x,), {"comm": tp}),
        "reduce_from": (T.reduce_from, (x,), {"comm": tp}),
        "gather_from": (T.gather_from, (x,), {"dim": 2, "size": WIDTH * world, "comm": tp}),
        "scatter_to": (T.scatter_to, (x,), {"dim": 2, "comm": tp}),
        **{name: (getattr(T, name), (x,), {"tokens": TOKENS, "comm": tp}) for name in TP_COLLECTIVES[4:]},
        "vocab_cross_entropy": (T.vocab_cross_entropy, (logits, target),
                                {"start": start, "reduction": 1, "ignore_index": -100, "comm": tp}),
        "vocab_cross_entropy_sum": (T.vocab_cross_entropy, (logits, target),
                                    {"start": start, "reduction": 2, "ignore_index": -100, "comm": tp}),
        "cp_scatter": (C.cp_scatter, (x,), {"tokens": TOKENS, "comm": cp}),
        "cp_gather": (C.cp_gather, (x,), {"tokens": TOKENS, "comm": cp}),
        "cp_cross_entropy": (C.cp_cross_entropy, (logits, target % logits.shape[-1]), {"comm": cp}),
        "cp_group_loss": (C.cp_group_loss, (logits[:, 0], target > 2), {"reduction": 1, "comm": cp}),
    }


def _measured(fn: Callable, tensors: tuple, kwargs: dict) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves running ``fn`` (its inputs among them), and its result."""
    inputs = [t.clone().requires_grad_() if t.is_floating_point() else t for t in tensors]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs, **kwargs)
    return sum(saved.values()), out


def _predicted(fn: Callable, tensors: tuple, kwargs: dict, out: torch.Tensor) -> tuple[int, list[str]]:
    """What the walker prices a graph of the one call ``fn(*tensors, **kwargs)`` at (its comm an attribute, as a
    sharded program holds it), and the ops it has no rule for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partitioner.capture.autograd_saves import saved_bytes

    mode, root = FakeTensorMode(), torch.nn.Module()
    graph = torch.fx.Graph()

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(t.shape, dtype=t.dtype)

    args = []
    for i, t in enumerate(tensors):
        args.append(graph.placeholder(f"x{i}"))
        args[-1].meta["val"] = fake(t)
    rest = dict(kwargs)
    root.comm = rest.pop("comm")
    rest["comm"] = graph.get_attr("comm")
    call = graph.call_function(fn, tuple(args), rest)
    call.meta["val"] = fake(out)
    graph.output(call)
    saved = saved_bytes(torch.fx.GraphModule(root, graph), inputs_require_grad=True)
    return sum(b for b, _ in saved.by_node.values()), saved.unknown


def _rank(rank: int, world: int) -> dict[str, tuple[int, int, list[str]]]:
    import torch.distributed as dist

    from partitioner.cp.comm import CPComm
    from partitioner.tp.collectives import TPComm

    torch.manual_seed(rank)
    tp, cp = TPComm(world, rank), CPComm(world, rank)
    tp.bind(dist.group.WORLD)
    cp.bind(dist.group.WORLD)
    found = {}
    for name, (fn, tensors, kwargs) in _cases(tp, cp, rank, world).items():
        measured, out = _measured(fn, tensors, kwargs)
        found[name] = (measured, *_predicted(fn, tensors, kwargs, out))
    return found


@pytest.fixture(scope="module")
def priced() -> dict[str, tuple[int, int, list[str]]]:
    """Per case: (bytes autograd saved, bytes the walker predicts, ops it had no rule for), on rank 0 of 2."""
    return run_ranks(_rank, 2)[0]


@pytest.mark.parametrize("name", TP_COLLECTIVES)
def test_tensor_and_sequence_parallel_collectives_keep_nothing(priced, name) -> None:
    measured, predicted, unknown = priced[name]
    assert measured == predicted == 0 and not unknown, (name, measured, predicted, unknown)


@pytest.mark.parametrize("name", ["vocab_cross_entropy", "vocab_cross_entropy_sum"])
def test_vocab_parallel_cross_entropy_keeps_two_logit_shards(priced, name) -> None:
    measured, predicted, _ = priced[name]
    shard = ROWS * SEQ * (VOCAB // 2) * 4
    assert predicted == measured and 2 * shard < measured < 3 * shard, (measured, predicted, shard)


@pytest.mark.parametrize("name", ["cp_scatter", "cp_gather", "cp_cross_entropy", "cp_group_loss"])
def test_context_parallel_ops_keep_their_index_log_softmax_or_count(priced, name) -> None:
    measured, predicted, unknown = priced[name]
    # the loss also keeps scalars the cross-entropy rule leaves out: nll_loss's total weight, the mean's divisor
    slack = 16 if name == "cp_cross_entropy" else 0
    assert measured - slack <= predicted <= measured and not unknown, (name, measured, predicted, unknown)
