"""An SMP v1-style script matches a single-process run of the same global batches: every step's loss
(rel 1e-5) and the final parameters (rel 1e-4), for both pipeline kinds, pp=2 and pp=2 x dp=2."""
from __future__ import annotations

import pytest

from smp.testing import run_ranks
from tests.smp.scripts import train


def _check(results, steps):
    for r in results:
        assert len(r["losses"]) == steps
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (r["losses"], r["ref_losses"])
        assert r["param_rel_err"] < 1e-4, r["param_rel_err"]
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains


_SLOW = pytest.mark.slow  # every model and schedule runs under -m slow; each of both in the default run


@pytest.mark.parametrize("name,pipeline", [("gpt2", "interleaved"), ("cnn", "simple"), ("inception", "interleaved"),
                                           pytest.param("gpt2", "simple", marks=_SLOW),
                                           pytest.param("cnn", "interleaved", marks=_SLOW),
                                           pytest.param("inception", "simple", marks=_SLOW)])
def test_pp2(name, pipeline):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": pipeline}
    _check(run_ranks(train, 2, cfg, name, 3, 8, timeout=240), 3)


@pytest.mark.parametrize("placement", ["cluster", pytest.param("spread", marks=pytest.mark.slow)])
def test_pp2_dp2(placement):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "placement_strategy": placement}
    results = run_ranks(train, 4, cfg, "cnn", 3, 8, timeout=240)
    _check(results, 3)
    mp_groups = {tuple(r["ranks"][3]) for r in results}
    expected = {(0, 1), (2, 3)} if placement == "cluster" else {(0, 2), (1, 3)}
    assert mp_groups == expected


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
@pytest.mark.parametrize("name", ["gpt2", "inception"])
@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_pp2_dp2_models(name, pipeline, placement):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "placement_strategy": placement,
           "pipeline": pipeline}
    _check(run_ranks(train, 4, cfg, name, 3, 8, timeout=400), 3)
