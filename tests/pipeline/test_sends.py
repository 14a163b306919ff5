"""pipeline.sends: a posted send's tensor is freed once it has gone, not when the step ends; errors reach the step."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from pipeline.p2p import PeerError
from pipeline.sends import WAITED_BYTES, SendsInFlight
from smp.testing import run_ranks


def _sent_tensors_freed_before_the_flush(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    from pipeline.p2p import Transport

    transport = Transport(group=dist.new_group([0, 1]), rank=rank, timeout_s=30)
    freed = []
    for k in range(3):
        if rank == 0:
            t = torch.full((1 << 20,), float(k))
            ref = weakref.ref(t)
            transport.isend(t, 1, tag=k, what=f"message {k}")
            del t
            dist.barrier()  # rank 1 has it
            deadline = time.monotonic() + 10
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            freed.append(ref() is None)
        else:
            buf = torch.empty(1 << 20)
            transport.wait(transport.irecv(buf, 0, tag=k), 0, f"message {k}")
            assert torch.equal(buf, torch.full_like(buf, float(k)))
            dist.barrier()
    transport.flush()
    return freed


def test_a_sent_tensor_is_freed_once_the_peer_has_it_not_at_the_flush():
    """Gloo's send work holds its tensor until waited on: the transport's thread waits, so a step's sent activations
    and gradients do not all stay alive until the step ends."""
    assert run_ranks(_sent_tensors_freed_before_the_flush, 2)[0] == [True, True, True]


class _Work:
    def __init__(self, done: bool = False):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class _Waits:
    def __init__(self, fail_on: str | None = None):
        self.seen: list[str] = []
        self.fail_on = fail_on

    def wait(self, work: _Work, peer: int, what: str) -> None:
        self.seen.append(what)
        if what == self.fail_on:
            raise PeerError(f"{what} with rank {peer}: rank {peer} closed the connection")


def test_the_thread_waits_in_order_and_the_step_raises_its_error_at_the_next_call():
    waits = _Waits(fail_on="b")
    sends = SendsInFlight(waits.wait, waiter=True)
    for what in "abc":
        sends.add(_Work(), 1, what, WAITED_BYTES)
    with pytest.raises(PeerError, match="b with rank 1"):
        sends.flush()
    assert waits.seen == ["a", "b"]  # nothing waited on after the first failure
    sends.flush()  # raised once


def test_small_sends_wait_for_the_flush_not_the_thread():
    waits = _Waits()
    sends = SendsInFlight(waits.wait, waiter=True)
    sends.add(_Work(), 1, "small", WAITED_BYTES - 1)
    time.sleep(0.05)
    assert waits.seen == [] and len(sends) == 1
    sends.add(_Work(), 1, "large", WAITED_BYTES)
    sends.flush()
    assert waits.seen == ["large", "small"] and len(sends) == 0


def test_without_the_thread_finished_sends_are_dropped_as_new_ones_are_posted():
    waits = _Waits()
    sends = SendsInFlight(waits.wait, waiter=False)
    first, second = _Work(), _Work()
    sends.add(first, 1, "a", WAITED_BYTES)
    sends.add(second, 1, "b", WAITED_BYTES)
    first.done = True
    sends.add(_Work(), 1, "c", WAITED_BYTES)
    assert len(sends) == 2
    sends.flush()
    assert waits.seen == ["b", "c"] and len(sends) == 0


def test_the_thread_ends_with_its_transport():
    before = set(threading.enumerate())
    waits = _Waits()
    sends = SendsInFlight(waits.wait, waiter=True)
    sends.add(_Work(), 1, "a", WAITED_BYTES)
    sends.flush()
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "smp-pipeline-sends"]
    del sends, waits
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
