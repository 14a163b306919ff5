"""``Environment().additional_framework_parameters``: the job's framework parameters, read from the JSON in
``SM_FRAMEWORK_PARAMS`` (``{"sagemaker_distributed_dataparallel_enabled": true}`` when the job asked for the
data-parallel library)."""
from __future__ import annotations

import json
import os

__all__ = ["Environment"]


class Environment:
    """The part of the toolkit's environment the public script reads."""

    def __init__(self) -> None:
        self.additional_framework_parameters = json.loads(os.environ.get("SM_FRAMEWORK_PARAMS", "{}"))
