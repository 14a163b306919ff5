"""Memory: 1F1B is real. Stage s holds at most min(p - s, m) microbatches' activations at once under 1F1B,
all m under GPipe, min(p + 1, m) under ZB-H1 (held until W) — counted by the executor
(``runner.executor.peak_held``) and, independently, by the bytes of the tensors autograd actually keeps alive
for backward on each rank."""
from __future__ import annotations

import pytest
import torch

from smp.testing import run_ranks

WIDTH, MB_ROWS, LAYERS = 64, 4, 8


class _SavedBytes:
    """Live bytes of the tensors autograd saves for backward (parameters excluded, the same memory counted
    once), and their peak, via ``saved_tensors_hooks``: a packed tensor counts until autograd frees it.
    A saved tensor is keyed by (address, bytes) rather than by storage: a microbatch is a view into the
    whole batch's storage and must count only its own slice."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[tuple[int, int], int] = {}
        self.nbytes: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def hooks(self):
        counter = self

        class Holder:
            __slots__ = ("t", "key")

            def __init__(self, t: torch.Tensor):
                # Detached: the tensor itself (its grad_fn) would be a reference cycle through the node that
                # saves it, which only a backward without retain_graph breaks (a split backward's B keeps it).
                self.t = t.detach()
                if t.untyped_storage().data_ptr() in counter.params:
                    self.key = None
                    return
                self.key = (t.data_ptr(), t.numel() * t.element_size())
                if counter.refs.get(self.key, 0) == 0:
                    counter.nbytes[self.key] = self.key[1]
                    counter.live += counter.nbytes[self.key]
                    counter.peak = max(counter.peak, counter.live)
                counter.refs[self.key] = counter.refs.get(self.key, 0) + 1

            def __del__(self):
                if self.key is None:
                    return
                counter.refs[self.key] -= 1
                if counter.refs[self.key] == 0:
                    counter.live -= counter.nbytes.pop(self.key)

        return torch.autograd.graph.saved_tensors_hooks(Holder, lambda h: h.t)


# Stage of each of the 17 ops (8 x Linear, Tanh, then the output), pinned: the bytes a stage saves per
# microbatch must not depend on what the partitioner's objective favours this year.
PLACEMENT = {2: [0] * 8 + [1] * 9, 4: [0] * 6 + [1] + [2] * 2 + [3] * 8}


def _peaks(rank: int, world: int, ms: tuple[int, ...]):
    from partitioner import DeviceRates, trace
    from partitioner.cut.portfolio import fixed_plan
    from pipeline import PipelineRunner

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    # One plan for every m: the microbatch shape is the same, only the batch grows.
    plan = fixed_plan(trace(model, (torch.randn(MB_ROWS, WIDTH),)), world, PLACEMENT[world], rates=DeviceRates(),
                      microbatches=max(ms))
    out = {}
    for m in ms:
        x, y = torch.randn(m * MB_ROWS, WIDTH), torch.randn(m * MB_ROWS, WIDTH)
        for sched in ("1f1b", "gpipe", "zb-h1"):
            runner = PipelineRunner(plan, schedule=sched, microbatches=m, timeout_s=30)
            saved = _SavedBytes(list(model.parameters()))
            with saved.hooks():
                res = runner.step((x,), target=y, loss_fn=torch.nn.functional.mse_loss)
            assert len(res.losses) == m
            model.zero_grad(set_to_none=True)
            (stage,) = runner.schedule.stages_of(runner.rank)
            out[(m, sched)] = (stage, dict(runner.executor.peak_held), saved.peak, saved.live)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_in_flight_activations(world):
    ms = (8, 3) if world == 4 else (8,)
    results = run_ranks(_peaks, world, ms, timeout=120)
    for m in ms:
        for rank, got in enumerate(results):
            stage, held_1f1b, bytes_1f1b, left_1f1b = got[(m, "1f1b")]
            _, held_gpipe, bytes_gpipe, left_gpipe = got[(m, "gpipe")]
            _, held_zb, bytes_zb, left_zb = got[(m, "zb-h1")]
            assert stage == rank
            want = min(world - stage, m)
            # ZB-H1: the F/B order of 1F1B, but a microbatch is held until its W, and rank s defers its first
            # s W's (p - s warm-up forwards + s deferred W's + the F that precedes each step's W).
            want_zb = min(world + 1, m)
            assert held_1f1b == {stage: want}, f"p={world} m={m} rank {rank}: 1f1b held {held_1f1b}, want {want}"
            assert held_gpipe == {stage: m}, f"p={world} m={m} rank {rank}: gpipe held {held_gpipe}, want {m}"
            assert held_zb == {stage: want_zb}, f"p={world} m={m} rank {rank}: zb-h1 held {held_zb}, want {want_zb}"
            # Real memory agrees: every saved activation is freed by the end of the step, and the peak
            # bytes scale with the microbatches held (each one's activations are the same size).
            assert left_1f1b == 0 and left_gpipe == 0 and left_zb == 0, (left_1f1b, left_gpipe, left_zb)
            assert bytes_gpipe > 0
            ratio = bytes_1f1b / bytes_gpipe
            assert ratio == pytest.approx(want / m, rel=0.05), (
                f"p={world} m={m} stage {stage}: saved-tensor peak 1f1b {bytes_1f1b} B vs gpipe {bytes_gpipe} B "
                f"(ratio {ratio:.3f}), expected about {want}/{m}")
            # The last stage's B already frees the loss side of the graph (W needs only the parameters' side).
            ratio_zb = bytes_zb / bytes_gpipe
            if stage < world - 1:
                assert ratio_zb == pytest.approx(want_zb / m, rel=0.05), (stage, ratio_zb, want_zb, m)
            else:
                assert ratio_zb <= want_zb / m * 1.05, (stage, ratio_zb, want_zb, m)
    # The headline: on stage 0, 1F1B holds p microbatches where GPipe holds all m.
    stage0 = results[0][(8, "1f1b")]
    assert stage0[1] == {0: min(world, 8)} and results[0][(8, "gpipe")][1] == {0: 8}
