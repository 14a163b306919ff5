"""An SMP v1 GPT-2 training script in the shape of SageMaker's ``train_gpt_simple.py``, run with only its import
changed: a Hugging Face ``GPT2LMHeadModel`` from a small config (random weights, nothing downloaded).

    smp launch -n 2 examples/smp_v1_gpt2.py --steps 6 --ckpt /tmp/gpt2                   # 2 pipeline stages
    smp launch -n 4 examples/smp_v1_gpt2.py --steps 6 --ckpt /tmp/gpt2                   # 2 stages x 2 replicas
    smp launch -n 2 examples/smp_v1_gpt2.py --steps 6 --ckpt /tmp/gpt2 --stop-after 3    # save at step 3, stop
    smp launch -n 2 examples/smp_v1_gpt2.py --steps 6 --ckpt /tmp/gpt2 --resume          # go on from there

As in the SMP example: the ``bf16`` config (autocast), the model computing its own loss (``labels=input_ids``), a
step that also takes the optimizer and the ``args`` namespace (objects each rank keeps its own of), token ids read
only on pp_rank 0 with empty placeholders elsewhere, and ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``
with ``user_content``. A resumed run prints the same losses as an uninterrupted one, digit for digit.
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import smp  # was: import smdistributed.modelparallel.torch as smp


def batches(args: argparse.Namespace, replica: int):
    """``args.steps`` batches of token ids, a repeating pattern with noise (learnable), per replica."""
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + replica * 10_007 + step)
        start = torch.randint(args.vocab, (args.batch, 1), generator=g)
        ids = (start + torch.arange(args.seq) * 7) % args.vocab
        noise = torch.rand(ids.shape, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(args.vocab, ids.shape, generator=g), ids)
        yield ids, torch.ones_like(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="batch per data-parallel replica")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--stop-after", type=int, default=None, help="save a checkpoint after this step and stop")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint in --ckpt")
    args = p.parse_args()

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved", "bf16": True,
              "ddp": int(os.environ.get("WORLD_SIZE", "1")) > 2})
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    model = smp.DistributedModel(GPT2LMHeadModel(config))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    start = 0
    if args.resume:
        start = smp.resume_from_checkpoint(args.ckpt, partial=True)["step"]

    @smp.step
    def train_step(model, optimizer, input_ids, attention_mask, args):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    if smp.pp_rank() == 0:  # SMP v1: only the first stage reads data
        loader = list(batches(args, smp.dp_rank()))
        smp.broadcast(len(loader), smp.PP_GROUP)
    else:
        loader = [(torch.empty(0), torch.empty(0))] * smp.recv_from(0, smp.RankType.PP_RANK)

    model.train()
    for step, (input_ids, attention_mask) in enumerate(loader):
        if step < start:
            continue
        loss_mb = train_step(model, optimizer, input_ids, attention_mask, args)
        losses = smp.allgather(float(loss_mb.reduce_mean()), smp.DP_GROUP)
        optimizer.step()
        optimizer.zero_grad()
        if smp.rank() == 0:
            print(f"step {step + 1}/{len(loader)} loss {sum(losses) / len(losses)!r}", flush=True)
        if step + 1 == args.stop_after:
            smp.save_checkpoint(args.ckpt, tag=f"step{step + 1}", partial=True, model=model, optimizer=optimizer,
                                user_content={"step": step + 1}, num_kept_partial_checkpoints=2)
            break


if __name__ == "__main__":
    main()
