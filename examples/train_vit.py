"""Knowledge distillation into a pipelined Vision Transformer with the SMP-compatible API.

    smp launch -n 2 examples/train_vit.py --steps 8
    smp launch -n 2 examples/train_vit.py --temperature 4 --alpha 0.9 --pipeline simple

A student ``transformers.ViTForImageClassification`` is wrapped in ``smp.DistributedModel`` and split into
pipeline stages. A bigger ViT teacher (built from a config with random weights: nothing is downloaded) is
frozen (``requires_grad_(False)``, eval mode) and runs as a plain torch module inside the ``@smp.step``
function: only one DistributedModel per process, and the teacher is not part of it. The teacher is called
after ``model(images)``, which returns only on the rank that holds the last pipeline stage, so that rank
alone pays for it. The loss blends the distillation term and the label loss:

    loss = alpha * KL(softmax(teacher / T) || softmax(student / T)) * T^2 + (1 - alpha) * CE(student, labels)

The images are random with a faint per-class pattern added, so the labels can be learned; a random
teacher's soft targets are a fixed function of the image, so they can be learned too.
"""
from __future__ import annotations

import argparse
import os
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
    p.add_argument("--pipeline", choices=("interleaved", "simple"), default="interleaved",
                   help="interleaved = 1F1B (default), simple = GPipe")
    p.add_argument("--partitions", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--image", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--patch", type=int, default=8, help="patch side in pixels (default 8)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument("--temperature", type=float, default=2.0, help="distillation temperature T (default 2)")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the distillation term (default 0.5)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def vit(args: argparse.Namespace, layers: int, hidden: int, heads: int) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=args.image, patch_size=args.patch, num_channels=3, hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
                       num_labels=args.classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")
    return ViTForImageClassification(config)


def make_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images, each with its class's fixed pattern added; the same on every rank (seeded by step)."""
    patterns = torch.randn(args.classes, 3, args.image, args.image, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed * 100_003 + step + 1)
    labels = torch.randint(args.classes, (args.batch,), generator=g)
    images = torch.randn(args.batch, 3, args.image, args.image, generator=g) + patterns[labels]
    return images, labels


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    smp.init({"pipeline_parallel_degree": args.partitions, "microbatches": args.microbatches,
              "pipeline": args.pipeline, "ddp": int(os.environ.get("WORLD_SIZE", "1")) > args.partitions})
    lead = smp.rank() == 0
    T, alpha = args.temperature, args.alpha

    torch.manual_seed(args.seed)  # same weights on every rank
    teacher = vit(args, layers=6, hidden=192, heads=6).requires_grad_(False).eval()
    student = vit(args, layers=4, hidden=128, heads=4)
    if lead:
        count = lambda m: sum(p.numel() for p in m.parameters()) / 1e6  # noqa: E731
        print(f"teacher ViT {count(teacher):.2f} M parameters (frozen, plain module on the last stage's rank); "
              f"student ViT {count(student):.2f} M parameters in {smp.pp_size()} pipeline stages x "
              f"{smp.dp_size()} replica(s), {args.microbatches} microbatches, pipeline={args.pipeline}")

    model = smp.DistributedModel(student)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps), eta_min=args.lr / 10)
    if lead:
        model.register_post_partition_hook(lambda m, _: print("student partition plan:\n" + m.runner.plan.summary(),
                                                              flush=True))

    @smp.step
    def train_step(model, images, labels):
        logits = model(images).logits                # returns on the last stage's rank only
        with torch.no_grad():
            soft = teacher(images).logits
        distill = F.kl_div(F.log_softmax(logits / T, dim=-1), F.log_softmax(soft / T, dim=-1),
                           log_target=True, reduction="batchmean") * T * T
        hard = F.cross_entropy(logits, labels)
        loss = alpha * distill + (1 - alpha) * hard
        model.backward(loss)
        accuracy = (logits.argmax(-1) == labels).float().mean().item()  # a Python float: comes back as a list
        return loss, distill, hard, accuracy

    model.train()
    shard = args.batch // smp.dp_size()
    for step in range(args.steps):
        t0 = time.perf_counter()
        images, labels = make_batch(step, args)
        lo, hi = smp.dp_rank() * shard, (smp.dp_rank() + 1) * shard
        loss, distill, hard, accuracy = train_step(model, images[lo:hi], labels[lo:hi])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if lead:
            acc = sum(accuracy) / len(accuracy)  # one Python float per microbatch
            print(f"step {step + 1:3d}/{args.steps}  loss {float(loss.reduce_mean()):.4f}  "
                  f"(distill {float(distill.reduce_mean()):.4f}, label CE {float(hard.reduce_mean()):.4f})  "
                  f"accuracy {acc:.2f}  {time.perf_counter() - t0:6.3f} s", flush=True)
    smp.barrier()


if __name__ == "__main__":
    main()
