"""SageMaker's public data-parallel MNIST script, every revision of it, for tests/smp/test_smddp.py's slow test: where
each one is, how it is fetched (its text is never stored in this repository), and the only edits made to run it here.

The script is ``train_pytorch_smdataparallel_mnist.py`` of aws/amazon-sagemaker-examples, with its ``model_def.py``
beside it. :data:`REVISIONS` holds each distinct text it has had on any branch, named by the first commit that has it,
with the file's git blob id (checked on fetch) and the API it calls: ``"v1"``, the library's own
(``smdistributed.dataparallel.torch.distributed`` and its ``DistributedDataParallel``), or ``"backend"``
(torch.distributed with ``import smdistributed.dataparallel.torch.torch_smddp`` and ``backend="smddp"``). Each API
has a fast variant in the default run (tests/smp/smddp_scripts). Later commits that only moved the file kept one of
these texts (the 2024-07 ``archived/`` copy and main's 32589e6 have 12c978e's).

Fetching (:func:`fetch`): a cache folder (``SMP_PUBLIC_SCRIPTS_CACHE``, default ``~/.cache/smp-public-scripts``),
else a clone or mirror named by ``SMP_SAGEMAKER_EXAMPLES``; None when neither has it (the test then skips, saying how
to provide them). The tests never reach the network: a clone is the user's to make.

The edits (:func:`adapt`), each one asserted to apply: on the CPU the script's CUDA lines (its refusal to run without
CUDA, ``torch.device("cuda")``, ``set_device``, ``.cuda(local_rank)``, ``device_ids``); SageMaker's ``/opt/ml/``
paths moved under the test's folder. Nothing else: the import lines are the script's own (``smp launch
--as-smdistributed`` aliases them), and the data and container packages are the stand-ins of tests/smp/smddp_standins.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "Revision", "REVISIONS", "BUGS", "fetch", "check_blob", "adapt", "ranks_needed", "SOURCE_ENV",
           "CACHE_ENV"]

REPO = "aws/amazon-sagemaker-examples"
SOURCE_ENV = "SMP_SAGEMAKER_EXAMPLES"  # a clone, or a bare mirror, of aws/amazon-sagemaker-examples
CACHE_ENV = "SMP_PUBLIC_SCRIPTS_CACHE"
FOLDER = "training/distributed_training/pytorch/data_parallel/mnist/code"
MOVED = "      build_and_train_models/sm-distributed_data_parallelism_pytorch/code"  # its leading spaces are the repo's
SCRIPT = "train_pytorch_smdataparallel_mnist.py"


@dataclass(frozen=True)
class Revision:
    """One text of the script: the first commit with it, its date, its git blob id and the API it calls."""

    commit: str
    date: str
    blob: str
    api: str
    folder: str = FOLDER

    @property
    def script(self) -> str:
        """The script's path in the repository at :attr:`commit`."""
        return f"{self.folder}/{SCRIPT}"


REVISIONS = [Revision(*row) for row in (  # (first commit with the text, its date, the text's blob id, its API)
    ("6365190f5172766cabc8ece34bf0b9cd718f6fac", "2020-11-19", "1f9bcaf88b1e55f082db48a0d75dd81dd32341af", "v1"),
    ("5f50b59a1a9bf02a331a7800bd98713932150637", "2020-11-25", "df86cc5da1a3dc0ee5abd5cc3be8963631207410", "v1"),
    ("b76c517d940a04cde9606e2d6d419fa55edf057e", "2020-12-08", "981d62e7ebba518796a4defc92656d71898289b4", "v1"),
    ("4f1efe024a9b5d5a8381310f49654b675d8aa527", "2021-03-05", "20d1d5f6964445c1e9c1cc4a1b0835fd2c78a0a6", "v1"),
    ("3eed5a7f19765980946de2d92f19c6ad2fbe43eb", "2021-03-16", "207edeec56a30a51cfe0e6ce22b0bf63bd18673c", "v1"),
    ("3e6083d1b53cb718893a04c46513a9482a17bd6b", "2021-04-07", "075b353b7bba27fccf0fb9b9f975478e7ad196e8", "v1"),
    ("1d66b698edcf052d3a5eb6db34837cc52f1e4675", "2021-04-07", "5a32d35f9764b51ed9ca8e06e52f4f435c4bf4cb", "v1"),
    ("840ee99b97e24f0a7bccaa4a955fe2fe27beaabf", "2021-04-22", "e892bc91e415f70d52e594cfd4f2a77e1aa47292", "v1"),
    ("462e1febb5bf77518ab5387e5770ad81419a2d71", "2021-05-01", "fe3282e8d812070d153217dd33aaa942769717ca", "v1"),
    ("187e52fc3db844645b469cc35122ccbc188357a1", "2021-05-11", "0e07464cefbab703f908f73ff69e4977d2dfe41f", "v1"),
    ("296b3e435f3c3c6420a2db2f1551c414e38595ce", "2021-05-11", "1539ead1812e4b1e61df3a6345f81f5d10f2ba4a", "v1"),
    ("1511f1b0d2700e58ff4be1bfb5da0e270825635b", "2021-06-19", "a3ddc5388a7f412cc70539183bfcf9863a259491", "v1"),
    ("ead743eb8392b428360713854b52a8edfef11bb8", "2021-07-20", "91cf8adb103e39b8e04e64db4e68cfd00c620a96", "v1"),
    ("40bc1a1a4a95c0ca135d2d49c2d4848f82200d0e", "2021-07-20", "b142c298ed1575e3daf2ad6a24160eff516a85d7", "v1"),
    ("9b707da50a5595f58bec6c017325c541355ea904", "2022-02-09", "41bfcfa7063316b81ccc14a3c719ceb08f2cfe39", "v1"),
    ("426023c1b370cf375b55e44fdadd0fcbc6172595", "2022-02-10", "d2a55efae684f9fc5cb2319e68eb2f2374d57fe2", "v1"),
    ("b92cd504d0578929da302277e0876d666ce40cfb", "2022-06-07", "52026043f30d014374153600d3cc6b0c85ac3736", "backend"),
    ("bbb4deb5d9dbe18f7e7531db0298e973713413ff", "2022-06-13", "1325f73e8c5895a33fd4d2b4a3e2e0e1d7099cac", "backend"),
    ("e42d9d51aeb6fe8edf08ee77cf7159556180160a", "2022-06-13", "f6867221b1692e95b0bafa78286d30bb6929d7f5", "backend"),
    ("96ab9c969076f84a74795bc817b19e08c234b669", "2022-06-20", "a63679feb493e7ebe93876089bcc0d203b645014", "backend"),
    ("cc4eb1b08ba245eb02718db94c437e307e678e52", "2022-06-22", "ca9290efa64849d83e8554832ceff90bf217c48e", "backend"),
    ("e6b96e3a7875cf4ea5c830608e27891c159791d2", "2023-06-05", "99438a3da3c0ed1d0bddceaf26768cd4053c4f5a", "backend"),
    ("66d8307b66cdc7e15fe7de92820067d7a5996e04", "2024-01-22", "040b1ea8a89f4e698489e75a1151331b09eb3114", "backend"),
    ("ada37327df534ce8869fa53a09bb4b38da8aceef", "2024-01-22", "bd3942855445b79ddaa2074862db1a9010be1414", "backend"),
    ("12c978e21de01a4e9b71a2b2f266893fa25b5519", "2024-05-31", "9968351753bfa275a76fc484866bea5efeb64b78", "backend"),
    ("e5a0e783e17f679da245e862cc9b6db7dcfc5a92", "2024-07-29", "5b2be043fae9a49eed57db1f7e3039e36c0ceb24", "backend",
     MOVED),
)]


