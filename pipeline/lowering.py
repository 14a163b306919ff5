"""Lowering a compute schedule into one with its communication: sends and receives become actions.

For every stage edge (s, t) whose stages live on different ranks, :func:`lower` adds, as
torch.distributed.pipelining's ``_add_send_recv`` does for its IR:

* ``SEND_F(s->t, k)`` right after ``F(s, k)`` on s's rank, and ``RECV_F(t<-s, k)`` on t's rank before
  ``F(t, k)``: the activations of microbatch k;
* ``SEND_B(t->s, k)`` right after ``B(t, k)``, and ``RECV_B(s<-t, k)`` before ``B(s, k)``: the gradients.

A receive is *posted* ahead of the action that needs it, ``lookahead`` communicating actions early (W
passes receive nothing and are looked past): gloo moves a message's payload only once the receiver has
posted its receive, so a receive posted when its action starts costs a round trip of thread wake-ups on
the critical path; posting it before running the previous action lets the peer's send go out at once.
The executor (:mod:`pipeline.executor`) posts at the ``RECV`` and waits at the compute action; the
simulator (:mod:`pipeline.simulate`) checks the placement and times the same lists; :func:`fifo_violations`
reads them to tell whether a transport that matches messages by order (NCCL) would pair them right.
"""
from __future__ import annotations

from collections import defaultdict

from pipeline.schedule import Action, Schedule, StageDeps, stage_edges

__all__ = ["lower", "transfers", "fifo_violations"]


def _neighbours(schedule: Schedule, stage_deps: StageDeps) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    producers: dict[int, list[int]] = defaultdict(list)
    consumers: dict[int, list[int]] = defaultdict(list)
    for s, t in stage_edges(schedule.num_stages, stage_deps):
        consumers[s].append(t)
        producers[t].append(s)
    return producers, consumers


def lower(schedule: Schedule, stage_deps: StageDeps = None, lookahead: int = 1) -> Schedule:
    """``schedule`` with the sends and receives of every cross-rank stage edge added (see the module
    docstring); edges inside one rank need no message. ``stage_deps`` are the stage graph's edges (None:
    the chain)."""
    if schedule.lowered:
        return schedule
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    producers, consumers = _neighbours(schedule, stage_deps)
    rank_of = schedule.stage_to_rank
    out: list[list[Action]] = []
    for rank, order in enumerate(schedule.actions):
        def remote(stages: list[int], rank: int = rank) -> list[int]:
            return [s for s in stages if rank_of[s] != rank]

        def recvs(a: Action) -> list[Action]:
            if a.kind == "F":
                return [Action("RECV_F", a.stage, a.microbatch, s) for s in remote(producers[a.stage])]
            if a.kind == "B":
                return [Action("RECV_B", a.stage, a.microbatch, t) for t in remote(consumers[a.stage])]
            return []

        def sends(a: Action) -> list[Action]:
            if a.kind == "F":
                return [Action("SEND_F", a.stage, a.microbatch, t) for t in remote(consumers[a.stage])]
            if a.kind == "B":
                return [Action("SEND_B", a.stage, a.microbatch, s) for s in remote(producers[a.stage])]
            return []

        communicating = [i for i, a in enumerate(order) if a.kind != "W"]
        posted_before: dict[int, list[Action]] = defaultdict(list)
        for j, i in enumerate(communicating):
            at = communicating[j - lookahead] if j >= lookahead else 0
            posted_before[at].extend(recvs(order[i]))
        lowered: list[Action] = []
        for i, a in enumerate(order):
            lowered.extend(posted_before.get(i, ()))
            lowered.append(a)
            lowered.extend(sends(a))
        out.append(lowered)
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_stages, schedule.microbatches,
                    list(schedule.stage_to_rank), out, schedule.split_backward, lowered=True)


def _message(a: Action) -> str:
    """The message a send or receive carries, named the same on both ends."""
    src, dst = (a.stage, a.peer) if a.kind.startswith("SEND") else (a.peer, a.stage)
    what = "activation" if a.kind.endswith("F") else "gradient"
    return f"{what} mb{a.microbatch} s{src}->s{dst}"


def transfers(schedule: Schedule, stage_deps: StageDeps = None
              ) -> tuple[dict[tuple[int, int], list[str]], dict[tuple[int, int], list[str]]]:
    """Per (sending rank, receiving rank): the messages in the order the sender sends them and in the order
    the receiver posts their receives, read from the lowered lists (``schedule`` is lowered first if needed)."""
    lowered = lower(schedule, stage_deps)
    rank_of = lowered.stage_to_rank
    sent: dict[tuple[int, int], list[str]] = defaultdict(list)
    received: dict[tuple[int, int], list[str]] = defaultdict(list)
    for rank, order in enumerate(lowered.actions):
        for a in order:
            if a.kind.startswith("SEND"):
                sent[rank, rank_of[a.peer]].append(_message(a))
            elif a.kind.startswith("RECV"):
                received[rank_of[a.peer], rank].append(_message(a))
    return sent, received


def fifo_violations(schedule: Schedule, stage_deps: StageDeps = None) -> list[str]:
    """Rank pairs whose messages are received in a different order than sent, one line each.

    Transports that match point-to-point messages by order (NCCL) need this list empty; tagged
    transports (gloo with tags) do not.
    """
    sent, received = transfers(schedule, stage_deps)
    problems = []
    for src, dst in sorted(set(sent) | set(received)):
        out, into = sent[src, dst], received[src, dst]
        if out == into:
            continue
        i = next((i for i, (a, b) in enumerate(zip(out, into)) if a != b), min(len(out), len(into)))
        got = out[i] if i < len(out) else "nothing"
        want = into[i] if i < len(into) else "nothing"
        problems.append(f"rank {src} -> rank {dst}: message #{i} sent is {got} but the receiver expects {want}")
    return problems
