"""Restart on failure: a job that loses a rank comes back and finishes as if nothing had happened.

    smp launch -n 2 --max-restarts 1 examples/train_restart.py --ckpt /tmp/restart-a
    smp launch -n 2 --max-restarts 1 examples/train_restart.py --ckpt /tmp/restart-b --kill-at-step 5

The pattern (docs/checkpoints.md, "Restart after a failure"):

1. ``smp launch --max-restarts N`` runs the whole job again, every rank in a new rendezvous, when a rank fails,
   up to N times.
2. At start the script resumes from the newest committed checkpoint in ``--ckpt`` when there is one
   (``smp.resume_from_checkpoint``), and starts afresh otherwise. Give each job its own ``--ckpt``.
3. Every ``--save-every`` steps it saves a partial checkpoint (``smp.save_checkpoint``, keeping the last two).
   A checkpoint is committed as a unit: one that a dying rank cut off is never resumed from.
4. A step depends only on the checkpoint and on its number: weights, optimizer state and the learning-rate
   schedule come from the checkpoint (the scheduler's state in ``user_content``), the batch of step k from a
   generator seeded with k, and the model has no dropout. The resumed job repeats the steps after its
   checkpoint exactly: it ends with the losses and weights of an uninterrupted run.

``--kill-at-step K`` shows it: rank 1 kills itself (SIGKILL) when step K starts, once per ``--ckpt`` folder.
Rank 0 prints every step's loss (``repr``, every digit).
"""
from __future__ import annotations

import argparse
import os
import signal

import torch

import smp
from smp import zoo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint folder of this job; resumed from when it holds one")
    p.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    p.add_argument("--save-every", type=int, default=1, help="save a checkpoint every this many steps (default 1)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8), in 4 microbatches")
    p.add_argument("--kill-at-step", type=int, default=None, help="rank 1 SIGKILLs itself when this step starts, "
                   "the first time only (a marker file in --ckpt remembers)")
    return p.parse_args()


def counting_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, drawn from a generator seeded with the step: sequences ``(a + b * t) mod 64``
    (a learnable language), as input ids and next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    start, stride = torch.randint(64, (batch, 1), generator=g), torch.randint(1, 4, (batch, 1), generator=g)
    ids = (start + stride * torch.arange(33)) % 64
    return ids[:, :-1], ids[:, 1:]


def main() -> None:
    args = parse_args()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": int(os.environ.get("WORLD_SIZE", "1")) > 2})
    zm = zoo.build("gpt2", batch=args.batch)  # the same initial weights on every rank (seeded), no dropout
    model = smp.DistributedModel(zm.model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.95 ** step)

    start = 0
    if os.path.exists(os.path.join(args.ckpt, "newest")):  # a committed checkpoint: this is a restart
        content = smp.resume_from_checkpoint(args.ckpt)
        scheduler.load_state_dict(content["scheduler"])
        start = content["step"]
        if smp.rank() == 0:
            print(f"resumed from step {start} ({args.ckpt})", flush=True)

    @smp.step
    def train_step(model, input_ids, target):
        loss = zm.loss_fn(model(input_ids), target)
        model.backward(loss)
        return loss

    marker = os.path.join(args.ckpt, f"killed-at-step-{args.kill_at_step}")
    for step in range(start, args.steps):
        if step + 1 == args.kill_at_step and smp.rank() == 1 and not os.path.exists(marker):
            os.makedirs(args.ckpt, exist_ok=True)
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        input_ids, target = counting_batch(step, args.batch)
        loss = train_step(model, input_ids, target).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if smp.rank() == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item()!r}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            smp.save_checkpoint(args.ckpt, tag=f"step{step + 1}", model=model, optimizer=optimizer,
                                user_content={"step": step + 1, "scheduler": scheduler.state_dict()},
                                num_kept_partial_checkpoints=2)
    smp.barrier()


if __name__ == "__main__":
    main()
