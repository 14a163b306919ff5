"""A reduction of SageMaker's public SMP v1 GPT-2 script as published on 2022-01-04 (aws/amazon-sagemaker-examples
7ed6acc, ``training/distributed_training/pytorch/model_parallel/gpt2/train_gpt_simple.py``, blob 16e7cd7) and on
2022-05-25 (ccc102a, blob 5c44c90; ``--revision 2022-05``), with its ``fp16`` package (:mod:`fp16`). Written anew, not
copied: the SMP calls, their order and the ways the script reaches the model are the published ones.

What it keeps: ``smp.init`` with the config the script builds (``checkpoint_attentions``, ``_match_weights``,
``fp16_params``, ``_fp32_grad_accumulation``, ...; from 2022-05 also ``placement_strategy``,
``activation_loading_horizon``, ``skip_tracing``), overridden by the notebook's parameters in ``SM_HP_MP_PARAMETERS``;
the model built under ``torch.set_default_dtype(torch.float16)`` inside ``smp.tensor_parallelism(enabled=tp > 1,
attention_in_fp32=...)`` (from 2022-05 with ``query_key_layer_scaling``, ``fused_softmax``, ``fused_bias_gelu``) and
``smp.delay_param_initialization(enabled=...)``, wrapped in ``FP16_Module``; ``set_seed(seed + smp.tp_rank())``;
``smp.DistributedModel(model, trace_device="gpu")`` created under the half default dtype; the layers reached as
``model.module.module.module.transformer.seq_layers`` (fp16: ``m = model.module``, then ``m.module.module``) for
``smp.set_partition`` (manual partition) and ``smp.set_activation_checkpointing(layers, pack_args_as_tuple=True,
strategy=...)``; the parameter groups of the model found by unwrapping ``DistributedDataParallel`` and ``FP16_Module``
wrappers; ``FP16_Optimizer(model, Adam, ..., use_smp=True)`` inside ``smp.DistributedOptimizer``, and
``model.register_post_step_hook(lambda model, optimizer: optimizer.init_master_params())``; Megatron's
``AnnealingLR``; a step calling ``optimizer.backward(loss, update_master_grads=False)``; then
``update_master_grads()``, ``clip_master_grads()``, ``step()`` and ``optimizer.overflow``;
``optimizer.zero_grad(set_grads_to_None=True)``; checkpoints of ``model.local_state_dict()`` and the fp16 optimizer's
state (``optimizer.local_state_dict()``, its loss scaler, the masters) through ``smp.save(..., partial=True)`` on
``smp.rdp_rank() == 0`` (2022-05: ``v3=not gather_if_shard``), named ``..._steps-<n>.pt_<pp_rank>_<tp_rank>``, the
oldest removed on ``smp.local_rank() == 0``; a resume that finds the newest by those names, ``smp.load(...,
partial=True)``, ``model.load_state_dict(..., same_partition_load=...)`` before the first step, sets the optimizer's
loss scaler, ``overflow`` and the like as attributes of the ``smp.DistributedOptimizer``, and loads its state in a
``model.register_post_step_hook`` that registers a post-partition hook.

What differs, as the task allows: the data (JSON-lines files the test writes), the CUDA lines, the paths SageMaker's
environment supplied, and a tiny model. Not reduced: the script's fp32 path with ``--fp16 0`` (its layers would be
``model.module.module.transformer``, which the notebooks never take), the full-model save and load (``--load_full``,
``--save_final_full_model``), ``--logits_output`` and the checkpoint-sum verification (``--save_or_verify_ckptsum``).
"""
from __future__ import annotations

import argparse
import collections
import os
import re

import gpt2_loop as loop
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
import transformers
from fp16 import FP16_Module, FP16_Optimizer, load_fp16_optimizer, save_fp16_optimizer
from learning_rates import AnnealingLR
from memory_tracker import memory_status
from torch.nn.parallel.distributed import DistributedDataParallel
from transformers import AutoModelForCausalLM, GPT2Config, set_seed


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    if args.fp16:
        optimizer.backward(loss, update_master_grads=False)
    else:
        model.backward(loss)
    return loss


def _name(num_params: int, steps: int) -> str:
    return f"trained_gpt_nparams-{num_params}_steps-{steps}.pt"


