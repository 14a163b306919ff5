"""A reduction of SageMaker's public SMP v1 GPT-2 script as published on 2022-10-13 (aws/amazon-sagemaker-examples
b7272f0, ``training/distributed_training/pytorch/model_parallel/gpt2/train_gpt_simple.py``, blob ac2abb3; the text
stayed until the script gave way to ``train.py`` on 2023-06-23). Written anew, not copied: the SMP calls, their order
and the ways the script reaches the model are the published ones.

What it keeps: ``import smdistributed.modelparallel.torch as smp`` and ``smdistributed.modelparallel.__version__``;
``smp.init`` with the config the script builds (which SageMaker overrides with the notebook's parameters from
``SM_HP_MP_PARAMETERS``); ``PreTrainedModel.init_weights`` replaced by a no-op for the distributed transformer;
``smp.model_creation(tensor_parallelism=..., dtype=..., attention_in_fp32=, query_key_layer_scaling=,
fused_softmax=, fused_dropout=, fused_bias_gelu=)`` around ``AutoModelForCausalLM.from_config``; seeds of ``seed +
smp.tp_rank()``; ``smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=...)``;
``model.get_module().transformer.seq_layers`` (or ``.h``) for ``smp.set_partition`` of each layer (manual partition)
and ``smp.set_activation_checkpointing(layers, strategy=...)``; parameter groups split by ``isinstance(module,
smp.nn.FusedLayerNorm)``; ``smp.DistributedOptimizer(Adam, static_loss_scale=None, dynamic_loss_scale=True,
dynamic_loss_args=...)`` and Megatron's ``AnnealingLR`` over it; ``smp.resume_from_checkpoint`` (partial, or the full
``fullmodel.pt``) with the lr scheduler in ``user_content``; data read on ``smp.pp_rank() == 0`` and split by
``smp.dp_rank()``/``smp.dp_size()`` (``rdp`` under ``prescaled_batch``); gradient accumulation over
``--gradient_accumulation`` steps; ``optimizer.clip_master_grads`` and ``optimizer.overflow`` under fp16;
validation through ``torch.distributed.all_reduce(..., group=smp.get_dp_process_group())``; and
``smp.save_checkpoint(..., partial=True, model=, optimizer=, user_content=, num_kept_partial_checkpoints=)`` (the
user content holds the model's ``GPT2Config`` and the lr scheduler's state).

What differs, as the task allows: the data (JSON-lines files of token ids the test writes, as the script reads them),
the CUDA lines (``set_device``), SageMaker's environment defaults of the paths (arguments here), and a tiny model.
Not reduced: ``--logits_output``, ``--enable_memory_profiling`` (its helpers are imported), the sharded-data-parallel
helpers' calls (``sharded_data_parallel_degree`` > 1 reads SMP's DeepSpeed optimizer; the notebook leaves it at 1).
"""
from __future__ import annotations

import gpt2_loop as loop
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
import transformers
from learning_rates import AnnealingLR
from memory_tracker import memory_status, memory_status_cpu  # noqa: F401  (imported as published)
from sharded_data_parallel_checkpoint import get_buffer_names, get_param_shapes
from transformers import AutoModelForCausalLM, GPT2Config, set_seed


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main() -> None:
    args = loop.parse_args(__doc__.split("\n\n")[0], {**loop.LATE_INTS, "query_key_layer_scaling": 1},
                      strings={"placement_strategy": "cluster"})
    smp.init(loop.late_smp_config(args))
    loop.announce(args, (transformers.__version__, smdistributed.modelparallel.__version__))

    model_config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
                              n_layer=args.num_layers, n_head=args.num_heads, n_inner=None,
                              activation_function="gelu_new", resid_pdrop=args.resid_pdrop,
                              embd_pdrop=args.embd_pdrop, attn_pdrop=args.attn_pdrop, layer_norm_epsilon=1e-05,
                              initializer_range=0.02, summary_first_dropout=args.summary_first_pdrop,
                              use_cache=False, bos_token_id=args.vocab_size - 1, eos_token_id=args.vocab_size - 1,
                              return_dict=True)
    if args.use_distributed_transformer > 0:
        from transformers.modeling_utils import PreTrainedModel
        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0, dtype=dtype,
                            attention_in_fp32=args.attention_in_fp32 > 0,
                            query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
                            fused_softmax=args.fused_softmax > 0, fused_dropout=args.fused_dropout > 0,
                            fused_bias_gelu=args.fused_bias_gelu > 0):
        model = AutoModelForCausalLM.from_config(model_config)
    num_params = loop.count_parameters(model)
    loop.seed_by_tp_rank(args)

    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation)
    m = model.get_module()
    layers = m.transformer.seq_layers if args.use_distributed_transformer > 0 else m.transformer.h
    loop.partition_layers(layers, args)
    optimizer = loop.adam(loop.param_groups_by_weight_decay(m), args)
    loop.checkpoint_layers(layers, args)
    optimizer = loop.smp_fp16_optimizer(optimizer)
    lr_scheduler = loop.learning_rate_scheduler(AnnealingLR, optimizer, args)
    total_steps, start_path_index, start_batch_index = loop.resume(args, lr_scheduler)

    def update() -> bool:
        if args.fp16:
            optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        return not (args.fp16 and optimizer.overflow)

    def save(steps: int, path_index: int, batch_index: int) -> None:
        user_content = {"cli_args": args.__dict__, "num_params": num_params, "total_steps": steps,
                        "start_train_path_index": path_index, "model_config": model_config,
                        "start_batch_index": batch_index}
        if args.sharded_data_parallel_degree > 1:
            user_content["buffer_names"] = get_buffer_names(model)
            user_content["param_shapes"] = get_param_shapes(model, optimizer)
        user_content["lr_scheduler"] = lr_scheduler.state_dict()
        smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{steps}", partial=True, model=model,
                            optimizer=optimizer, user_content=user_content,
                            num_kept_partial_checkpoints=args.num_kept_checkpoints)

    revision = loop.Revision(step=lambda mod, ids, mask: train_step(mod, optimizer, ids, mask, args),
                        zero_grad=lambda: optimizer.zero_grad(set_to_none=True), update=update, save=save,
                        test_step=loop.test_step)
    total_steps, _ = loop.train(model, lr_scheduler, start_path_index, start_batch_index, total_steps, args, revision)
    loop.finish(model, args, {"cli_args": args.__dict__, "num_params": num_params, "total_steps": total_steps,
                         "model_config": model_config})


if __name__ == "__main__":
    main()
