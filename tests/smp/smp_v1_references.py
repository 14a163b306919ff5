"""Single-process references for tests/smp/test_smp_v1_revisions.py: the losses a published SMP v1 script's run
prints, computed in one process with torch alone from the reductions' own model, data and optimizer classes, in the
order the script feeds them, so a pipelined run can be checked against them.

:func:`losses` runs one in a process of its own (the reductions import ``smdistributed``, so it installs smp's alias
there only).

- MNIST: the model built after ``torch.manual_seed(1)``, Adadelta and its StepLR, the batches of the stand-in data.
- BERT: the script seeds every rank by its local rank, so its pipeline starts from rank 0's initial weights for the
  stages rank 0 holds (and for the weights two stages share, which the engine sends from the first) and from rank 1's
  for the others: the reference builds both models and takes each parameter from its stage's (``stage1``: the keys of
  stage 1's checkpoint file). Its data order is the script's: the files shuffled by ``random.Random(seed + epoch)``,
  the first one picked by global or data-parallel rank, the next ones by global rank, one ``RandomSampler`` draw from
  the global generator at each file; a resumed run (``resume``: the step it resumes after) starts again from the
  generator's state after building the model, at the file the checkpoint names.
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch

from tests.smp.smp_v1_public import REDUCTIONS

__all__ = ["mnist_losses", "bert_losses", "losses"]


def _import_from(folder: str) -> None:
    import smp

    smp.alias_smdistributed()
    sys.path.insert(0, str(REDUCTIONS / folder))


def mnist_losses(batches: int, epochs: int) -> list[float]:
    """The per-batch losses of ``epochs`` epochs of ``batches`` batches (one replica)."""
    _import_from("mnist")
    import pt_mnist
    import torch.nn.functional as F

    data = torch.utils.data.DataLoader(pt_mnist.StandInMnist(64 * batches, seed=10), batch_size=64, shuffle=False)
    torch.manual_seed(1)
    model = pt_mnist.GroupedNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=4.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    out = []
    for _ in range(epochs):
        for x, y in data:
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            out.append(loss.item())
        scheduler.step()
    return out


def _bert_files(files: list[str], start: int, world: int, first_by_dp: bool, steps: int) -> list[str]:
    """The files rank 0 trains on, one step each, from ``files`` (shuffled) and file index ``start``."""
    first = files[start % len(files)] if first_by_dp else files[start * world % len(files)]
    out = [first]
    for f_id in range(start + 1, len(files)):
        out.append(files[f_id * world % len(files)])
    return out[:len(files) - start - 1][:steps]


def bert_losses(a: dict[str, Any]) -> list[float]:
    """The losses of the BERT reduction's run ``a`` (its arguments, ``stage1``, ``resume``: see the module
    docstring); ``steps`` steps in all."""
    _import_from("bert")
    import modeling
    import numpy as np
    from sagemaker_smp_pretrain import BertPretrainingCriterion, PretrainingDataset
    from schedulers import PolyWarmUpScheduler

    from smp.optimizers import FusedLAMB

    config = modeling.BertConfig.from_json_file(a["config_file"])
    config.vocab_size += -config.vocab_size % 8
    config.use_sequential = True
    modeling.ACT2FN["bias_gelu"] = modeling.bias_gelu_training

    def build() -> tuple[torch.nn.Module, Any]:
        """Rank 0's model as the pipeline holds it, and the global generator's state after building it."""
        torch.manual_seed(a["seed"] + 1)
        other = modeling.BertForPreTraining(config).state_dict()
        torch.manual_seed(a["seed"])
        model = modeling.BertForPreTraining(config)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in a["stage1"]:
                    v.copy_(other[k])
        return model, torch.get_rng_state()

    model, after_build = build()
    named = list(model.named_parameters())
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    optimizer = FusedLAMB([{"params": [p for n, p in named if not any(d in n for d in no_decay)], "weight_decay": 0.01},
                           {"params": [p for n, p in named if any(d in n for d in no_decay)], "weight_decay": 0.0}],
                          lr=a["learning_rate"])
    scheduler = PolyWarmUpScheduler(optimizer, warmup=a["warmup_proportion"], total_steps=a["max_steps"])
    criterion = BertPretrainingCriterion(config.vocab_size)
    import os

    files = sorted(os.path.join(a["input_dir"], f) for f in os.listdir(a["input_dir"]) if "training" in f)
    random.Random(a["seed"]).shuffle(files)
    resume = a.get("resume")
    plan = _bert_files(files, 0, 2, a["first_by_dp"], resume or a["steps"])
    if resume:
        plan += _bert_files(files, resume, 2, a["first_by_dp"], a["steps"] - resume)
    out = []
    np.random.seed(a["seed"])
    for step, path in enumerate(plan):
        if resume and step == resume:
            torch.set_rng_state(after_build)  # the resumed process seeds and builds its model again
        data = PretrainingDataset(path, a["max_predictions_per_seq"])
        loader = torch.utils.data.DataLoader(data, sampler=torch.utils.data.RandomSampler(data),
                                             batch_size=a["train_batch_size"])
        for ids, segments, mask, labels, nsp in loader:
            scores, relationship = model(input_ids=ids, token_type_ids=segments, attention_mask=mask)
            loss = criterion(scores, relationship, labels, nsp)
            loss.backward()
            out.append(loss.item())
            scheduler.step()
            optimizer.step()
            for p in model.parameters():
                p.grad = None
    return out


def _one(rank: int, world: int, family: str, spec: dict[str, Any]) -> list[float]:
    return mnist_losses(**spec) if family == "mnist" else bert_losses(spec)


def losses(family: str, spec: dict[str, Any]) -> list[float]:
    """The reference losses of ``family`` (``"mnist"``: ``batches``, ``epochs``; ``"bert"``: see
    :func:`bert_losses`), computed in a forked process."""
    from smp.testing import run_ranks

    return run_ranks(_one, 1, family, spec, timeout=300)[0]
