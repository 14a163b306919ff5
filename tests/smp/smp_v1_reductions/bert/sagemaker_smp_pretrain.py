"""A reduction of SageMaker's public SMP v1 BERT pre-training script, ``sagemaker_smp_pretrain.py`` of
aws/amazon-sagemaker-examples (``training/distributed_training/pytorch/model_parallel/bert/bert_example/``), every
text published on its default branch (2020-12-08 to 2022-01-04; tests/smp/smp_v1_public.py names them by commit).
Written anew, not copied: the SMP calls, their order and the ways the script reaches the model are the published ones.

What it keeps: the import lines (``import smdistributed.modelparallel.torch as smp``, ``from
smdistributed.modelparallel.torch.optimizers import FusedLAMB``, and, inside the training loop, ``from
smdistributed.modelparallel.test.torch.utils import dump_model, verify``); seeds of ``seed + local_rank``;
``smp.init()`` with the notebook's parameters from ``SM_HP_MP_PARAMETERS``; ``smp.local_rank()``, ``smp.mp_rank()``,
``smp.rank()``; the whole model in ``smp.DistributedModel``, then (resuming) ``smp.load(ckpt_<step>.pt,
partial=True)`` and ``model.load_state_dict(checkpoint["model"], strict=False)`` before the first step;
``model.to(device)``; parameter groups from ``model.named_parameters()``; ``FusedLAMB`` in
``smp.DistributedOptimizer``, a ``PolyWarmUpScheduler`` over it (it reads FusedLAMB's ``param_groups[0]["step"]``),
``optimizer.load_state_dict(checkpoint["optimizer"])``; an ``@smp.step`` taking eleven arguments (the args namespace,
the device, five tensors, the model, the optimizer, the loss module, the step number) that calls another function
running ``model(input_ids=, token_type_ids=, attention_mask=)`` and ``model.backward(loss)``;
``reduce_mean()``; ``optimizer.step()`` and ``param.grad = None`` over ``model.parameters()``; checkpoints on
``smp.dp_rank() == 0``: ``smp.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict(),
"files": ..., "epoch": ..., "data_loader": <the DataLoader or None>}, ckpt_<step>.pt, partial=True)``, the oldest of
more than three removed as ``ckpt_<step>.pt_<mp_rank>``; ``smp.barrier()`` at the end. The revisions differ in (the
defaults are the last revision's):

- ``--data-shard-dp 0|1``: which rank picks the first data file, ``get_rank()``/``get_world_size()`` (0, to
  3a5c776) or ``smp.dp_rank()``/``smp.dp_size()`` after ``smp.is_initialized()`` (1, from a9a6a90); later files go
  by global rank in every revision;
- ``--drop-last 0|1``: the DataLoaders drop a last partial batch (from c6cf46d);
- ``--s3-sync 0|1``: from ccb28f4 a resume syncs the checkpoints from S3 on ``smp.local_rank() == 0`` then
  ``smp.barrier()`` (an S3 URI is required), and the end syncs them back on ``smp.local_rank() == 0``; the copies
  themselves are left out (the ``aws`` CLI), the rank checks and the barrier kept;
- ``--undefined-name 1``: 1938d0b's last lines print ``[SMP_METRIC]__Bert{nonsequential}...``, a name it never
  defines: it fails there on rank 0 after training, as it did on SageMaker.

What differs, as the task allows: the data (the published script reads HDF5 files of tokenized Wikipedia; here each
``training`` file is an ``.npz`` holding the same six arrays, made by the test), the CUDA lines (``assert
torch.cuda.is_available()``, ``set_device``, ``torch.device("cuda", ...)``, ``.cuda()``) pick the CPU without a
GPU, the DataLoaders load in-process (``num_workers=0``, no pinned memory) and the next file is read by a thread
rather than a process pool, and dllogger's JSON log is left out. The apex paths (``--fp16``, the
``allreduce_post_accumulation`` reduction, which the script turns off when ``gradient_accumulation_steps`` is 1)
are not reduced: the notebooks never enable them.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import modeling
import numpy as np
import smdistributed.modelparallel.torch as smp
import torch
from schedulers import PolyWarmUpScheduler
from smdistributed.modelparallel.torch.optimizers import FusedLAMB
from torch.utils.data import DataLoader, Dataset, RandomSampler
from utils import get_rank, get_world_size, is_main_process

skipped_steps = 0


class WorkerInitObj:
    """Seeds numpy and random in a loader worker (picklable, as the published one)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, worker_id: int) -> None:
        np.random.seed(seed=self.seed + worker_id)
        random.seed(self.seed + worker_id)


