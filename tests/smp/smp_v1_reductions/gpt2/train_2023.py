"""A reduction of SageMaker's public SMP v1 GPT-2 script of 2023, ``train.py`` of aws/amazon-sagemaker-examples
(``training/distributed_training/pytorch/model_parallel/gpt2/train.py``, first published by 198c0bd on 2023-06-23,
blob e1d168f, unchanged until the example was removed on 2024-06-19), the script of its notebooks for sharded data
parallelism (``smp-train-gpt-sharded-data-parallel.ipynb``, ``smp-fine-tune-gpt-sharded-data-parallel.ipynb``).
Written anew, not copied: the SMP calls, their order and the ways the script reaches the model are the published ones.

What it keeps, besides what the 2022-10 script did (see ``train_gpt_simple_2022_10.py``): the config keys
``sharded_data_parallel_degree``, ``ddp_dist_backend``, ``sdp_hierarchical_allgather`` and ``sdp_gradient_clipping``;
the model config from ``model_config.get_model_config_from_args``; ``smp.model_creation`` with the 2023 keywords
(``zero_init``, ``distribute_embedding``, ``use_alibi``, ``fp32_residual_addition``, ``flash_attention``); the number
of parameters counted on ``model.get_module()``; a step that takes no optimizer; no clipping by the script under
sharded data parallelism (``sdp_gradient_clipping`` does it), and the log line's ``optimizer._global_grad_norm``;
``--log_reduced_training_loss`` (the loss all-reduced over ``smp.get_dp_process_group()``); and the fine-tuning path
of the second notebook (``--fine_tune 1 --delayed_param 1``): rank 0 saves a pretrained Hugging Face model's
``state_dict()`` as ``fullmodel.pt`` with ``torch.save``, ``smp.barrier()``, and every rank loads it with
``smp.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)``.

What differs, as the task allows: the data (JSON-lines files the test writes), the CUDA lines (``set_device``,
``synchronize``), the paths SageMaker's environment supplied, a tiny model, and the pretrained model of the fine-tuning
path, which the test saves with ``save_pretrained`` (``--model_name`` is its folder; nothing is downloaded). Not
reduced: BLOOM, GPT-NeoX and T5 (``--model_type``), BERT data, ``--logits_output``, ``--enable_memory_profiling``,
and the paths that read DeepSpeed's structures inside SMP's sharded optimizer (``--log_param_norms``, and sharded
data parallelism without SMP's distributed transformer, ``sdp_utils``), which the notebooks do not take.
"""
from __future__ import annotations

import os

import gpt2_loop as loop
import model_config as model_config_lib
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
import transformers
from learning_rates import AnnealingLR
from memory_tracker import memory_status, memory_status_cpu  # noqa: F401  (imported as published)
from sdp_utils import build_param_id_to_buffer, build_param_id_to_offset, log_param_norms  # noqa: F401
from transformers import AutoModelForCausalLM, set_seed


