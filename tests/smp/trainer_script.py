"""A Hugging Face ``Trainer`` script, as a user writes one: a small GPT-2 trained on a synthetic dataset, evaluated,
checkpointed, and resumed. Nothing in it names smp: under ``smp launch --as-smdistributed`` with SageMaker's
``SM_HP_MP_PARAMETERS`` / ``SM_FRAMEWORK_PARAMS`` set, transformers takes its own SMP v1 code path, which then
runs on smp; without them it is a plain single-process run. ``tests/smp/test_hf_trainer.py`` runs it both ways
and compares the losses.

    python trainer_script.py --out DIR [--steps 4] [--batch 8] [--resume DIR/checkpoint-2]

The choices that make the two runs comparable: dropout is off (the single process and the pipeline would draw
different masks); no gradient clipping (``max_grad_norm=0``: without fp16, transformers' SMP path clips with
``torch.nn.utils.clip_grad_norm_`` over each rank's own parameters, so each pipeline stage by its own norm, as it
did on SMP v1); ``use_cache=False`` (training needs no key/value cache); and ``save_safetensors=False`` (the SMP
resume of transformers 4.56 reads only ``pytorch_model.bin``). At the end each rank writes ``DIR/losses_<RANK>.json``:
the loss of every training step (its replica's, unrounded: :class:`LossRecorder`) and the evaluation loss.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 96, 16


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` token sequences with a pattern worth learning (each token is the previous one plus a step)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(SEQ)) % VOCAB
    labels = ids.clone()
    labels[:, 0] = -100  # no token predicts the first one: the tokens transformers counts are those the loss averages
    return [{"input_ids": row, "labels": lab} for row, lab in zip(ids, labels)]


class LossRecorder(Trainer):
    """A ``Trainer`` that keeps the loss of each step as it was computed (its logs round to 4 digits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: dict[int, float] = {}

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses[self.state.global_step + 1] = loss.item()
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per-device train batch")
    p.add_argument("--eval-batch", type=int, default=8, help="per-device eval batch")
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None)
    a = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch,
                             per_device_eval_batch_size=a.eval_batch, learning_rate=1e-3, logging_steps=1,
                             save_steps=a.save_steps, save_safetensors=False, report_to=[], seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.0)
    trainer = LossRecorder(model=model, args=args, train_dataset=dataset(64, 1), eval_dataset=dataset(16, 2))
    trainer.train(resume_from_checkpoint=a.resume)
    metrics = trainer.evaluate()
    with open(os.path.join(a.out, f"losses_{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump({"train": trainer.step_losses, "eval": metrics["eval_loss"]}, fh)


if __name__ == "__main__":
    main()
