"""smp.runtime.rank_env: ranks started by run_ranks (and smp launch) back large CPU tensors with huge pages."""
from __future__ import annotations

import os
from pathlib import Path

from smp.testing import run_ranks

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _faults_touching_64_mib(rank: int, world: int) -> tuple[str | None, int]:
    import resource

    import torch

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)  # 64 MiB, written once: one page fault per page
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_ranks_start_with_huge_pages_for_large_tensors_and_the_caller_keeps_its_environment():
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
    got = run_ranks(_faults_touching_64_mib, 2)
    assert [env for env, _ in got] == ["1", "1"] and "THP_MEM_ALLOC_ENABLE" not in os.environ
    if THP.exists() and "[never]" not in THP.read_text():
        # 4 KiB pages would take 16,384 faults; 2 MiB pages take 32 (plus what torch's first call touches).
        assert all(faults < 4096 for _, faults in got), got


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    got = run_ranks(_faults_touching_64_mib, 2)
    assert [env for env, _ in got] == ["0", "0"]
    assert all(faults >= 16 * 2**20 * 4 // 4096 // 2 for _, faults in got), got