@smp.step
def train_step(model, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main() -> None:
    args = loop.parse_args(__doc__.split("\n\n")[0], {
        **loop.LATE_INTS, "query_key_layer_scaling": 0, "fine_tune": 0, "residual_addition_in_fp32": 0,
        "flash_attention": 1, "log_param_norms": 0, "log_reduced_training_loss": 0},
        floats={"alibi": 0.0, "initializer_range": 0.02},
        strings={"placement_strategy": "cluster", "ddp_dist_backend": "auto", "model_type": "gpt2", "model_name": ""})
    smp_config = {**loop.late_smp_config(args), "ddp_dist_backend": args.ddp_dist_backend,
                  "sdp_hierarchical_allgather": False, "sdp_gradient_clipping": args.grad_clip}
    smp.init(smp_config)
    loop.announce(args, (transformers.__version__, smdistributed.modelparallel.__version__), make_dirs=False)

    model_config, args = model_config_lib.get_model_config_from_args(args.model_type, args.model_name, args,
                                                                     log=smp.rank() == 0)
    if args.use_distributed_transformer > 0:
        from transformers.modeling_utils import PreTrainedModel
        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    if args.fine_tune > 0 and args.delayed_param > 0 and smp.rank() == 0:
        pretrained = AutoModelForCausalLM.from_pretrained(args.model_name or args.model_dir)
        torch.save(pretrained.state_dict(), os.path.join(args.model_dir, "fullmodel.pt"))
    smp.barrier()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
                            zero_init=args.use_distributed_transformer == 0, dtype=dtype,
                            distribute_embedding=args.sharded_data_parallel_degree > 1 and smp.tp_size() > 1,
                            use_alibi=args.alibi > 0, attention_in_fp32=args.attention_in_fp32 > 0,
                            fp32_residual_addition=args.residual_addition_in_fp32 > 0,
                            query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
                            fused_softmax=args.fused_softmax > 0, fused_dropout=args.fused_dropout > 0,
                            fused_bias_gelu=args.fused_bias_gelu > 0, flash_attention=args.flash_attention > 0):
        if args.fine_tune > 0 and args.delayed_param == 0:
            model = AutoModelForCausalLM.from_pretrained(args.model_name or args.model_dir)
        else:
            model = AutoModelForCausalLM.from_config(model_config)
    loop.seed_by_tp_rank(args)

    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation)
    m = model.get_module()
    num_params = loop.count_parameters(m)
    layers = m.transformer.seq_layers if args.use_distributed_transformer > 0 else m.transformer.h
    loop.partition_layers(layers, args)
    param_groups = loop.param_groups_by_weight_decay(m)
    optimizer = loop.adam(param_groups, args)
    loop.checkpoint_layers(layers, args)
    sdp_on_hf = args.sharded_data_parallel_degree > 1 and args.use_distributed_transformer == 0
    param_id_to_offset = build_param_id_to_offset(param_groups) if sdp_on_hf else None
    optimizer = loop.smp_fp16_optimizer(optimizer)
    if args.fine_tune > 0 and args.delayed_param > 0:
        smp.resume_from_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False)
    if sdp_on_hf:
        build_param_id_to_buffer(optimizer, param_id_to_offset)
    lr_scheduler = loop.learning_rate_scheduler(AnnealingLR, optimizer, args)
    total_steps, start_path_index, start_batch_index = loop.resume(args, lr_scheduler)
    torch.cuda.empty_cache()

    def update() -> bool:
        if args.sharded_data_parallel_degree < 1:  # as published: never (sdp_gradient_clipping clips)
            optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        return not (args.fp16 and optimizer.overflow)

    def logged(loss: torch.Tensor) -> float:
        if not args.log_reduced_training_loss:
            return loss.item()
        detached = loss.detach()
        torch.distributed.all_reduce(detached, group=smp.get_dp_process_group())
        return detached.item() / smp.dp_size()

    def save(steps: int, path_index: int, batch_index: int) -> None:
        smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{steps}", partial=True, model=model,
                            optimizer=optimizer, user_content={
                                "cli_args": args.__dict__, "num_params": num_params, "total_steps": steps,
                                "start_train_path_index": path_index, "model_config": model_config,
                                "start_batch_index": batch_index, "lr_scheduler": lr_scheduler.state_dict()},
                            num_kept_partial_checkpoints=args.num_kept_checkpoints)

    def log_extra() -> str:
        return f", Grad norm: {optimizer._global_grad_norm}" if args.sharded_data_parallel_degree > 1 else ""

    revision = loop.Revision(step=lambda mod, ids, mask: train_step(mod, ids, mask, args),
                        zero_grad=lambda: optimizer.zero_grad(set_to_none=True), update=update, save=save,
                        test_step=loop.test_step, logged=logged, log_extra=log_extra)
    total_steps, _ = loop.train(model, lr_scheduler, start_path_index, start_batch_index, total_steps, args, revision)
    loop.finish(model, args, {"cli_args": args.__dict__, "num_params": num_params, "total_steps": total_steps,
                         "model_config": model_config})


if __name__ == "__main__":
    main()