def save(path: str, model, optimizer, lr_scheduler, model_config, num_params: int, total_steps: int,
         path_index: int, batch_idx: int, args: argparse.Namespace) -> None:
    """A partial checkpoint, as the published ``save`` writes one."""
    save_dict = {"cli_args": args.__dict__, "num_params": num_params, "total_steps": total_steps,
                 "curr_train_path_index": path_index, "model_config": model_config, "batch_idx": batch_idx,
                 "lr_scheduler": lr_scheduler.state_dict()}
    if args.revision == "2022-01" or args.gather_if_shard > 0 or smp.rdp_rank() == 0:
        save_dict["model"] = model.local_state_dict()
    save_dict["optimizer"] = save_fp16_optimizer(args, model, optimizer, partial=True)
    if args.revision == "2022-01":
        if smp.rdp_rank() == 0:
            smp.save(save_dict, path, partial=True)
    elif not args.gather_if_shard or smp.rdp_rank() == 0:
        smp.save(save_dict, path, partial=True, v3=not args.gather_if_shard)


def load_model_and_optimizer(output_dir: str, model, optimizer, lr_scheduler, args: argparse.Namespace,
                             num_params: int) -> tuple[int, int, int]:
    """The newest partial checkpoint: model and lr scheduler now, the optimizer after the first step."""
    pattern = rf"trained_gpt_nparams-{num_params}_steps-(?P<total_steps>\d+)\.pt_(?P<rank>\d+)"
    found = sorted(((int(re.match(pattern, p).group("total_steps")), os.path.join(output_dir, p))
                    for p in os.listdir(output_dir) if re.match(pattern, p)), reverse=True)
    if not found:
        raise Exception(f'No checkpoints could be found in "{output_dir}".  Candidates: {os.listdir(output_dir)}')
    path = found[0][1].split(".pt")[0] + ".pt"
    if args.revision == "2022-01" or args.gather_if_shard > 0:
        checkpoint = smp.load(path, partial=True)
    else:
        checkpoint = torch.load(f"{path}_{smp.pp_rank()}_{smp.tp_rank()}_0", weights_only=False)
    model.load_state_dict(checkpoint["model"], same_partition_load=args.same_partition_load > 0)
    lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    saved = checkpoint["optimizer"]
    optimizer.loss_scaler = saved["loss_scaler"]
    optimizer.loss_scaler.model = model
    optimizer.dynamic_loss_scale = saved["dynamic_loss_scale"]
    optimizer.overflow = saved["overflow"]
    optimizer.first_closure_call_this_step = saved["first_closure_call_this_step"]
    model.register_post_step_hook(lambda mod, opt: load_fp16_optimizer(args, mod, opt, checkpoint, partial=True))
    print(f'Loaded model from "{path}"')
    return checkpoint["total_steps"], checkpoint["curr_train_path_index"], checkpoint.get("batch_idx", 0)


def delete_oldest_ckpt(args: argparse.Namespace) -> None:
    """Keep ``num_kept_checkpoints`` partial checkpoints, by their files' names."""
    pattern = r"trained_gpt_nparams-(?P<num_params>\d+)_steps-(?P<total_steps>\d+)\.pt"
    pattern += r"_(?P<pp_rank>\d+)_(?P<tp_rank>\d+)"
    by_step = collections.defaultdict(list)
    for p in os.listdir(args.checkpoint_dir):
        if re.match(pattern, p):
            by_step[int(re.match(pattern, p).group("total_steps"))].append(os.path.join(args.checkpoint_dir, p))
    if len(by_step) > args.num_kept_checkpoints:
        for p in by_step[min(by_step)]:
            os.remove(p)


