"""Fixtures of the ``smp`` command's tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import FACTORY


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory) -> Path:
    """``mynet.py``, a file with factories that work and factories that fail in each way."""
    path = tmp_path_factory.mktemp("target") / "mynet.py"
    path.write_text(FACTORY)
    return path
