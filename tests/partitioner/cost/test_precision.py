"""Training precision: 16-bit training halves floating-point activations and weights but not integer tensors,
and parameters cost what ZeRO's accounting says (Adam: 16 bytes per parameter in fp32 and in bf16)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import partitioner
from partitioner import DeviceRates
from partitioner.cost.precision import param_memory, weight_bytes
from partitioner.cut.portfolio import fixed_plan, make_problem
from tests.conftest import stage_array


class Tokens(nn.Module):
    """Token ids go through integer ops before the embedding; a frozen table sits beside a trained one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.frozen = nn.Embedding(50, 32)
        self.frozen.weight.requires_grad_(False)
        self.lin = nn.Linear(32, 32)

    def forward(self, ids):
        shifted = (ids * 3 + 1) % 50  # int64 values
        h = self.emb(shifted) + self.frozen(ids)
        return self.lin(torch.relu(h)).sum()


@pytest.fixture(scope="module")
def graph():
    return partitioner.trace(Tokens(), (torch.randint(0, 50, (4, 8)),))


def _op(g, kind):
    return next(i for i, k in enumerate(g.kinds) if k == kind)


def test_trace_records_the_floating_point_part_of_every_byte_count(graph):
    g = graph
    rem, emb = _op(g, "aten.remainder"), _op(g, "aten.embedding")
    assert g.act_bytes[emb] == 4 * 8 * 8 and g.act_float_bytes[emb] == 0       # the int64 ids it keeps
    relu = _op(g, "aten.relu")
    assert g.act_float_bytes[relu] == g.act_bytes[relu] == 4 * 8 * 32 * 4      # fp32 activations
    int_values = [v for v in set(g.value.tolist()) if g.value_float_bytes[v] == 0]
    assert int_values and all(g.value_bytes[v] > 0 for v in int_values)
    assert np.array_equal(g.param_float_bytes, g.param_bytes)                   # all weights are fp32
    assert np.all(g.move_float_bytes <= g.move_bytes) and g.move_float_bytes[rem] == 0


def test_bf16_halves_float_activations_and_crossings_not_integer_ones(graph):
    g = graph
    fp32, bf16 = (make_problem(g, 2, rates=DeviceRates(), dtype=d) for d in ("fp32", "bf16"))
    float_part = g.act_float_bytes
    assert np.array_equal(bf16.act_bytes, g.act_bytes - float_part / 2)
    rem, emb = _op(g, "aten.remainder"), _op(g, "aten.embedding")
    assert bf16.act_bytes[emb] == fp32.act_bytes[emb] > 0
    # Cut right after the integer op: its int64 value crosses at full width either way.
    stage = (np.arange(g.num_nodes) > rem).astype(np.int64)
    a, b = (fixed_plan(g, 2, stage, rates=DeviceRates(), dtype=d) for d in ("fp32", "bf16"))
    crossing = {v for e, v in enumerate(g.value.tolist()) if stage[g.src[e]] != stage[g.dst[e]]}
    ints = sum(int(g.value_bytes[v]) for v in crossing if g.value_float_bytes[v] == 0)
    floats = sum(int(g.value_bytes[v]) for v in crossing if g.value_float_bytes[v] > 0)
    assert ints > 0 and a.cut_bytes == ints + floats and b.cut_bytes == ints + floats // 2


@pytest.mark.parametrize("optimizer, per_param", [("adam", (16, 16)), ("sgd", (12, 12)), ("none", (8, 4))])
def test_parameter_memory_follows_zero(graph, optimizer, per_param):
    """Per trainable fp32 element: fp32 weights 4 + gradients 4 + state; bf16 (ZeRO, Rajbhandari et al.
    2020) weights 2 + gradients 2 + fp32 master 4 + state. A frozen weight is only its weights."""
    g = graph
    numel = g.param_bytes / 4
    trained = g.param_trainable
    for dtype, want in zip(("fp32", "bf16"), per_param):
        mem = param_memory(g, dtype, optimizer)
        assert np.allclose(mem[trained], want * numel[trained])
        assert np.allclose(mem[~trained], (4 if dtype == "fp32" else 2) * numel[~trained])
    assert np.allclose(weight_bytes(g, "bf16"), g.param_bytes / 2)
    assert np.allclose(weight_bytes(g, "tf32"), g.param_bytes)


def test_plan_reports_weights_and_memory_at_the_training_precision(graph):
    g = graph
    a, b = (partitioner.partition(g, 1, rates=DeviceRates(), dtype=d) for d in ("fp32", "bf16"))
    assert b.stages[0].param_bytes * 2 == a.stages[0].param_bytes
    assert b.stages[0].memory_bytes < a.stages[0].memory_bytes  # same Adam bytes, half the activations
    assert stage_array(a, g).tolist() == stage_array(b, g).tolist()
