"""``smp.checkpoint.commit`` in one process: checksums recorded while writing, staged files that only a publish makes
visible, permissions that follow the umask, and loads that verify every file against the manifest."""
from __future__ import annotations

import hashlib
import os
import stat

import pytest
import torch

from smp.checkpoint.commit import (
    CheckpointError,
    discard,
    load_file,
    publish,
    read_manifest,
    stage,
    write_file,
    write_manifest,
)
from tests.smp.test_checkpoint import damage


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_write_file_records_what_is_on_disk(tmp_path, umask_027):
    path = str(tmp_path / "w.pt")
    digest = write_file({"w": torch.arange(1000.0)}, path)
    data = open(path, "rb").read()
    assert digest == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # 0o666 under the umask, not mkstemp's 0600
    assert torch.equal(torch.load(path)["w"], torch.arange(1000.0))


def test_staged_files_appear_only_when_published(tmp_path):
    final = str(tmp_path / "ckpt_0")
    digests = stage({final: torch.ones(3)})
    assert os.listdir(tmp_path) == [".ckpt_0.smp-tmp"] and list(digests) == [final]
    publish(digests)
    assert os.listdir(tmp_path) == ["ckpt_0"]
    with pytest.raises(AttributeError):  # a failing write removes its temporary file and leaves the old one
        stage({final: {"ok": torch.zeros(3), "bad": lambda: None}})
    assert os.listdir(tmp_path) == ["ckpt_0"] and torch.equal(torch.load(final), torch.ones(3))
    stage({final: torch.zeros(3)})
    discard([final])
    assert os.listdir(tmp_path) == ["ckpt_0"]


def _committed(tmp_path) -> tuple[str, str]:
    path, manifest = str(tmp_path / "m.pt"), str(tmp_path / "m.manifest.json")
    digests = stage({path: {"w": torch.arange(10000.0)}})
    publish(digests)
    write_manifest(manifest, digests, partial=False)
    return path, manifest


def test_verified_load(tmp_path):
    path, manifest = _committed(tmp_path)
    data = read_manifest(manifest, path)
    assert data["partial"] is False and list(data["files"]) == ["m.pt"]
    assert torch.equal(load_file(path, data)["w"], torch.arange(10000.0))


@pytest.mark.parametrize("truncate", [False, True])
def test_damaged_file_is_named(tmp_path, truncate):
    path, manifest = _committed(tmp_path)
    damage(path, truncate)
    with pytest.raises(CheckpointError, match=f"truncated or corrupt checkpoint {path}: "):
        load_file(path, read_manifest(manifest, path))


def test_uncommitted_and_broken_manifests(tmp_path):
    path, manifest = _committed(tmp_path)
    other = str(tmp_path / "other.pt")
    torch.save(1, other)
    with pytest.raises(CheckpointError, match="is not listed in its manifest"):
        load_file(other, read_manifest(manifest, path))
    with pytest.raises(CheckpointError, match="is not a committed checkpoint: its manifest .* is missing"):
        read_manifest(str(tmp_path / "none.manifest.json"), "none")
    with open(manifest, "r+") as fh:
        fh.truncate(20)
    with pytest.raises(CheckpointError, match=f"truncated or corrupt checkpoint {manifest}"):
        read_manifest(manifest, path)
