"""The one definition of a step's throughput and MFU (partitioner.cost.throughput)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from partitioner.cost.devices import profile
from partitioner.cost.throughput import batch_counts, measure, model_flops, peak_flops_per_s


def _plan(flops=(1e9, 2e9), rates=None, dtype="bf16"):
    return SimpleNamespace(stages=[SimpleNamespace(flops=f) for f in flops], rates=rates or {},
                           options={"dtype": dtype})


def test_samples_from_the_first_tensor_and_no_tokens_for_features():
    mbs = [{"x": torch.randn(4, 16), "y": torch.randint(3, (4,))}] * 2
    assert batch_counts(mbs) == (8, None)


def test_tokens_from_the_ids_input_not_masks_or_type_ids():
    ids = torch.randint(100, (2, 5))
    mb = {"input_ids": ids, "attention_mask": torch.ones(2, 5, dtype=torch.long),
          "token_type_ids": torch.zeros(2, 7, dtype=torch.long)}
    assert batch_counts([mb, mb, mb]) == (6, 30)
    assert batch_counts([{"x": ids}]) == (2, 10)  # the only input, integer 2-d: token ids
    assert batch_counts([{"x": ids, "mask": ids}]) == (2, None)  # two unnamed integer inputs: undecided


def test_model_flops_count_three_forwards_for_training():
    assert model_flops(_plan(), 4, train=True) == 3e9 * 4 * 3
    assert model_flops(_plan(), 4, train=False) == 3e9 * 4


def test_mfu_against_the_profile_peak_in_the_training_dtype():
    rates = profile("h100-80gb").to_dict()
    assert peak_flops_per_s(_plan(rates=rates)) == 989.5e12
    assert peak_flops_per_s(_plan(rates=rates, dtype="fp32")) == 67e12
    t = measure(_plan(rates=rates), 0.5, [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}] * 4, True, 2)
    assert t.model_flops == 3e9 * 4 * 3 and t.samples == 8 and t.tokens == 64
    assert t.flops_per_s_per_device == pytest.approx(t.model_flops / (0.5 * 2))
    assert t.mfu == pytest.approx(t.flops_per_s_per_device / 989.5e12)
    assert t.samples_per_s == 16 and t.tokens_per_s == 128
    assert t.to_dict()["samples_per_s"] == 16 and "MFU" in str(t)


def test_no_rates_no_mfu():
    t = measure(_plan(), 1.0, [{"x": torch.randn(3, 2)}], False, 1)
    assert t.peak_flops_per_s is None and t.mfu is None and t.tokens_per_s is None and "MFU" not in str(t)


def test_no_mfu_on_this_machines_measured_profile():
    # The calibrated cpu profile's rate is a 512 x 512 matmul timed here, not a peak: a share of it would read as a
    # GPU's MFU (30% at 0.03 TFLOP/s). Hand-made rates are the user's peak.
    from partitioner.cost.devices import DeviceRates

    cpu = DeviceRates(name="cpu", flops_per_s=1e11).to_dict()
    t = measure(_plan(rates=cpu, dtype="fp32"), 0.5, [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}], True, 1)
    assert peak_flops_per_s(_plan(rates=cpu)) is None and t.mfu is None and "MFU" not in str(t)
    assert t.flops_per_s_per_device == pytest.approx(3e9 * 3 / 0.5)  # the rate itself stays
    assert peak_flops_per_s(_plan(rates=DeviceRates(flops_per_s=1e11).to_dict(), dtype="fp32")) == 1e11
