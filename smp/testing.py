"""Run a function on N local ranks (gloo, localhost, a store the caller holds) and collect what each returns.

What ``torch.multiprocessing.spawn`` does, plus the process group and the results: every rank gets
``torch.distributed`` initialised on this host, one intra-op thread, the caller's environment with the torchrun
variables and those of :mod:`smp.runtime.rank_env` (huge pages for large CPU tensors), and
returns a value to the caller. Ranks are forked from a fork server that has imported torch and smp (and
transformers, when the caller has): a new rank starts in about 0.05 s instead of the 2-4 s its imports take, which
was most of a short multi-rank run (:func:`_context`). Failures come back as the rank's traceback text, and the
whole run is bounded by ``timeout`` so a hang fails the caller instead of hanging it. Tests and benchmarks use it;
so can a user trying the engine on one machine without ``smp launch``.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import queue
import sys
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch.multiprocessing as mp

from smp.runtime import state
from smp.runtime.rank_env import RANK_ENV, rank_environment

__all__ = ["run_ranks", "process_context"]


# What the fork server imports before it forks ranks, of what the caller has imported (transformers: 2 s alone).
_PRELOAD = ("torch", "torch.distributed", "smp", "smp.testing", "transformers", "pipeline")


@functools.cache
def _fork_server() -> tuple[Any, dict[str, str | None]]:
    """The fork server's context, and the values of :data:`~smp.runtime.rank_env.RANK_ENV` it starts with (torch
    reads them once per process, so its forked ranks keep them)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
    return ctx, {k: os.environ.get(k) for k in RANK_ENV}


@contextlib.contextmanager
def process_context() -> Iterator[Any]:
    """The multiprocessing context ranks (and a test's other processes) start in, with the ranks' environment
    (:func:`~smp.runtime.rank_env.rank_environment`) while the block runs, so that processes started in it, and the
    fork server when they are its first, start with it: forked from a fork server that imported :data:`_PRELOAD`
    once (the server, not the caller, is forked: no threads or CUDA state are inherited); spawned where there is no
    fork server, or where the caller's :data:`~smp.runtime.rank_env.RANK_ENV` is not the one the server started
    with."""
    with rank_environment():
        if "forkserver" not in mp.get_all_start_methods():
            yield mp.get_context("spawn")
            return
        ctx, started_with = _fork_server()
        yield ctx if started_with == {k: os.environ.get(k) for k in RANK_ENV} else mp.get_context("spawn")


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, pg_timeout: float,
            env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.clear()  # a forked rank has the fork server's environment: the caller's is the one it runs in
    os.environ.update(env)
    # The store is the caller's, as torchrun's agent holds it: it outlives a rank that ends, so its peers still read
    # why (with rank 0 holding it, they saw only that rank 0 had gone).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE=str(True))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world, *args)
        # By value: torch's queue would share tensors by file descriptor, which the parent can fetch only while
        # this process lives, and it exits right after.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # smp's exit handler first: a forked rank leaves through os._exit, which runs none.
        for close in (state.shutdown, dist.destroy_process_group):
            try:
                close()
            except Exception:
                pass


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0,
              allow_failure: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns results by rank.

    With ``allow_failure`` a failing rank's traceback text is returned in its slot (prefixed ``FAILED``)
    instead of raising, so tests can assert on how failures are reported.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout))
    port = store.port
    with process_context() as ctx:
        results = ctx.Queue()
        env = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, pg_timeout, env), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    got: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(got) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not finish within {timeout} s")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead and all(p.exitcode not in (None, 0) for p in (procs[r] for r in dead)):
                    for r in dead:
                        got[r] = f"FAILED: rank {r} exited with code {procs[r].exitcode}"
                continue
            got[rank] = pickle.loads(out) if ok else f"FAILED: {out}"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in got.items() if isinstance(v, str) and v.startswith("FAILED")}
    if failed and not allow_failure:
        raise AssertionError("\n".join(f"rank {r}:\n{v}" for r, v in sorted(failed.items())))
    return [got[r] for r in range(world)]
