"""What SageMaker's public SMP v1 GPT-2 scripts (2022-01 to 2023-06) share, reduced once: the weight-decay groups, the
evaluation over the data-parallel group and the training loop over the data files. Each revision's script passes in
what it does differently (its ``@smp.step`` call, its optimizer update, its checkpoint), so its own SMP calls stay in
its own file.

The loop, as published: data split by ``smp.dp_rank()``/``smp.dp_size()`` (``smp.rdp_*`` under ``prescaled_batch``)
and read on ``smp.pp_rank() == 0`` (:mod:`data_pipeline`); a resumed run skips the batches of its file it had trained
(``start_batch_index``); ``set_seed(args.seed)`` before the first step; the loss printed on ``smp.rank() == 0`` every
``logging_freq`` steps as ``Batch <n> Loss: <loss>``; validation every ``validation_freq`` steps under
``model.eval()`` and ``torch.no_grad()``, its loss summed with ``torch.distributed.all_reduce`` over
``smp.get_dp_process_group()`` and divided by ``smp.dp_size()``; a checkpoint every ``checkpoint_freq`` steps.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import smdistributed.modelparallel.torch as smp
import torch
from data_pipeline import create_pretraining_dataloader
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm
from transformers import set_seed

__all__ = ["param_groups_by_weight_decay", "Revision", "train", "num_params_of", "parse_args",
           "learning_rate_scheduler", "test_step", "LATE_INTS", "late_smp_config", "announce", "partition_layers",
           "adam", "checkpoint_layers", "smp_fp16_optimizer", "resume", "finish", "count_parameters",
           "seed_by_tp_rank"]


def param_groups_by_weight_decay(module: torch.nn.Module) -> tuple[dict, dict]:
    """Layer norms' parameters and biases without weight decay, the rest with; each parameter once, a module's
    weights before its bias (the scripts read ``module._parameters``)."""
    decay: dict = {"params": []}
    no_decay: dict = {"params": [], "weight_decay": 0.0}
    seen: set[int] = set()
    for m in module.modules():
        named = [(n, p) for n, p in m.named_parameters(recurse=False) if p is not None]
        for n, p in sorted(named, key=lambda item: item[0] == "bias"):
            if id(p) not in seen:
                seen.add(id(p))
                (no_decay if isinstance(m, LayerNorm) or n == "bias" else decay)["params"].append(p)
    return decay, no_decay


@smp.step
def test_step(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]


def num_params_of(model: torch.nn.Module) -> int:
    """Every parameter once (tied ones once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass
class Revision:
    """What a revision's training loop does its own way."""

    step: Callable[[Any, torch.Tensor, torch.Tensor], Any]  # (model, input_ids, attention_mask) -> StepOutput
    zero_grad: Callable[[], None]
    update: Callable[[], bool]  # the optimizer update; False when it was skipped (fp16 overflow)
    save: Callable[[int, int, int], None]  # (total_steps, file index, next batch index)
    test_step: Callable[[Any, torch.Tensor, torch.Tensor], Any]
    logged: Callable[[torch.Tensor], float] = lambda loss: loss.item()  # the loss a step prints
    log_extra: Callable[[], str] = str  # more of the line it prints


def evaluate(model: Any, dataloader: Any, batches: int, test_step: Callable) -> tuple[float, float]:
    """The validation loss averaged over the data-parallel group, and its perplexity."""
    model = model.eval()
    loss, n = 0.0, 0
    with torch.no_grad():
        for batch_idx, (input_ids, attention_mask) in enumerate(dataloader):
            if batch_idx >= batches:
                break
            loss += test_step(model, input_ids, attention_mask).reduce_mean()
            n += 1
    if not n:
        return -1.0, -1.0
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    value = (loss / smp.dp_size() / n).item()
    return value, math.exp(value)


def _paths(folder: str) -> list[str]:
    return sorted(os.path.join(folder, p) for p in os.listdir(folder) if p.endswith(".json"))


def train(model: Any, lr_scheduler: Any, start_path_index: int, start_batch_index: int, total_steps: int,
          args: argparse.Namespace, revision: Revision) -> tuple[int, float]:
    """The published loop; returns the steps trained in all and the last loss (validation loss when validating)."""
    model.train()
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()
    train_paths = _paths(args.training_dir)

    def loader(paths: list[str], batch: int, shuffle: bool) -> Any:
        return create_pretraining_dataloader(paths, batch, args.max_context_width, seed=args.seed, dp_rank=dp_rank,
                                             dp_size=dp_size, shuffle=shuffle)

    train_dataloader = loader([train_paths[start_path_index]], args.train_batch_size, args.same_seed < 1)
    val_dataloader = loader(_paths(args.test_dir), args.val_batch_size, True) if args.validation_freq else None
    start, loss_metric = time.time(), 0.0
    accumulation = getattr(args, "gradient_accumulation", 1)
    set_seed(args.seed)
    for index in range(start_path_index, args.epochs * len(train_paths)):
        if total_steps >= args.max_steps:
            break
        for batch_idx, (input_ids, attention_mask) in enumerate(train_dataloader):
            if batch_idx < start_batch_index:
                if start_batch_index == len(train_dataloader):
                    start_batch_index = 0
                    break
                continue
            start_batch_index = 0
            if total_steps >= args.max_steps:
                break
            if (batch_idx - 1) % accumulation == accumulation - 1:
                revision.zero_grad()
            loss = revision.step(model, input_ids, attention_mask).reduce_mean()
            loss_metric = loss.item()
            if batch_idx % accumulation == accumulation - 1 and revision.update():
                lr_scheduler.step()
            total_steps += 1
            if not total_steps % args.logging_freq:
                value = revision.logged(loss)
                if smp.rank() == 0:
                    print(f"({int(time.time() - start)}s), Batch {total_steps - 1} Loss: {value}{revision.log_extra()}",
                          flush=True)
            if args.validation_freq and not total_steps % args.validation_freq:
                loss_metric, _ = evaluate(model, val_dataloader, args.validation_batches, revision.test_step)
                if smp.rank() == 0:
                    print(f"Batch {total_steps - 1} Validation loss: {loss_metric}", flush=True)
                model = model.train()
            if not total_steps % args.checkpoint_freq:
                revision.save(total_steps, index % len(train_paths), batch_idx + 1)
        if total_steps >= args.max_steps:
            break
        train_dataloader = loader([train_paths[(index + 1) % len(train_paths)]], args.train_batch_size,
                                  args.same_seed < 1)
    return total_steps, loss_metric


# The arguments every revision has (the published names and defaults; the model ones are GPT-2 small's).
_INTS = {"train_batch_size": 4, "val_batch_size": 4, "max_steps": 5000, "seed": 12345, "same_seed": 0, "fp16": 0,
         "epochs": 3, "logging_freq": 1, "checkpoint_freq": 10000, "num_kept_checkpoints": 5, "load_partial": 0,
         "load_full": 0, "save_final_full_model": 0, "prescaled_batch": 1, "max_context_width": 1024,
         "vocab_size": 50257, "hidden_width": 768, "num_layers": 12, "num_heads": 12, "use_adamw": 0,
         "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "microbatches": 1, "shard_optimizer_state": 0,
         "offload_activations": 0, "fast_mode": 0, "static_mode": 0, "delayed_param": 0, "same_partition_load": 0,
         "attention_in_fp32": 0, "manual_partition": 0, "activation_checkpointing": 1, "validation_freq": 0,
         "validation_batches": 10, "skip_full_optimizer": 1, "use_wiki_data": 0, "zipped_data": 0}
_FLOATS = {"grad_clip": 1.0, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.95, "resid_pdrop": 0.1,
           "embd_pdrop": 0.1, "attn_pdrop": 0.1, "summary_first_pdrop": 0.1, "lr": 0.0001, "min_lr": 0.0,
           "warmup": 0.01, "plateau": 0.4}


def parse_args(description: str, ints: dict[str, int], floats: dict[str, float] | None = None,
               strings: dict[str, str] | None = None) -> argparse.Namespace:
    """The shared arguments, with a revision's own (``ints``, ``floats``, ``strings``: name -> default) on top; the
    paths SageMaker's environment supplied are required arguments here."""
    p = argparse.ArgumentParser(description=description)
    for name, default in {**_INTS, **ints}.items():
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in {**_FLOATS, **(floats or {})}.items():
        p.add_argument(f"--{name}", type=float, default=default)
    for name, text in {"optimize": "speed", "activation_strategy": "each", "lr-decay-style": "linear",
                       **(strings or {})}.items():
        p.add_argument(f"--{name}", type=str, default=text)
    p.add_argument("--lr_decay_iters", type=int, default=None)
    p.add_argument("--active_microbatches", type=int, default=None)
    for name in ("training-dir", "test-dir", "checkpoint-dir", "model-dir"):
        p.add_argument(f"--{name}", type=str, required=True)
    return p.parse_args()


def learning_rate_scheduler(annealing: Any, optimizer: Any, args: argparse.Namespace) -> Any:
    """The published ``get_learning_rate_scheduler``: Megatron's ``AnnealingLR`` class ``annealing`` over the
    optimizer."""
    iters = max(1, args.lr_decay_iters if args.lr_decay_iters is not None else args.max_steps)
    warmup = args.warmup * iters
    return annealing(optimizer, start_lr=args.lr, warmup_iter=warmup, plateau_iter=warmup + args.plateau * iters,
                     total_iters=iters, decay_style=args.lr_decay_style, last_iter=0, min_lr=args.min_lr,
                     use_checkpoint_lr_scheduler=args.load_partial or args.load_full, override_lr_scheduler=False)


# The arguments the 2022-10 and 2023 scripts add to the shared ones.
LATE_INTS = {"bf16": 0, "sharded_data_parallel_degree": 1, "use_distributed_transformer": 1, "checkpoint_sublayers": 0,
             "activation_loading_horizon": 4, "skip_tracing": 0, "fused_softmax": 1, "fused_dropout": 0,
             "fused_bias_gelu": 1, "gradient_accumulation": 1}


def late_smp_config(args: argparse.Namespace) -> dict[str, Any]:
    """The smp config the 2022-10 and 2023 scripts build from their arguments (before SageMaker's overrides)."""
    config = {"ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
              "pipeline_parallel_degree": args.pipeline_parallel_degree, "microbatches": args.microbatches,
              "shard_optimizer_state": args.shard_optimizer_state > 0, "prescaled_batch": args.prescaled_batch > 0,
              "fp16": args.fp16 > 0, "bf16": args.bf16 > 0, "offload_activations": args.offload_activations > 0,
              "delayed_parameter_initialization": args.delayed_param > 0, "optimize": args.optimize,
              "placement_strategy": args.placement_strategy,
              "activation_loading_horizon": args.activation_loading_horizon, "skip_tracing": args.skip_tracing > 0,
              "auto_partition": not args.manual_partition, "default_partition": 0,
              "static_mode": args.static_mode > 0, "fast_mode": args.fast_mode > 0,
              "sharded_data_parallel_degree": args.sharded_data_parallel_degree}
    if args.active_microbatches is not None:
        config["active_microbatches"] = args.active_microbatches
    return config


def announce(args: argparse.Namespace, versions: tuple[str, str], make_dirs: bool = True) -> None:
    """What every revision prints on ``smp.rank() == 0`` after ``smp.init``, and (before 2023) its folders made on
    ``smp.local_rank() == 0``."""
    if smp.rank() == 0:
        print(f"Transformers version: {versions[0]}")
        print(f"smdistributed.modelparallel version: {versions[1]}")
    if make_dirs and smp.local_rank() == 0:
        for path in (args.model_dir, args.checkpoint_dir):
            os.makedirs(path, exist_ok=True)


def partition_layers(layers: torch.nn.Module, args: argparse.Namespace) -> None:
    """Manual partition: the layers spread evenly over the stages by ``smp.set_partition``, the later stages
    taking one more."""
    if args.manual_partition:
        div, rem = divmod(args.num_layers, smp.pp_size())
        assignments = [pp for pp in range(smp.pp_size()) for _ in range(div + 1 if pp >= smp.pp_size() - rem else div)]
        for i, child in enumerate(layers.children()):
            smp.set_partition(child, assignments[i])


def adam(param_groups: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Adam, or AdamW with ``--use_adamw 1``, as every revision builds it."""
    kind = torch.optim.AdamW if args.use_adamw > 0 else torch.optim.Adam
    return kind(param_groups, betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay)


def checkpoint_layers(layers: torch.nn.Module, args: argparse.Namespace) -> None:
    """The 2022-10 and 2023 scripts' activation checkpointing: the distributed transformer's layers with a
    strategy, else each Hugging Face block."""
    if args.activation_checkpointing:
        if args.use_distributed_transformer or smp.tp_size() > 1:
            smp.set_activation_checkpointing(layers, strategy=args.activation_strategy)
        else:
            for child in layers.children():
                smp.set_activation_checkpointing(child)


def smp_fp16_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """``smp.DistributedOptimizer`` with the dynamic loss scale the 2022-10 and 2023 scripts ask for."""
    return smp.DistributedOptimizer(optimizer, static_loss_scale=None, dynamic_loss_scale=True,
                                    dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})


def resume(args: argparse.Namespace, lr_scheduler: Any) -> tuple[int, int, int]:
    """``smp.resume_from_checkpoint`` of the newest partial checkpoint (``--load_partial``) or the full model
    (``--load_full``); the steps, file and batch to go on from, and the lr scheduler's state."""
    if not (args.load_full or args.load_partial):
        return 0, 0, 0
    partial = not args.load_full
    user_content = smp.resume_from_checkpoint(args.checkpoint_dir if partial else args.model_dir,
                                              tag=None if partial else "fullmodel.pt", partial=partial)
    if "lr_scheduler" in user_content:
        lr_scheduler.load_state_dict(user_content["lr_scheduler"])
    return (user_content["total_steps"] if partial else 0, user_content.get("start_train_path_index", 0),
            user_content.get("start_batch_index", 0))


def finish(model: Any, args: argparse.Namespace, user_content: dict[str, Any]) -> None:
    """The full model saved with ``--save_final_full_model``, then ``smp.barrier()`` and the last line."""
    if args.save_final_full_model:
        smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model, user_content=user_content)
    smp.barrier()
    if smp.rank() == 0:
        print("SMP training finished successfully")


def count_parameters(model: torch.nn.Module) -> int:
    """The model's parameters, printed on ``smp.rank() == 0``."""
    n = num_params_of(model)
    if smp.rank() == 0:
        print(f"# total parameters: {n}")
    return n


def seed_by_tp_rank(args: argparse.Namespace) -> None:
    """The device of ``smp.local_rank()`` (a CUDA line: on the CPU, nothing), and, unless ``--same_seed``, a seed of
    ``seed + smp.tp_rank()`` so that the tp ranks' random streams differ."""
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
    if not args.same_seed:
        set_seed(args.seed + smp.tp_rank())
