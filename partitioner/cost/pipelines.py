"""The two pipelines a plan is priced for, under every name users know them by.

1F1B (Narayanan et al. 2019, PipeDream-Flush, arXiv:2006.09503; SMP's ``"interleaved"``: backward first, at most
p - s microbatches in flight on stage s) and GPipe (Huang et al. 2019, arXiv:1811.06965; SMP's ``"simple"``: all
forwards, then all backwards, m in flight). The smp config, the ``smp`` command's ``--pipeline``,
:class:`partitioner.PartitionOptions` and :func:`pipeline.make_schedule` all accept every name in
:data:`PIPELINE_NAMES`. No torch here: the command line reads it before a command runs.
"""
from __future__ import annotations

__all__ = ["PIPELINES", "PIPELINE_NAMES", "pipeline_of"]

PIPELINES = ("1f1b", "gpipe")
PIPELINE_NAMES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "1f1b", "simple": "gpipe"}


def pipeline_of(name: str) -> str:
    """The pipeline ``name`` means, as one of :data:`PIPELINES`; an error that lists every accepted name."""
    if name not in PIPELINE_NAMES:
        raise ValueError(f"pipeline {name!r} is not known; use one of {sorted(PIPELINE_NAMES)} ('1f1b' and SMP's "
                         "'interleaved' are 1F1B, backward first; 'gpipe' and SMP's 'simple' are GPipe)")
    return PIPELINE_NAMES[name]
