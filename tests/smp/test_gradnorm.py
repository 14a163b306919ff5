"""smp.engine.gradnorm in one process: the norm and the clipping of torch's ``clip_grad_norm_``, by device and dtype."""
from __future__ import annotations

import math

import pytest
import torch

from smp.engine.gradnorm import clip_grad_norm_


def _params(seed: int, half: torch.dtype = torch.bfloat16) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in [((5, 3), torch.float32), ((7,), half), ((2, 2, 2), torch.float32)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 3).to(dtype)
        params.append(p)
    return params + [torch.nn.Parameter(torch.zeros(4))]  # no gradient: skipped


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_matches_torch_over_mixed_dtypes(norm_type):
    """Each norm in float32 (torch's clip_grad_norm_ takes a bf16 gradient's in bf16): against torch in float32."""
    ours, theirs = _params(0), [torch.nn.Parameter(p.float()) for p in _params(0)]
    for a, b in zip(ours, theirs):
        b.grad = None if a.grad is None else a.grad.float().clone()
    got = clip_grad_norm_(ours, 1.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    assert float(got) > 1.5, "the gradients were big enough to be clipped"
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=1e-2 if a.dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_an_infinite_bound_returns_the_norm_and_leaves_the_gradients_as_they_are():
    params = _params(1)
    params[0].grad[0, 0] = float("inf")  # torch would scale by inf / inf: every gradient NaN
    before = [p.grad.clone() for p in params[:3]]
    total = clip_grad_norm_(params, math.inf)
    assert math.isinf(float(total))
    for p, b in zip(params[:3], before):
        assert torch.equal(p.grad, b)
