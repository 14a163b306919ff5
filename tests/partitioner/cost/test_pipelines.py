"""One set of pipeline names everywhere: ours (``1f1b``, ``gpipe``) and SMP's (``interleaved``, ``simple``) mean the
same pipeline in the partitioner's options, the smp config, the ``smp`` command and the schedule generators."""
from __future__ import annotations

import pytest

from partitioner import PartitionOptions
from partitioner.cost.pipelines import PIPELINE_NAMES, pipeline_of
from pipeline.schedule import make_schedule
from smp.cli.errors import CLIError
from smp.cli.options import Options
from smp.runtime.config import ConfigError, load_config


@pytest.mark.parametrize("name", sorted(PIPELINE_NAMES))
def test_every_name_means_the_same_pipeline_everywhere(name: str) -> None:
    want = pipeline_of(name)
    assert PartitionOptions(pipeline=name).pipeline == want
    assert load_config({"partitions": 2, "pipeline": name}).schedule == want
    assert Options(2, name).schedule == want
    assert make_schedule(name, 2, 4).name == make_schedule(want, 2, 4).name


def test_an_unknown_name_lists_every_accepted_one() -> None:
    with pytest.raises(ValueError, match=r"'zb' is not known; use one of \['1f1b', 'gpipe', 'interleaved', 'simple'\]"):
        PartitionOptions(pipeline="zb")
    with pytest.raises(CLIError, match="'1f1b' and SMP's 'interleaved' are 1F1B"):
        Options(2, "zb")
    with pytest.raises(ConfigError, match="'interleaved' or '1f1b'"):
        load_config({"partitions": 2, "pipeline": "zb"})