class PretrainingDataset(Dataset):
    """One data file's samples: masked-LM labels rebuilt from the masked positions, as the published dataset does
    (a data line: ``np.load`` of an ``.npz`` where the script opens HDF5)."""

    KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")

    def __init__(self, input_file: str, max_pred_length: int) -> None:
        self.input_file, self.max_pred_length = input_file, max_pred_length
        with np.load(input_file) as f:
            self.inputs = [np.asarray(f[k]) for k in self.KEYS]

    def __len__(self) -> int:
        return len(self.inputs[0])

    def __getitem__(self, index: int) -> list[torch.Tensor]:
        ids, mask, segments, positions, masked_ids, nsp = (torch.from_numpy(np.asarray(x[index].astype(np.int64)))
                                                           for x in self.inputs)
        labels = torch.ones(ids.shape, dtype=torch.long) * -1
        end = self.max_pred_length
        padded = (positions == 0).nonzero(as_tuple=False)
        if len(padded) != 0:
            end = padded[0].item()
        labels[positions[:end]] = masked_ids[:end]
        return [ids, segments, mask, labels, nsp]


def loader(data_file: str, args: argparse.Namespace, worker_init: WorkerInitObj) -> DataLoader:
    data = PretrainingDataset(data_file, args.max_predictions_per_seq)
    return DataLoader(data, sampler=RandomSampler(data), batch_size=args.train_batch_size * args.n_gpu,
                      num_workers=0, worker_init_fn=worker_init, drop_last=args.drop_last > 0)


def create_pretraining_dataset(input_file: str, args: argparse.Namespace,
                               worker_init: WorkerInitObj) -> tuple[DataLoader, str]:
    return loader(input_file, args, worker_init), input_file


