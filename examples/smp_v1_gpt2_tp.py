"""SMP v1's GPT-2 recipe at tensor degree: the calls of SageMaker's published ``train_gpt_simple.py`` (late 2022),
in its order and with its arguments, on ``import smp``; only the data (synthetic token ids, nothing downloaded)
and the GPU lines differ. The model is a Hugging Face ``GPT2LMHeadModel`` created under ``smp.model_creation``,
which ``smp.DistributedModel`` replaces by SMP's ``DistributedTransformerLMHead`` (``--use_distributed_transformer
1``, the published default), split over the tensor-parallel ranks.

    smp launch -n 2 examples/smp_v1_gpt2_tp.py --tensor_parallel_degree 2 --max_steps 6      # tp2
    smp launch -n 4 examples/smp_v1_gpt2_tp.py --tensor_parallel_degree 2 --pipeline_parallel_degree 2 \\
        --microbatches 2 --max_steps 6                                                        # tp2 x pp2
    smp launch -n 4 examples/smp_v1_gpt2_tp.py --tensor_parallel_degree 2 --max_steps 6      # tp2 x dp2
    ... --checkpoint_freq 3 --checkpoint-dir /tmp/ckpt, then again with --load_partial 1     # save, resume

What it does, as the published script: the smp config from the arguments (``prescaled_batch`` 1 by default: the
tp ranks of a replica read the same batch), ``PreTrainedModel.init_weights`` skipped, ``smp.model_creation`` with
the fused-kernel keywords, ``set_seed(seed + smp.tp_rank())`` unless ``--same_seed``, ``model.get_module().
transformer.seq_layers``, weight-decay groups that leave ``FusedLayerNorm`` out, activation checkpointing of the
layers (``strategy``), ``smp.DistributedOptimizer`` with dynamic loss-scale arguments, an annealing learning rate,
``@smp.step`` train and test steps, partial checkpoints with ``user_content`` and ``num_kept_partial_checkpoints``
(``--load_partial 1`` resumes), and at the end a full model saved (in Hugging Face's keys: SMP translates full
checkpoints) and exported as a Hugging Face model (``translate_state_dict_to_hf_gpt2``); ``--load_full 1`` starts
from that full model.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, set_seed

import smp  # was: import smdistributed.modelparallel.torch as smp
from smp.nn import FusedLayerNorm as LayerNorm
from smp.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2


def batches(args: argparse.Namespace, dp_rank: int, dp_size: int, start: int):
    """Token ids and attention masks, ``args.train_batch_size`` rows per data-parallel rank: this rank's slice of
    one global batch per step (a learnable pattern with noise), from step ``start`` on."""
    for step in range(start, args.max_steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        rows = args.train_batch_size * dp_size
        first = torch.randint(args.vocab_size, (rows, 1), generator=g)
        ids = (first + torch.arange(args.max_context_width) * 7) % args.vocab_size
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.1, torch.randint(args.vocab_size, ids.shape,
                                                                                 generator=g), ids)
        mine = ids[dp_rank * args.train_batch_size:(dp_rank + 1) * args.train_batch_size]
        yield step, mine, torch.ones_like(mine)


def param_groups_by_weight_decay(module: torch.nn.Module) -> tuple[dict, dict]:
    """The published grouping: layer norms and biases without weight decay."""
    decay: dict = {"params": []}
    no_decay: dict = {"params": [], "weight_decay": 0.0}
    seen: set[int] = set()
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                (no_decay if isinstance(sub, LayerNorm) or name == "bias" else decay)["params"].append(p)
    return decay, no_decay


def annealing(args: argparse.Namespace):
    """The published ``AnnealingLR``'s shape: linear warmup over ``warmup`` of the iterations, then linear decay to
    zero at ``lr_decay_iters`` (default ``max_steps``)."""
    total = max(1, args.lr_decay_iters or args.max_steps)
    warmup = max(1, int(args.warmup * total))
    return lambda s: min((s + 1) / warmup, max(0.0, (total - s) / total))


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


@smp.step
def test_step(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, kind, default in [
            ("train_batch_size", int, 4), ("max_steps", int, 6), ("seed", int, 12345), ("same_seed", int, 0),
            ("fp16", int, 0), ("bf16", int, 0), ("grad_clip", float, 1.0), ("weight_decay", float, 0.01),
            ("beta1", float, 0.9), ("beta2", float, 0.95), ("activation_checkpointing", int, 1),
            ("max_context_width", int, 32), ("vocab_size", int, 256), ("hidden_width", int, 64),
            ("num_layers", int, 2), ("num_heads", int, 4), ("resid_pdrop", float, 0.1), ("embd_pdrop", float, 0.1),
            ("attn_pdrop", float, 0.1), ("use_distributed_transformer", int, 1), ("tensor_parallel_degree", int, 1),
            ("pipeline_parallel_degree", int, 1), ("microbatches", int, 1), ("optimize", str, "speed"),
            ("activation_strategy", str, "each"), ("shard_optimizer_state", int, 0), ("prescaled_batch", int, 1),
            ("placement_strategy", str, "cluster"), ("attention_in_fp32", int, 0),
            ("query_key_layer_scaling", int, 1), ("fused_softmax", int, 1), ("fused_bias_gelu", int, 1),
            ("delayed_param", int, 0), ("checkpoint_freq", int, 10000), ("num_kept_checkpoints", int, 5),
            ("load_partial", int, 0), ("load_full", int, 0), ("validation_freq", int, 0),
            ("validation_batches", int, 2), ("save_final_full_model", int, 0), ("lr", float, 5e-3),
            ("lr_decay_iters", int, None), ("warmup", float, 0.01)]:
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--checkpoint-dir", default="/tmp/smp_gpt2_tp/checkpoints")
    p.add_argument("--model-dir", default="/tmp/smp_gpt2_tp/model")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    smp.init({"ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
              "pipeline_parallel_degree": args.pipeline_parallel_degree, "microbatches": args.microbatches,
              "shard_optimizer_state": args.shard_optimizer_state > 0, "prescaled_batch": args.prescaled_batch > 0,
              "fp16": args.fp16 > 0, "bf16": args.bf16 > 0, "delayed_parameter_initialization": args.delayed_param > 0,
              "optimize": args.optimize, "placement_strategy": args.placement_strategy, "auto_partition": True,
              "default_partition": 0})
    if smp.rank() == 0:
        print(f"Transformers version: {transformers.__version__}; smp {smp.__version__}")
    config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
                        n_layer=args.num_layers, n_head=args.num_heads, activation_function="gelu_new",
                        resid_pdrop=args.resid_pdrop, embd_pdrop=args.embd_pdrop, attn_pdrop=args.attn_pdrop,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    if args.use_distributed_transformer > 0:  # the published start-up shortcut: the weights are SMP's to set
        from transformers.modeling_utils import PreTrainedModel
        PreTrainedModel.init_weights = lambda self: None
    set_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
                            dtype=dtype, attention_in_fp32=args.attention_in_fp32 > 0,
                            query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
                            fused_softmax=args.fused_softmax > 0, fused_bias_gelu=args.fused_bias_gelu > 0):
        model = AutoModelForCausalLM.from_config(config)
    if torch.cuda.is_available():  # was: torch.cuda.set_device(smp.local_rank()) on every rank
        torch.cuda.set_device(smp.local_rank())
    if not args.same_seed:
        set_seed(args.seed + smp.tp_rank())  # the published line: other dropout masks on each tp rank
    model = smp.DistributedModel(model, trace_device="gpu")
    m = model.get_module()
    layers = m.transformer.seq_layers if args.use_distributed_transformer > 0 else m.transformer.h
    optimizer = torch.optim.Adam(param_groups_by_weight_decay(m), betas=(args.beta1, args.beta2), lr=args.lr,
                                 weight_decay=args.weight_decay)
    if args.activation_checkpointing:
        smp.set_activation_checkpointing(layers, strategy=args.activation_strategy)
    optimizer = smp.DistributedOptimizer(optimizer, static_loss_scale=None, dynamic_loss_scale=True,
                                         dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, annealing(args))
    total_steps = 0
    if args.load_partial or args.load_full:  # partial: model, optimizer and step; full: the model's weights only
        partial = not args.load_full
        user_content = smp.resume_from_checkpoint(args.checkpoint_dir if partial else args.model_dir,
                                                  tag=None if partial else "fullmodel.pt", partial=partial)
        total_steps = user_content["total_steps"] if partial else 0
        if "lr_scheduler" in user_content:
            lr_scheduler.load_state_dict(user_content["lr_scheduler"])
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()
    model.train()
    for step, input_ids, attention_mask in batches(args, dp_rank, dp_size, total_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, optimizer, input_ids, attention_mask, args).reduce_mean()
        optimizer.step()
        lr_scheduler.step()
        total_steps = step + 1
        if smp.rank() == 0:
            print(f"step {total_steps}/{args.max_steps} loss {loss.item():.6f}", flush=True)
        if args.validation_freq and not total_steps % args.validation_freq:
            model.eval()
            with torch.no_grad():
                val = sum(test_step(model, ids, mask).reduce_mean()
                          for _, ids, mask in batches(args, dp_rank, dp_size, 0) if _ < args.validation_batches)
            torch.distributed.all_reduce(val, group=smp.get_dp_process_group())
            if smp.rank() == 0:
                mean = float(val) / smp.dp_size() / args.validation_batches
                print(f"step {total_steps} validation loss {mean:.6f} perplexity {math.exp(mean):.3f}", flush=True)
            model.train()
        if not total_steps % args.checkpoint_freq:
            smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{total_steps}", partial=True, model=model,
                                optimizer=optimizer, user_content={"total_steps": total_steps, "cli_args": vars(args),
                                                                   "lr_scheduler": lr_scheduler.state_dict()},
                                num_kept_partial_checkpoints=args.num_kept_checkpoints)
    if args.save_final_full_model:
        smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model,
                            user_content={"total_steps": total_steps})
        state = model.state_dict()  # gathered on every rank: the whole model, SMP's names
        if smp.rank() == 0 and args.use_distributed_transformer > 0:
            hf = GPT2LMHeadModel(config)
            hf.load_state_dict(translate_state_dict_to_hf_gpt2(state, args.max_context_width))
            hf.save_pretrained(os.path.join(args.model_dir, "hf"))
            print(f"saved the Hugging Face model in {os.path.join(args.model_dir, 'hf')}", flush=True)
    smp.barrier()
    if smp.rank() == 0:
        print("SMP training finished successfully")


if __name__ == "__main__":
    main()
