"""SageMaker's public SMP v1 scripts, every revision published on the default branch of aws/amazon-sagemaker-examples,
and how tests/smp/test_smp_v1_revisions.py runs each one: its reduction (tests/smp/smp_v1_reductions; the scripts'
own texts are never stored here), its arguments, its notebook's SMP parameters and the data it reads.

:data:`REVISIONS` names each text by the first default-branch commit that has it, with the file's git blob id and
date: the MNIST script ``mnist/utils/pt_mnist.py`` (3 texts, 2020-12 to 2021-05), the BERT script
``bert/bert_example/sagemaker_smp_pretrain.py`` (8 texts, 2020-12 to 2022-01) and the GPT-2 script
``gpt2/train_gpt_simple.py`` (3 texts, 2022-01 to 2022-10) then ``gpt2/train.py`` (2023-06; the same text moved to
``archived/smp-gpt-sharded-data-parallel/`` in 2024-06), all under ``training/distributed_training/pytorch/
model_parallel/``. Texts that only lived on pull-request branches (17 more of the GPT-2 script in 2021-11 to
2022-10, 4 more of BERT's in 2020-12 to 2021-03) were never published and are not run.

A run is :func:`launch`: ``smp launch -n N --as-smdistributed`` (the scripts' import lines are SMP's, unchanged), with
the notebook's SMP parameters in ``SM_HP_MP_PARAMETERS`` (as SageMaker passed them) and the notebook's
hyperparameters as arguments, on two ranks where the notebooks used eight GPUs (a tensor-parallel or sharding degree
of 2 for their 4, 8 or 32) and tiny models.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["REPO", "FOLDER", "Revision", "REVISIONS", "launch", "run_ok", "run_in_ranks", "write_bert_data",
           "write_gpt2_data", "NOTEBOOK", "revision", "REDUCTIONS"]

ROOT = Path(__file__).resolve().parents[2]
REDUCTIONS = Path(__file__).resolve().parent / "smp_v1_reductions"
REPO = "aws/amazon-sagemaker-examples"
FOLDER = "training/distributed_training/pytorch/model_parallel"


@dataclass(frozen=True)
class Revision:
    """One published text of a script: where it is, and how its reduction runs it."""

    family: str    # "mnist", "bert" or "gpt2"
    commit: str    # the first default-branch commit with this text
    date: str
    path: str      # under FOLDER
    blob: str      # the text's git blob id
    reduction: str  # under REDUCTIONS
    args: tuple[str, ...] = ()  # the revision's own switches of its reduction
    reaches: str = ""  # what it reaches for (docs/smp_api.md's table)
    bug: str = ""  # the end of the error the published text fails with, after training, as it did on SageMaker

    @property
    def short(self) -> str:
        """The commit, as the tests and the docs name it."""
        return self.commit[:7]


_MNIST = "mnist/utils/pt_mnist.py"
_BERT = "bert/bert_example/sagemaker_smp_pretrain.py"
_GPT2 = "gpt2/train_gpt_simple.py"
_MNIST_REACHES = ("smp.init() from SM_HP_MP_PARAMETERS, torch.cuda.amp.autocast in the step, (output, loss) step "
                  "returns, .item() lists in evaluation, smp.save(partial=True) on dp_rank 0")
_BERT_REACHES = ("seed + local_rank, smp.load + load_state_dict(strict=False) before the first step, model.to, "
                 "FusedLAMB + PolyWarmUpScheduler (param_groups[0]['step']), an 11-argument step, smp.save of a "
                 "pickled DataLoader, ckpt_<n>.pt_<mp_rank> removal, smdistributed.modelparallel.test imports")
REVISIONS = [Revision(*row) for row in (
    ("mnist", "1938d0b99a6319ea8da5a0d52e864ed8da5b4ba5", "2020-12-08", _MNIST,
     "093878e9044d32bb880f42b06d9127b60f935601", "mnist/pt_mnist.py", (), _MNIST_REACHES),
    ("mnist", "93cd954b6f57c8f905340479b92eaca17b2527ff", "2021-05-11", _MNIST,
     "8331b0a5de5e6b62d746741d895e2adb24a2d6f7", "mnist/pt_mnist.py", (), "as 1938d0b (black)"),
    ("mnist", "187e52fc3db844645b469cc35122ccbc188357a1", "2021-05-11", _MNIST,
     "6208707ed9322479b9b0a0affa4506568b6ec91f", "mnist/pt_mnist.py", (), "as 1938d0b (isort)"),
    ("bert", "1938d0b99a6319ea8da5a0d52e864ed8da5b4ba5", "2020-12-08", _BERT,
     "28052ff9757604caffb2737b991737b043102e7f", "bert/sagemaker_smp_pretrain.py",
     ("--data-shard-dp", "0", "--drop-last", "0", "--s3-sync", "0", "--undefined-name", "1"),
     _BERT_REACHES + "; files by global rank", "name 'nonsequential' is not defined"),
    ("bert", "ccb28f49611f0f8d7a063a37fe579e5e973779f2", "2020-12-10", _BERT,
     "2f3da77851cdd84c911c2b9c6dac3d3248a413db", "bert/sagemaker_smp_pretrain.py",
     ("--data-shard-dp", "0", "--drop-last", "0"), "+ smp.local_rank() and smp.barrier() around S3 syncs"),
    ("bert", "c6cf46d195ce9a5617dd2ed8e4d9334c6fb5483d", "2020-12-29", _BERT,
     "29c7e2e563b4bd007c6b7fe333755fd5918b3519", "bert/sagemaker_smp_pretrain.py", ("--data-shard-dp", "0"),
     "+ drop_last"),
    ("bert", "3a5c776233aa1b3e261edb79890f00ba4c5a68ac", "2021-01-05", _BERT,
     "8236a1ea4ba7d61d35087ab89db3ac527c3898e1", "bert/sagemaker_smp_pretrain.py", ("--data-shard-dp", "0"),
     "as c6cf46d"),
    ("bert", "a9a6a900987f035c5e07503f3a7b11e96676f0fa", "2021-02-10", _BERT,
     "658a40229f8af196b28eee4fe0cd3da8a5e9f3ca", "bert/sagemaker_smp_pretrain.py", (),
     "+ files by smp.dp_rank()/dp_size() after smp.is_initialized()"),
    ("bert", "93cd954b6f57c8f905340479b92eaca17b2527ff", "2021-05-11", _BERT,
     "7323523e2d47460a5c57ec80ef0bdb37df0dd9d9", "bert/sagemaker_smp_pretrain.py", (), "as a9a6a90 (black)"),
    ("bert", "187e52fc3db844645b469cc35122ccbc188357a1", "2021-05-11", _BERT,
     "3672598f645515c53d7cc9594697fae0d09a4eb1", "bert/sagemaker_smp_pretrain.py", (), "as a9a6a90 (isort)"),
    ("bert", "7ed6accf315c3f04a3fdc23dcf392726b9f3387b", "2022-01-04", _BERT,
     "b6e9b3861cef0b7a88b5dea916f6b66746814326", "bert/sagemaker_smp_pretrain.py", (), "as a9a6a90"),
    ("gpt2", "7ed6accf315c3f04a3fdc23dcf392726b9f3387b", "2022-01-04", _GPT2,
     "16e7cd75df43695ae56f87dc839ee4f4c1362ff5", "gpt2/train_gpt_simple_2022.py", ("--revision", "2022-01"),
     "model.module.module.module.transformer.seq_layers through FP16_Module, FP16_Optimizer in "
     "smp.DistributedOptimizer, is_distributed_parameter, get_distribution_axis, state_mod, post-step/partition "
     "hooks, smp.save/smp.load of .pt_<pp>_<tp> files"),
    ("gpt2", "ccc102a4c3a3bd6d73f0ce8b8299823bbb952f9b", "2022-05-25", _GPT2,
     "5c44c90ed0b66afaa990808515ecbc9932d22fd6", "gpt2/train_gpt_simple_2022.py", ("--revision", "2022-05"),
     "+ smp.save(v3=), fused-kernel keywords, placement_strategy and skip_tracing keys"),
    ("gpt2", "b7272f063919943b8ab02e346265f487dcb3c986", "2022-10-13", _GPT2,
     "ac2abb3a0039e5b378044fbde03d45d82bd13591", "gpt2/train_gpt_simple_2022_10.py", (),
     "model.get_module().transformer.seq_layers, smp.model_creation(dtype=float16), smp's fp16 loss scaling, "
     "smp.save_checkpoint / resume_from_checkpoint, backward_passes_per_step"),
    ("gpt2", "198c0bd665ac8554450e7267993ab35bec3b36e6", "2023-06-23", "gpt2/train.py",
     "e1d168f2e477f3c485a51279db1a7cc663410355", "gpt2/train_2023.py", (),
     "sharded data parallelism with bf16 and delayed initialisation, optimizer._global_grad_norm, "
     "ddp_dist_backend, fine-tuning from torch.save's fullmodel.pt"),
)]


def revision(family: str, short: str) -> Revision:
    """The revision of ``family`` whose commit starts with ``short``."""
    return next(r for r in REVISIONS if r.family == family and r.commit.startswith(short))


# The notebooks' SMP parameters (the estimators' "smdistributed" "parameters"), at two ranks.
NOTEBOOK: dict[str, dict] = {
    "mnist": {"microbatches": 4, "placement_strategy": "spread", "pipeline": "interleaved", "optimize": "speed",
              "partitions": 2, "ddp": True},
    "bert": {"optimize": "speed", "microbatches": 12, "partitions": 2, "ddp": True, "pipeline": "interleaved",
             "overlapping_allreduce": True, "placement_strategy": "cluster", "memory_weight": 0.3},
    "gpt2-2022": {"ddp": True, "tensor_parallel_degree": 2, "partitions": 1, "shard_optimizer_state": True,
                  "prescaled_batch": False, "fp16_params": True, "optimize": "speed", "auto_partition": False,
                  "default_partition": 0},
    "gpt2-2022-10": {"ddp": True, "tensor_parallel_degree": 2, "partitions": 1, "shard_optimizer_state": True,
                     "prescaled_batch": False, "fp16": True, "optimize": "speed", "auto_partition": False,
                     "default_partition": 0},
    "gpt2-2023": {"ddp": True, "skip_tracing": True, "delayed_parameter_initialization": True,
                  "offload_activations": False, "activation_loading_horizon": 4, "sharded_data_parallel_degree": 2,
                  "fp16": False, "bf16": True, "partitions": 1},
}


@dataclass
class Run:
    """What a launch printed and how it ended."""

    returncode: int
    stdout: str
    stderr: str = field(repr=False)


def launch(script: str, args: list[str], parameters: dict, nproc: int = 2, timeout: float = 600) -> Run:
    """``smp launch -n nproc --as-smdistributed`` of a reduction, the notebook's ``parameters`` in
    ``SM_HP_MP_PARAMETERS``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SM_HP_MP_PARAMETERS=json.dumps(parameters),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("SMP_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "smp.cli", "launch", "-n", str(nproc), "--as-smdistributed",
                           str(REDUCTIONS / script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return Run(done.returncode, done.stdout, done.stderr)


def run_ok(script: str, args: list[str], parameters: dict, nproc: int = 2) -> str:
    """:func:`launch`, which must succeed; its output."""
    run = launch(script, args, parameters, nproc)
    assert run.returncode == 0, f"exit code {run.returncode}:\n{(run.stdout + run.stderr)[-4000:]}"
    return run.stdout


def _as_main(rank: int, world: int, script: str, args: list[str], parameters: dict) -> str:
    """One rank of :func:`run_in_ranks`: the script run as ``__main__`` under the alias, its output captured."""
    import contextlib
    import io
    import runpy

    import smp

    smp.alias_smdistributed()
    os.environ["SM_HP_MP_PARAMETERS"] = json.dumps(parameters)
    sys.path.insert(0, str((REDUCTIONS / script).parent))
    sys.argv = [str(REDUCTIONS / script), *args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(REDUCTIONS / script), run_name="__main__")
    return out.getvalue()


def run_in_ranks(script: str, args: list[str], parameters: dict, nproc: int = 2) -> str:
    """What :func:`run_ok` does, on ranks forked by :func:`smp.testing.run_ranks` (seconds less to start than
    ``smp launch``, which the slow tests use); rank 0's output."""
    from smp.testing import run_ranks

    return run_ranks(_as_main, nproc, script, args, parameters, timeout=300)[0]


def write_bert_data(folder: Path, files: int, batch: int, seq: int = 16, predictions: int = 3,
                    vocab: int = 96) -> tuple[Path, Path]:
    """``files`` data files of one batch each, as the BERT script reads them (``.npz`` for HDF5: token ids with a
    pattern, ``predictions`` masked positions a sample, next-sentence labels), and a tiny ``bert_config.json``."""
    data = folder / "data"
    data.mkdir(parents=True)
    for f in range(files):
        g = np.random.default_rng(100 + f)
        start, step = g.integers(5, vocab, (batch, 1)), g.integers(1, 4, (batch, 1))
        ids = 5 + (start + step * np.arange(seq)) % (vocab - 5)
        segments = (np.arange(seq) >= seq // 2).astype(np.int64) * np.ones((batch, 1), np.int64)
        positions = np.sort(np.stack([g.choice(np.arange(1, seq), predictions, replace=False) for _ in range(batch)]),
                            axis=1)
        masked = ids.copy()
        np.put_along_axis(masked, positions, 4, axis=1)
        np.savez(data / f"part_{f:02d}_training.npz", input_ids=masked, input_mask=np.ones((batch, seq), np.int64),
                 segment_ids=segments, masked_lm_positions=positions,
                 masked_lm_ids=np.take_along_axis(ids, positions, axis=1), next_sentence_labels=step[:, 0] % 2)
    config = folder / "bert_config.json"
    config.write_text(json.dumps({"attention_probs_dropout_prob": 0, "hidden_act": "gelu", "hidden_dropout_prob": 0,
                                  "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                                  "max_position_embeddings": 32, "num_attention_heads": 2, "num_hidden_layers": 2,
                                  "type_vocab_size": 2, "vocab_size": vocab - 6}))
    return data, config


def write_gpt2_data(folder: Path, samples: int = 32, seq: int = 32, vocab: int = 256) -> tuple[Path, Path]:
    """Training (two files) and validation JSON lines of token ids with a pattern, as the GPT-2 scripts read them."""
    train, test = folder / "train", folder / "test"
    train.mkdir(parents=True)
    test.mkdir(parents=True)
    for path, seed in ((train / "part_0.json", 1), (train / "part_1.json", 2), (test / "part_0.json", 3)):
        r = random.Random(seed)
        with open(path, "w") as f:
            for _ in range(samples):
                start, step = r.randrange(vocab), r.choice([1, 3, 7])
                ids = [(start + i * step) % (vocab - 1) for i in range(seq)]
                f.write(json.dumps({"input_ids": ids, "attention_mask": [1] * seq}) + "\n")
    return train, test