def main() -> None:
    args = loop.parse_args(__doc__.split("\n\n")[0], {
        "match_weights": 0, "fp32_grad_accumulation": 0, "activation_loading_horizon": 4, "skip_tracing": 0,
        "query_key_layer_scaling": 1, "fused_softmax": 1, "fused_bias_gelu": 1, "gather_if_shard": 1,
        "enable_memory_profiling": 0}, strings={"placement_strategy": "cluster", "revision": "2022-01"})
    smp_config = {"ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
                  "pipeline_parallel_degree": args.pipeline_parallel_degree, "microbatches": args.microbatches,
                  "checkpoint_attentions": not args.activation_checkpointing,
                  "shard_optimizer_state": args.shard_optimizer_state > 0, "prescaled_batch": args.prescaled_batch > 0,
                  "_match_weights": args.match_weights > 0, "fp16_params": args.fp16 > 0,
                  "offload_activations": args.offload_activations > 0, "optimize": args.optimize,
                  "auto_partition": not args.manual_partition, "default_partition": 0,
                  "_fp32_grad_accumulation": args.fp32_grad_accumulation > 0, "static_mode": args.static_mode > 0,
                  "fast_mode": args.fast_mode > 0}
    tp_kwargs = {}
    if args.revision == "2022-05":
        smp_config.update(placement_strategy=args.placement_strategy,
                          activation_loading_horizon=args.activation_loading_horizon,
                          skip_tracing=args.skip_tracing > 0)
        tp_kwargs = {"query_key_layer_scaling": args.query_key_layer_scaling > 0,
                     "fused_softmax": args.fused_softmax > 0, "fused_bias_gelu": args.fused_bias_gelu > 0}
    if args.active_microbatches is not None:
        smp_config["active_microbatches"] = args.active_microbatches
    smp.init(smp_config)
    loop.announce(args, (transformers.__version__, smdistributed.modelparallel.__version__))
    if not args.fp16:
        raise SystemExit("this reduction takes the notebooks' path, --fp16 1 (see the module docstring)")

    model_config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
                              n_layer=args.num_layers, n_head=args.num_heads, n_inner=None,
                              activation_function="gelu_new", resid_pdrop=args.resid_pdrop,
                              embd_pdrop=args.embd_pdrop, attn_pdrop=args.attn_pdrop, layer_norm_epsilon=1e-05,
                              initializer_range=0.02, summary_first_dropout=args.summary_first_pdrop,
                              use_cache=args.revision == "2022-01", bos_token_id=args.vocab_size - 1,
                              eos_token_id=args.vocab_size - 1, return_dict=True)
    if smp.tp_size() > 1 and args.match_weights < 1:
        from transformers.modeling_utils import PreTrainedModel
        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)
    torch.set_default_dtype(torch.float16)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1, attention_in_fp32=args.attention_in_fp32 > 0, **tp_kwargs):
        with smp.delay_param_initialization(
                enabled=smp.tp_size() > 1 and args.match_weights < 1 and args.delayed_param > 0):
            model = AutoModelForCausalLM.from_config(model_config)
    torch.set_default_dtype(torch.float32)
    model = FP16_Module(model)
    num_params = loop.count_parameters(model)
    loop.seed_by_tp_rank(args)

    torch.set_default_dtype(torch.float16)
    model = smp.DistributedModel(model, trace_device="gpu")
    m = model.module
    layers = m.module.module.transformer.seq_layers if smp.tp_size() > 1 else m.module.module.transformer.h
    loop.partition_layers(layers, args)
    torch.set_default_dtype(torch.float32)
    iter_model = model
    while isinstance(iter_model, (DistributedDataParallel, FP16_Module)):
        iter_model = iter_model.module
    optimizer = loop.adam(loop.param_groups_by_weight_decay(iter_model), args)
    if args.activation_checkpointing:
        if isinstance(layers, nn.Sequential):
            smp.set_activation_checkpointing(layers, pack_args_as_tuple=True, strategy=args.activation_strategy)
        elif args.revision == "2022-05":
            for c in layers.children():
                smp.set_activation_checkpointing(c)
        else:
            smp.set_activation_checkpointing(layers)
    optimizer = FP16_Optimizer(model, optimizer, static_loss_scale=None, dynamic_loss_scale=True, use_smp=True,
                               dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
                               params_have_main_grad=args.fp32_grad_accumulation > 0,
                               shard_optimizer_state=args.shard_optimizer_state > 0)
    optimizer = smp.DistributedOptimizer(optimizer)
    lr_scheduler = loop.learning_rate_scheduler(AnnealingLR, optimizer, args)
    model.register_post_step_hook(lambda model, optimizer: optimizer.init_master_params())
    if args.revision == "2022-05" and args.enable_memory_profiling > 0:
        model.register_post_partition_hook(lambda model, optimizer: memory_status(msg="After_partition"))

    total_steps, start_path_index, start_batch_index = 0, 0, 0
    if args.load_partial:
        total_steps, start_path_index, start_batch_index = load_model_and_optimizer(
            args.checkpoint_dir, model, optimizer, lr_scheduler, args, num_params)

    def update() -> bool:
        optimizer.update_master_grads()
        optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        return not optimizer.overflow

    def checkpoint(steps: int, path_index: int, batch_index: int) -> None:
        save(os.path.join(args.checkpoint_dir, _name(num_params, steps)), model, optimizer, lr_scheduler,
             model_config, num_params, steps, path_index, batch_index, args)
        if smp.local_rank() == 0:
            delete_oldest_ckpt(args)

    revision = loop.Revision(step=lambda mod, ids, mask: train_step(mod, optimizer, ids, mask, args),
                        zero_grad=lambda: optimizer.zero_grad(set_grads_to_None=True), update=update,
                        save=checkpoint, test_step=loop.test_step)
    loop.train(model, lr_scheduler, start_path_index, start_batch_index, total_steps, args, revision)
    loop.finish(model, args, {})


if __name__ == "__main__":
    main()
