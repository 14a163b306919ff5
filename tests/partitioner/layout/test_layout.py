"""``partitioner.layout.layout``: a layout checks itself, names the bad value, and flattens into one JSON row."""
from __future__ import annotations

import pytest

from partitioner.layout.layout import Layout, Proposal, Score, partition_pipeline


def test_a_layout_counts_its_devices_stages_and_batch() -> None:
    lay = Layout(pp=4, tp=2, dp=8, microbatch_size=2, microbatches=16, schedule="interleaved-virtual",
                 virtual_stages=2, zero1=True, placement="PDT")
    assert (lay.devices, lay.stages, lay.replica_batch, lay.global_batch) == (64, 8, 32, 256)
    assert lay.describe() == "pp4 tp2 dp8, 16 x 2 samples, interleaved-virtual v=2, zero1, PDT"
    assert partition_pipeline("gpipe") == "gpipe" and partition_pipeline("zero-bubble") == "1f1b"


@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 0}, "Layout.pp must be a positive integer, got 0"),
    ({"schedule": "1f1f"}, "schedule '1f1f' is not known"),
    ({"virtual_stages": 2}, "virtual_stages=2 with schedule '1f1b'"),
    ({"schedule": "interleaved-virtual"}, "needs virtual_stages >= 2"),
    ({"schedule": "interleaved-virtual", "virtual_stages": 2, "microbatches": 3}, "microbatches % pp == 0"),
    ({"checkpointing": "selective"}, "checkpointing 'selective' is not known"),
    ({"placement": "TPD"}, "placement 'TPD' is not known"),
    ({"sdp": 3}, "sdp=3 must divide dp=4"),
    ({"sdp": 2, "zero1": True}, "zero1 and sdp > 1"),
])
def test_a_bad_layout_says_what_is_wrong(kwargs: dict, message: str) -> None:
    base = {"pp": 2, "tp": 1, "dp": 4, "microbatch_size": 1, "microbatches": 4}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        Layout(**{**base, **kwargs})


def test_a_proposal_is_one_flat_row_with_the_keys_scripts_read() -> None:
    score = Score(step_s=2.0, pipeline_s=1.5, dp_comm_s=0.5, samples_per_s=32.0, tokens_per_s=None,
                  flops_per_s_per_device=1e12, mfu=0.5, memory_bytes=10, budget_bytes=8, bubble=0.1,
                  exposed_comm_s=0.6, tp_comm_s=0.0)
    row = Proposal(Layout(pp=2, tp=1, dp=4, microbatch_size=2, microbatches=4), score).to_dict()
    for key in ("pp", "tp", "dp", "sdp", "microbatch_size", "microbatches", "schedule", "virtual_stages",
                "checkpointing", "step_s", "samples_per_s", "tokens_per_s", "mfu", "memory_bytes"):
        assert key in row, key
    assert not score.fits and Score(**{**score.to_dict(), "budget_bytes": None}).fits