# The revisions that fail by their own bug, on SageMaker as here: blob id -> (the end of the error, whether an epoch
# of training comes first). 2022-06-13's bbb4deb asks torch.distributed for the world size before it calls
# init_process_group (fixed the same day by e42d9d5); 2024-01-22's two call os.join for os.path.join to save the model.
BUGS = {
    "1325f73e8c5895a33fd4d2b4a3e2e0e1d7099cac": ("Default process group has not been initialized", False),
    "040b1ea8a89f4e698489e75a1151331b09eb3114": ("module 'os' has no attribute 'join'", True),
    "bd3942855445b79ddaa2074862db1a9010be1414": ("module 'os' has no attribute 'join'", True),
}


def _blob_id(text: str) -> str:
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _from_git(commit: str, path: str) -> str | None:
    source = os.environ.get(SOURCE_ENV)
    if not source:
        return None
    git_dir = Path(source) / ".git" if (Path(source) / ".git").exists() else Path(source)
    done = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{commit}:{path}"], capture_output=True,
                          text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def fetch(commit: str, path: str) -> str | None:
    """The text of ``path`` at ``commit`` of :data:`REPO` (see the module docstring for where from); None when it
    cannot be had here."""
    cached = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "smp-public-scripts") / commit / path.strip()
    if cached.exists():
        return cached.read_text()
    text = _from_git(commit, path)
    if text is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
    return text


def check_blob(revision: Revision, text: str) -> None:
    """The fetched script is the revision's, byte for byte."""
    assert _blob_id(text) == revision.blob, f"{revision.commit}:{revision.script} is not the text the test names"


# On the CPU: the script's CUDA lines, each (what it says, what it says here).
CPU_EDITS = [
    ("not torch.cuda.is_available()", "False"),  # its refusal to run without CUDA
    ('torch.device("cuda")', 'torch.device("cpu")'),
    ('torch.device(f"cuda:{local_rank}")', 'torch.device("cpu")'),
    ("torch.cuda.set_device(local_rank)", "pass"),
    ("model.cuda(local_rank)", "pass"),
    ("device_ids=[local_rank]", "device_ids=None"),
]
_CUDA_LEFT = re.compile(r"\.cuda\(|cuda\.set_device|device\(f?[\"']cuda")


def adapt(text: str, cpu: bool, opt_ml: Path) -> str:
    """The script with the edits of the module docstring: its CUDA lines when ``cpu``, and ``/opt/ml/`` under
    ``opt_ml``."""
    if cpu:
        assert CPU_EDITS[0][0] in text, "the script no longer refuses to run without CUDA: review CPU_EDITS"
        for old, new in CPU_EDITS:
            text = text.replace(old, new)
        left = _CUDA_LEFT.search(text)
        assert left is None, f"a CUDA line CPU_EDITS does not cover: {text[left.start():left.start() + 60]!r}"
    for quote in "\"'":
        text = text.replace(f"{quote}/opt/ml/", f"{quote}{opt_ml}/")
    return text


def ranks_needed(text: str) -> int:
    """The processes a revision needs: 8 where it scales the batch by ``world_size // 8`` (a division by zero with
    fewer; on SageMaker it ran on 8-GPU machines), else 2."""
    return 8 if "world_size // 8" in text else 2
