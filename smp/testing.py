"""Run a function on N local ranks (gloo, localhost, a free port) and collect what each returns.

What ``torch.multiprocessing.spawn`` does, plus the process group and the results: every rank gets
``torch.distributed`` initialised on this host, one intra-op thread, the torchrun environment variables and
those of :mod:`smp.runtime.rank_env` (huge pages for large CPU tensors), and
returns a value to the caller. Failures come back as the rank's traceback text, and the whole run is
bounded by ``timeout`` so a hang fails the caller instead of hanging it. Tests and benchmarks use it; so
can a user trying the engine on one machine without ``smp launch``.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from smp.runtime.rank_env import free_port, rank_environment

__all__ = ["run_ranks"]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0,
              allow_failure: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns results by rank.

    With ``allow_failure`` a failing rank's traceback text is returned in its slot (prefixed ``FAILED``)
    instead of raising, so tests can assert on how failures are reported.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, pg_timeout), daemon=True)
             for r in range(world)]
    with rank_environment():
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
