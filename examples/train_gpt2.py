"""Train a small GPT-2 language model pipelined over processes with the SMP-compatible API.

    smp launch -n 2 examples/train_gpt2.py --steps 8
    smp launch -n 2 examples/train_gpt2.py --pipeline simple --microbatches 8 --batch 16
    smp launch -n 4 examples/train_gpt2.py --partitions 2          # 2 stages x 2 data-parallel replicas

The model is ``transformers.GPT2LMHeadModel`` built from a config (random weights, nothing downloaded;
tied input/output embeddings, so the partitioner has a parameter used on both ends of the model). The
data is a synthetic "counting" language, ``x[t] = (a + b * t) mod 64`` with a random start ``a`` and
stride ``b`` in 1..3: first the model learns which 64 tokens occur at all (the loss falls from ln 512 towards
ln 64 within a few steps), then to count.

The script is written the way a SageMaker model-parallel (v1) script is, with ``import smp`` in place of
``import smdistributed.modelparallel.torch as smp``: ``smp.init``, ``smp.DistributedModel``,
``smp.DistributedOptimizer`` (with an lr scheduler), an ``@smp.step`` function that calls ``model(...)``
and ``model.backward(loss)``, ``StepOutput.reduce_mean()``, the rank helpers, and a partial checkpoint
written with ``smp.save`` at the end. Rank 0 prints the partition plan after the first step (with ``--plan``, which
file it is), and the loss and time of every step, with a word on the steps that do more than train: the first
traces the model, the last profiled one writes the profile.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F

import smp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--batch", type=int, default=16, help="global batch size (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--pipeline", choices=("interleaved", "1f1b", "simple", "gpipe"), default="interleaved",
                   help="interleaved or 1f1b = 1F1B (default), simple or gpipe = GPipe")
    p.add_argument("--partitions", type=int, default=2, help="pipeline stages (default 2); the remaining "
                   "factor of the process count becomes data parallelism")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--modulus", type=int, default=64, help="the counting language uses tokens 0 .. modulus-1 "
                   "(default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    p.add_argument("--warmup", type=int, default=2, help="linear warm-up steps before cosine decay (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", default=None, help="profile steps 2 .. --steps into DIR (the smp "
                   "config key \"profile\"); `smp report DIR` explains it")
    p.add_argument("--plan", metavar="FILE", default=None, help="train with this partition plan (the smp config "
                   "key \"partition_file\"; `smp inspect --json FILE`, `smp replan`); default: partition on rank 0")
    p.add_argument("--out", default=None, help="directory for the partial checkpoint (default: a temporary "
                   "directory, removed at exit)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
                        attn_implementation="eager")  # eager attention: matmuls the partitioner can see
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    return GPT2LMHeadModel(config)


def counting_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """The global batch of ``step``: the same on every rank (seeded by the step), sliced per replica below."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(args.modulus, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq + 1)) % min(args.modulus, args.vocab)


def step_note(step: int, args: argparse.Namespace) -> str:
    """Why a step's time stands out: the first step traces the model (and partitions it, without ``--plan``) and
    builds its stages; the last profiled step writes the profile."""
    if step == 0:
        return ("  (the first step traces the model and builds its stages)" if args.plan else
                "  (the first step traces and partitions the model and builds its stages)")
    if args.profile and step == args.steps - 1:
        return "  (and writes the profile)"
    return ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    smp.init({
        "pipeline_parallel_degree": args.partitions,
        "microbatches": args.microbatches,
        "pipeline": args.pipeline,
        "ddp": int(os.environ.get("WORLD_SIZE", "1")) > args.partitions,
        **({"profile": {"dir": args.profile, "steps": [1, args.steps]}} if args.profile else {}),
        **({"partition_file": args.plan} if args.plan else {}),
    })
    if args.batch % (smp.dp_size() * args.microbatches):
        raise SystemExit(f"--batch {args.batch} must divide into {smp.dp_size()} replica(s) x "
                         f"{args.microbatches} microbatches")
    lead = smp.rank() == 0

    # Where everybody is: rank 0 gathers one line per rank.
    where = smp.allgather(f"rank {smp.rank()}: pp_rank {smp.pp_rank()}, dp_rank {smp.dp_rank()}, "
                          f"pipeline {smp.get_mp_group()}, replicas {smp.get_dp_group()}")
    if lead:
        print(f"GPT-2 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}) on {smp.size()} processes: "
              f"{smp.pp_size()} pipeline stages x {smp.dp_size()} data-parallel replica(s), {args.microbatches} "
              f"microbatches, pipeline={args.pipeline}")
        for line in where:
            print("  " + line)

    # The ops timed on rank 0 (SMP's option): the plan, and the step it predicts, are what this machine pays.
    model = smp.DistributedModel(build_model(args), trace_execution_times=True)

    def show_plan(model: smp.DistributedModel, optimizer) -> None:
        if lead and args.plan:  # a plan given is printed already (smp inspect, smp demo): say which one it is
            print(f"partition plan: {args.plan} ({model.runner.plan.num_stages} stages)", flush=True)
        elif lead:
            print("partition plan:")
            print(model.runner.plan.summary(), flush=True)

    model.register_post_partition_hook(show_plan)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 10 %
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)

    @smp.step
    def train_step(model, ids, targets):
        logits = model(ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        model.backward(loss)
        return loss

    # A temporary checkpoint directory, made once and shared: rank 0 broadcasts its path.
    out = args.out
    if out is None:
        if lead:
            out = tempfile.mkdtemp(prefix="smp-gpt2-")
            smp.broadcast(out, smp.CommGroup.WORLD)
        else:
            out = smp.recv_from(0, smp.RankType.WORLD_RANK)

    model.train()
    shard = args.batch // smp.dp_size()
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = counting_batch(step, args)[smp.dp_rank() * shard:(smp.dp_rank() + 1) * shard]
        output = train_step(model, tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        loss = float(output.reduce_mean())
        if smp.dp_size() > 1:  # each replica saw its own shard: average over them
            losses = smp.allgather(loss, smp.CommGroup.DP_GROUP)
            loss = sum(losses) / len(losses)
        if lead:
            print(f"step {step + 1:3d}/{args.steps}  loss {loss:.4f}  lr {lr:.2e}  "
                  f"{time.perf_counter() - t0:6.3f} s{step_note(step, args)}", flush=True)

    # Partial checkpoint, SMP v1's files: PATH_<mp_rank> from each pipeline rank of replica 0, committed by
    # PATH.manifest.json (sizes and checksums) once every rank has written its file.
    path = os.path.join(out, "gpt2")
    smp.save(model.local_state_dict(), path + ".model", partial=True)
    smp.save(optimizer.local_state_dict(), path + ".optimizer", partial=True)
    smp.barrier()
    if lead:
        files = sorted(f for f in os.listdir(out) if f.startswith("gpt2."))
        if args.out is None:  # a temporary directory: say what was written, then remove it as --help promises
            shutil.rmtree(out, ignore_errors=True)
            print(f"wrote and removed a partial checkpoint ({', '.join(files)}); pass --out DIR to keep it (the "
                  "run ends by saving one to show that smp.save works; without --out it goes to a temporary folder)")
        else:
            print(f"saved partial checkpoint: {', '.join(files)} in {out}")


if __name__ == "__main__":
    main()
