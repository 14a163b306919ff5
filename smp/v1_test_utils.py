"""SMP v1's ``smdistributed.modelparallel.test.torch.utils``: the test helpers SMP shipped for its own test suite.

SageMaker's published BERT pre-training script imports ``verify`` and ``dump_model`` from it inside its training loop
and never calls them, so the import has to work (the ``smdistributed`` alias maps the module here). What they did was
never documented: calling one is an error that says so.
"""
from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["verify", "dump_model"]


def _undocumented(name: str) -> NoReturn:
    raise NotImplementedError(f"smdistributed.modelparallel.test.torch.utils.{name} was one of SMP's internal test "
                              "helpers and is not part of its documented API: smp provides the name so that scripts "
                              "importing it run, not its behaviour")


def verify(*args: Any, **kwargs: Any) -> NoReturn:
    """SMP's internal test helper; not provided (raises ``NotImplementedError``)."""
    _undocumented("verify")


def dump_model(*args: Any, **kwargs: Any) -> NoReturn:
    """SMP's internal test helper; not provided (raises ``NotImplementedError``)."""
    _undocumented("dump_model")
