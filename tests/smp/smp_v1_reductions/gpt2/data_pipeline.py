"""A reduction of ``data_pipeline.py`` beside SageMaker's public SMP v1 GPT-2 scripts (2021-11 to 2024-06): the
openwebtext-style loader, whose SMP calls are the published ones. Only ``smp.pp_rank() == 0`` reads the JSON-lines
files (one ``{"input_ids": [...], "attention_mask": [...]}`` per line, as published; the test writes them), with a
``DistributedSampler`` over the data-parallel rank it is given, and sends the number of batches with
``smp.broadcast(n, smp.PP_GROUP)``; the other pipeline ranks get it with ``smp.recv_from(0, smp.RankType.PP_RANK)`` and
iterate over empty placeholder tensors."""
from __future__ import annotations

import json

import numpy as np
import smdistributed.modelparallel.torch as smp
import torch

__all__ = ["create_pretraining_dataloader"]


class OpenwebtextPretrainingDataset(torch.utils.data.Dataset):
    """Token ids and attention masks, one JSON object a line, cut to ``max_sequence_length`` at a random start."""

    def __init__(self, input_paths: list[str], max_sequence_length: int) -> None:
        self.input_paths, self.max_sequence_length = input_paths, max_sequence_length
        self.input_data: list[str] = []
        for path in input_paths:
            with open(path) as f:
                self.input_data.extend(f)

    def __len__(self) -> int:
        return len(self.input_data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        obj = json.loads(self.input_data[index])
        ids = torch.tensor(obj["input_ids"], dtype=torch.long)
        mask = torch.tensor(obj["attention_mask"], dtype=torch.long)
        if len(ids) > self.max_sequence_length:
            start = np.random.randint(0, len(ids) - self.max_sequence_length)
            ids, mask = ids[start:start + self.max_sequence_length], mask[start:start + self.max_sequence_length]
        return ids, mask


class DummyDataset(torch.utils.data.Dataset):
    """What the other pipeline ranks iterate over: empty tensors, as many as pp_rank 0 has samples."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.Tensor(0), torch.Tensor(0)

    def __len__(self) -> int:
        return self.length


def create_pretraining_dataloader(input_paths: list[str], batch_size: int, max_sequence_length: int, seed: int,
                                  dp_rank: int, dp_size: int, shuffle: bool = False, zipped: bool = False,
                                  use_last_file_only: bool = False, data_type: str = "openwebtext"):
    """The batches of ``input_paths`` for this data-parallel rank (on pp_rank 0; placeholders elsewhere)."""
    if smp.pp_rank() == 0:
        data = OpenwebtextPretrainingDataset(input_paths[-1:] if use_last_file_only else input_paths,
                                             max_sequence_length)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=shuffle, seed=seed, rank=dp_rank,
                                                      num_replicas=dp_size, drop_last=True)
        loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=batch_size, num_workers=0,
                                             drop_last=True)
        smp.broadcast(len(loader), smp.PP_GROUP)
        return loader
    length = smp.recv_from(0, smp.RankType.PP_RANK)
    return torch.utils.data.DataLoader(DummyDataset(length * batch_size), batch_size=batch_size, drop_last=True)
