"""``smp.nn.FusedLayerNorm``: apex's constructor, torch's LayerNorm arithmetic and state-dict keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import smp
from smp.runtime.compat import NoEffectWarning


def test_fused_layer_norm_is_layer_norm_with_apex_signature():
    torch.manual_seed(0)
    fused = smp.nn.FusedLayerNorm(16, 1e-6, True)  # apex's positional order
    ref = nn.LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        fused.weight.normal_(), fused.bias.normal_()
    ref.load_state_dict(fused.state_dict())
    assert sorted(fused.state_dict()) == ["bias", "weight"]
    x = torch.randn(4, 3, 16, requires_grad=True)
    y, y_ref = fused(x), ref(x)
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (gx_ref,) = torch.autograd.grad(y_ref, x, g)
    assert torch.allclose(gx, gx_ref, rtol=1e-5, atol=1e-6)


def test_fused_layer_norm_options():
    assert list(smp.nn.FusedLayerNorm([3, 4], elementwise_affine=False).parameters()) == []
    assert smp.nn.FusedLayerNorm((2, 5)).normalized_shape == (2, 5)
    assert smp.nn.FusedLayerNorm(8, dtype=torch.float64).weight.dtype == torch.float64
    with pytest.warns(NoEffectWarning, match="memory_efficient"):
        smp.nn.FusedLayerNorm(8, memory_efficient=True)
