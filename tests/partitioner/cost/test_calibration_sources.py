"""The published numbers the GPU profiles are calibrated with (benchmarks/published.py): complete rows, the fit."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from benchmarks.published import COLLECTIVES, GRID, ROWS, fit, gpt_tokens_per_s, rates_of, selective_share
from partitioner.cost.devices import LINKS, PROFILES, profile


def test_every_row_has_its_citation_and_numbers():
    for row in ROWS:
        assert row.source.title and row.source.url.startswith("https://"), row.key
        assert row.where, row.key
        assert row.tp * row.pp * row.dp == row.devices, row.key
        assert row.global_batch % row.dp == 0 and row.seq > 0 and row.published > 0, row.key
        assert row.unit in ("tokens/s/GPU", "TFLOP/s/GPU") and row.gpu in PROFILES, row.key
        assert row.role in ("calibrate", "held-out", "excluded") and row.priced, row.key
    assert len({r.key for r in ROWS}) == len(ROWS)


def test_sc21_is_held_out_of_the_calibration():
    sc21 = [r for r in ROWS if r.key.startswith("sc21-")]
    assert len(sc21) == 10 and all(r.role == "held-out" for r in sc21)
    assert any(r.role == "calibrate" for r in ROWS)


def test_sc21_throughput_follows_eq3_and_the_aggregate_column():
    # Table 1's aggregate: 1T on 3,072 GPUs at 163 TFLOP/s is 502 PFLOP/s; Eq. 3 gives ~8.2 TFLOP per token.
    one_t = next(r for r in ROWS if r.key == "sc21-1008B")
    assert one_t.published * one_t.devices / 1e3 == pytest.approx(502, rel=0.01)
    assert gpt_tokens_per_s(one_t) == pytest.approx(163e12 / 8.17e12, rel=0.01)


def test_fit_finds_the_efficiency_that_explains_synthetic_rows():
    # Compute-bound rows predicted at efficiency c are off by c / 0.5; the memory-bound one by m / 0.8.
    def ratios(c: float, m: float) -> list[float]:
        return [c / 0.5, 1.1 * c / 0.5, m / 0.8]

    c, m, loss = fit(ratios, compute=(0.4, 0.45, 0.5, 0.55), memory=(0.7, 0.8, 0.9))
    assert (c, m) == (0.45, 0.8) or (c, m) == (0.5, 0.8)
    assert loss == pytest.approx(min(sum(math.log(r) ** 2 for r in ratios(x, 0.8)) for x in (0.45, 0.5)))


def test_fit_refuses_rows_that_were_not_priced():
    with pytest.raises(ValueError, match="finite"):
        fit(lambda c, m: [math.inf], compute=(0.5,), memory=(0.8,))


def test_profiles_efficiencies_lie_on_the_fit_grid():
    for name in PROFILES:
        rates = profile(name)
        assert rates.compute_efficiency in GRID["compute"] and rates.memory_efficiency in GRID["memory"]
    assert rates_of(ROWS[0]).bytes_per_s == 2.4e12  # torchtitan's HBM2e H100s, not the SXM datasheet


def test_only_calibration_rows_carry_a_fitted_device_efficiency():
    """torchtitan's power-capped H100s reach their own share of the SXM peak, fitted on their calibration rows (its
    excluded rows, not priced, run on them too); the held-out rows keep the profiles' efficiencies."""
    from benchmarks.published import TITAN_H100_COMPUTE

    assert TITAN_H100_COMPUTE in GRID["compute"]
    for row in ROWS:
        fitted = "compute_efficiency" in dict(row.gpu_changes)
        assert not fitted or (row.role != "held-out" and rates_of(row).compute_efficiency == TITAN_H100_COMPUTE)
        if row.role == "held-out":
            assert rates_of(row).compute_efficiency == profile(row.gpu).compute_efficiency


def test_collective_references_name_known_links():
    for link, _, lo, hi in COLLECTIVES:
        assert link in LINKS and 0 < lo <= hi


def test_fsdp_rows_are_priced_as_sharded_data_parallelism_that_overlaps():
    for row in ROWS:
        if row.role != "excluded" and "FSDP" in row.where:
            assert row.sdp == row.dp and row.overlap, row.key  # torchtitan's FSDP shards over all its dp ranks
        if row.key.startswith("sc21-"):
            assert row.sdp == 1 and not row.overlap, row.key  # Megatron's plain data parallelism


def test_selective_checkpointing_recomputes_torchtitans_op_policy_in_the_blocks():
    block = "model.layers.0"
    graph = SimpleNamespace(kinds=["aten.embedding", "aten.linear", "aten.scaled_dot_product_attention", "aten.mul",
                                   "aten.linear"],
                            modules=["model.embed_tokens", f"{block}.self_attn.q_proj", f"{block}.self_attn",
                                     f"{block}.mlp", "lm_head"])
    assert list(selective_share(graph)) == [0.0, 0.5, 0.0, 1.0, 0.0]  # embedding and output head: outside


def test_sc21_models_compute_attention_from_score_matrices_as_2021_megatron_did():
    """SC'21 predates FlashAttention: its models are built eager, so the s x s scores and their memory-bound passes
    are priced, as that system ran them."""
    from benchmarks.published import build

    sc21 = next(r for r in ROWS if r.key == "sc21-1.7B")
    model, (ids,) = build(sc21)
    assert model.config._attn_implementation == "eager" and ids.shape == (1, 2048)
    assert model.config.hidden_size == 2304 and model.config.num_hidden_layers == 24