class BertPretrainingCriterion(torch.nn.Module):
    """Masked-LM plus next-sentence cross entropy (labels of -1 ignored)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-1)
        self.vocab_size = vocab_size

    def forward(self, prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels):
        mlm = self.loss_fn(prediction_scores.view(-1, self.vocab_size), masked_lm_labels.view(-1))
        return mlm + self.loss_fn(seq_relationship_score.view(-1, 2), next_sentence_labels.view(-1))


def parse_arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("input_dir", "config_file", "output_dir"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--init_checkpoint", default=None)
    p.add_argument("--bert_model", default="bert-large-uncased")  # not read: the model is the config file's
    for name, default in [("max_seq_length", 512), ("max_predictions_per_seq", 80), ("train_batch_size", 32),
                          ("local_rank", os.getenv("LOCAL_RANK", -1)), ("seed", 4211),
                          ("gradient_accumulation_steps", 1), ("fp16", 0), ("amp", 0), ("checkpoint_activations", 0),
                          ("resume_from_checkpoint", 0), ("resume_step", -1), ("num_steps_per_checkpoint", 100),
                          ("skip_checkpoint", 0), ("phase2", 0), ("allreduce_post_accumulation", 0),
                          ("allreduce_post_accumulation_fp16", 0), ("phase1_end_step", 7038), ("do_train", 0),
                          ("steps_this_run", 1000), ("smp", 0), ("apply_optimizer", 1), ("use_sequential", 0),
                          ("save-full", 0), ("data-shard-dp", 1), ("drop-last", 1), ("s3-sync", 1),
                          ("undefined-name", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("learning_rate", 5e-5), ("max_steps", 1000.0), ("warmup_proportion", 0.01),
                          ("loss_scale", 0.0), ("log_freq", 1.0)]:
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--partial-checkpoint", type=bool, default=True)
    p.add_argument("--s3_checkpoint_uri", default=None)
    args = p.parse_args()
    args.fp16 = args.fp16 or args.amp
    if args.resume_from_checkpoint:
        args.steps_this_run += 100
    if args.steps_this_run < 0:
        args.steps_this_run = args.max_steps
    return args


def setup_training(args: argparse.Namespace) -> tuple[torch.device, argparse.Namespace]:
    if args.smp > 0:
        smp.init()
    if torch.cuda.is_available():  # CUDA lines: the script asserts CUDA and sets the device
        torch.cuda.set_device(smp.local_rank())
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    args.n_gpu = 1
    if args.gradient_accumulation_steps == 1:
        args.allreduce_post_accumulation = False
        args.allreduce_post_accumulation_fp16 = False
    if args.fp16 or args.allreduce_post_accumulation:
        raise SystemExit("this reduction leaves out the script's apex paths (fp16, allreduce_post_accumulation)")
    print(f"device: {device} n_gpu: {args.n_gpu}, mp_rank: {smp.mp_rank()}, rank: {smp.rank()}, distributed "
          f"training: {args.local_rank != -1}, 16-bits training: {args.fp16}")
    args.train_batch_size = args.train_batch_size // args.gradient_accumulation_steps
    existing = os.path.exists(args.output_dir) and any(f.startswith("ckpt") for f in os.listdir(args.output_dir))
    if not args.resume_from_checkpoint and existing:
        raise ValueError(f"Output directory ({args.output_dir}) already exists and is not empty.")
    if (not args.resume_from_checkpoint or not os.path.exists(args.output_dir)) and is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
    return device, args


def prepare_model_and_optimizer(args: argparse.Namespace, device: torch.device):
    config = modeling.BertConfig.from_json_file(args.config_file)
    if config.vocab_size % 8 != 0:
        config.vocab_size += 8 - (config.vocab_size % 8)
    config.use_sequential = args.use_sequential > 0
    modeling.ACT2FN["bias_gelu"] = modeling.bias_gelu_training
    model = modeling.BertForPreTraining(config)
    model.checkpoint_activations(args.checkpoint_activations)
    if args.smp > 0:
        model = smp.DistributedModel(model)

    checkpoint = None
    global_step = 0
    if args.resume_from_checkpoint:
        if args.resume_step == -1 and not args.init_checkpoint:
            names = [f for f in os.listdir(args.output_dir) if ".pt" in f]
            args.resume_step = max(int(x.split(".pt")[0].split("_")[1].strip()) for x in names)
        global_step = args.resume_step if not args.init_checkpoint else 0
        if args.s3_sync and not args.init_checkpoint:
            if not args.s3_checkpoint_uri:
                raise ValueError("Need to set s3_checkpoint_uri, if init_checkpoint not set")
            if smp.local_rank() == 0:
                pass  # the published script runs `aws s3 sync <uri> <output_dir>` here
            smp.barrier()
        if not args.init_checkpoint:
            checkpoint = smp.load(os.path.join(args.output_dir, f"ckpt_{global_step}.pt"),
                                  partial=args.partial_checkpoint)
        else:
            checkpoint = smp.load(args.init_checkpoint)
        model.load_state_dict(checkpoint["model"], strict=False)
        if is_main_process():
            print("resume step from ", args.resume_step)

    model.to(device)
    named = list(model.named_parameters())
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = FusedLAMB(groups, lr=args.learning_rate)
    if args.smp > 0:
        optimizer = smp.DistributedOptimizer(optimizer)
    lr_scheduler = PolyWarmUpScheduler(optimizer, warmup=args.warmup_proportion, total_steps=args.max_steps)
    if args.resume_from_checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
    return model, optimizer, lr_scheduler, checkpoint, global_step, BertPretrainingCriterion(config.vocab_size)


def take_optimizer_step(args: argparse.Namespace, optimizer, model, global_step: int) -> int:
    if args.apply_optimizer > 0:
        optimizer.step()
    for param in model.parameters():
        param.grad = None
    return global_step + 1


@smp.step
def smp_step(args, device, input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels, model,
             optimizer, criterion, step):
    return train_step(args, device, input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels,
                      model, optimizer, criterion, step)


def train_step(args, device, input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels, model,
               optimizer, criterion, step):
    prediction_scores, seq_relationship_score = model(input_ids=input_ids, token_type_ids=segment_ids,
                                                      attention_mask=input_mask)
    loss = criterion(prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels)
    if args.smp > 0:
        model.backward(loss)
    else:
        loss.backward()
    return loss


def save_checkpoint(args, model, optimizer, global_step: int, f_id: int, files: list[str], epoch: int, dataloader,
                    recent: list[str], partial: bool = True) -> None:
    """What the script saves at a checkpoint step (called on ``smp.dp_rank() == 0``)."""
    path = os.path.join(args.output_dir, f"ckpt_{global_step}.pt")
    save_dict = {"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict(),
                 "files": [f_id] + files, "epoch": epoch,
                 "data_loader": None if global_step >= args.steps_this_run else dataloader}
    smp.save(save_dict, path, partial=partial)
    if not partial:
        return
    recent.append(path)
    if len(recent) > 3 and (args.smp == 0 or smp.dp_rank() == 0):
        os.remove(recent.pop(0) + f"_{smp.mp_rank()}")


def first_file(args: argparse.Namespace, files: list[str], f_start_id: int) -> str:
    """The first data file of an epoch: by data-parallel rank (from a9a6a90) or by global rank (before)."""
    if args.data_shard_dp:
        if smp.is_initialized():
            size, rank = smp.dp_size(), smp.dp_rank()
        elif torch.distributed.is_initialized():
            size, rank = get_world_size(), get_rank()
        else:
            size, rank = 1, 0
    else:
        size, rank = get_world_size(), get_rank()
    if size > 1 and size > len(files):
        return files[(f_start_id * size + rank + size % len(files) * f_start_id) % len(files)]
    return files[(f_start_id * size + rank) % len(files)]


def main():
    args = parse_arguments()
    random.seed(args.seed + args.local_rank)
    np.random.seed(args.seed + args.local_rank)
    torch.manual_seed(args.seed + args.local_rank)
    torch.cuda.manual_seed(args.seed + args.local_rank)
    worker_init = WorkerInitObj(args.seed + args.local_rank)
    device, args = setup_training(args)
    model, optimizer, lr_scheduler, checkpoint, global_step, criterion = prepare_model_and_optimizer(args, device)

    recent: list[str] = []
    average_loss, epoch, training_steps = 0.0, 0, 0
    raw_train_start = None
    pool = ThreadPoolExecutor(1)  # a data line: the script reads the next file in a process pool
    while True:
        if not args.resume_from_checkpoint or epoch > 0 or (args.phase2 and global_step < 1) or args.init_checkpoint:
            files = sorted(os.path.join(args.input_dir, f) for f in os.listdir(args.input_dir)
                           if os.path.isfile(os.path.join(args.input_dir, f)) and "training" in f)
            random.Random(args.seed + epoch).shuffle(files)
            f_start_id = 0
        else:
            f_start_id = checkpoint["files"][0]
            files = checkpoint["files"][1:]
            args.resume_from_checkpoint = False
            epoch = checkpoint.get("epoch", 0)
        num_files = len(files)
        train_dataloader = loader(first_file(args, files, f_start_id), args, worker_init)

        for f_id in range(f_start_id + 1, len(files)):
            world, rank = get_world_size(), get_rank()
            shift = world % num_files * f_id if world > num_files else 0
            dataset_future = pool.submit(create_pretraining_dataset, files[(f_id * world + rank + shift) % num_files],
                                         args, worker_init)
            if raw_train_start is None:
                raw_train_start = time.time()
            for step, batch in enumerate(train_dataloader):
                training_steps += 1
                input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels = (t.to(device)
                                                                                              for t in batch)
                from smdistributed.modelparallel.test.torch.utils import dump_model, verify  # noqa: F401

                model.train()
                loss_mbs = smp_step(args, device, input_ids, segment_ids, input_mask, masked_lm_labels,
                                    next_sentence_labels, model, optimizer, criterion, step)
                loss = loss_mbs.reduce_mean()
                if smp.rank() == 0:
                    print(f"Loss: {loss.item()!r}", flush=True)
                average_loss += loss.item()
                if training_steps % args.gradient_accumulation_steps == 0:
                    lr_scheduler.step()
                    global_step = take_optimizer_step(args, optimizer, model, global_step)
                final_loss = loss.item()
                if (global_step >= args.steps_this_run
                        or training_steps % (args.num_steps_per_checkpoint * args.gradient_accumulation_steps) == 0):
                    if smp.dp_rank() == 0 and not args.skip_checkpoint:
                        save_checkpoint(args, model, optimizer, global_step, f_id, files, epoch, train_dataloader,
                                        recent)
                    if global_step >= args.steps_this_run:
                        if smp.dp_rank() == 0 and args.save_full:
                            save_checkpoint(args, model, optimizer, global_step, f_id, files, epoch, None, recent,
                                            partial=False)
                        smp.barrier()
                        if args.s3_sync and smp.local_rank() == 0:
                            pass  # the published script runs `aws s3 sync <output_dir> <job's s3 path>` here
                        return args, final_loss, time.time() - raw_train_start, global_step
            train_dataloader, _ = dataset_future.result(timeout=None)
        epoch += 1


if __name__ == "__main__":
    args = parse_arguments()
    args, final_loss, train_time_raw, global_step = main()
    if is_main_process():
        if args.undefined_name:  # 1938d0b's line, with its undefined name
            print(f"[SMP_METRIC]__Bert{nonsequential}__Loss__{final_loss:.3f}")  # noqa: F821
        print(f"[SMP_METRIC]__Bert__Loss__{final_loss:.3f}")
