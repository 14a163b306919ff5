"""The environment of a SageMaker model-parallel job, read as SMP v1 reads it.

SageMaker passes an estimator's model-parallel parameters to every process as JSON in ``SM_HP_MP_PARAMETERS``
(SMP's config keys: ``{"partitions": 2, "microbatches": 4, "ddp": true}``), and its launcher settings in
``SM_FRAMEWORK_PARAMS`` (``{"sagemaker_mpi_enabled": true, "sagemaker_mpi_num_of_processes_per_host": 8}``).
SMP v1 merges ``SM_HP_MP_PARAMETERS`` into the config ``smp.init`` gets, the environment winning, so
``smp.init()`` with no argument runs on it; Hugging Face's ``Trainer`` relies on that. Here the same holds
(:func:`merged`, warning where the two disagree), and ``SM_FRAMEWORK_PARAMS``' processes per host is checked
against the processes the launcher started (:func:`check_processes_per_host`). Without ``SM_HP_MP_PARAMETERS``
nothing here applies.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

from partitioner.errors import EngineError

__all__ = ["MP_PARAMETERS_ENV", "FRAMEWORK_PARAMS_ENV", "in_sagemaker_job", "mp_parameters", "merged",
           "check_processes_per_host", "SageMakerEnvError"]

MP_PARAMETERS_ENV = "SM_HP_MP_PARAMETERS"
FRAMEWORK_PARAMS_ENV = "SM_FRAMEWORK_PARAMS"
_PROCESSES_PER_HOST = "sagemaker_mpi_num_of_processes_per_host"


class SageMakerEnvError(EngineError, ValueError):
    """``SM_HP_MP_PARAMETERS`` or ``SM_FRAMEWORK_PARAMS`` is not what a SageMaker job sets; the message says why."""


def in_sagemaker_job() -> bool:
    """Does this process run with SageMaker's model-parallel parameters (``SM_HP_MP_PARAMETERS`` is set)?"""
    return MP_PARAMETERS_ENV in os.environ


def _json_object(name: str) -> dict[str, Any] | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SageMakerEnvError(f"{name}={text!r} is not valid JSON ({exc}): SageMaker sets it to a JSON object "
                                "such as '{\"partitions\": 2, \"microbatches\": 4}'; fix or unset it") from None
    if not isinstance(value, dict):
        raise SageMakerEnvError(f"{name}={text!r} is not a JSON object: SageMaker sets it to one, such as "
                                "'{\"partitions\": 2, \"microbatches\": 4}'; fix or unset it")
    return value


def mp_parameters() -> dict[str, Any] | None:
    """The config keys in ``SM_HP_MP_PARAMETERS`` (None when it is not set)."""
    return _json_object(MP_PARAMETERS_ENV)


def merged(config: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``env`` (``SM_HP_MP_PARAMETERS``) merged in, the environment winning as in SMP v1; a key both
    give with different values is warned about (``UserWarning``), naming both values. Both come with SMP's alias
    ``partitions`` already under its name (:func:`smp.runtime.config.load_config`)."""
    for key in sorted(set(config) & set(env)):
        if config[key] != env[key]:
            warnings.warn(f"smp config {key!r}={config[key]!r} is overridden by {MP_PARAMETERS_ENV}'s {key!r}="
                          f"{env[key]!r}: in a SageMaker job the estimator's parameters win, as in SMP v1; unset "
                          f"{MP_PARAMETERS_ENV} to use the config passed to smp.init", UserWarning, stacklevel=4)
    return {**config, **env}


def check_processes_per_host(local_world_size: int | None) -> None:
    """Refuse a launch whose processes on this host (``local_world_size``, None when unknown) are not the
    ``sagemaker_mpi_num_of_processes_per_host`` of ``SM_FRAMEWORK_PARAMS`` (when it gives one)."""
    params = _json_object(FRAMEWORK_PARAMS_ENV)
    wanted = None if params is None else params.get(_PROCESSES_PER_HOST)
    if wanted is None or local_world_size is None:
        return
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise SageMakerEnvError(f"{FRAMEWORK_PARAMS_ENV}'s {_PROCESSES_PER_HOST}={wanted!r} is not a positive "
                                "integer; fix or remove it")
    if wanted != local_world_size:
        raise SageMakerEnvError(f"{FRAMEWORK_PARAMS_ENV} asks for {_PROCESSES_PER_HOST}={wanted}, but "
                                f"{local_world_size} processes were started on this host: launch with "
                                f"`smp launch -n {wanted} ...`, or change {FRAMEWORK_PARAMS_ENV}")
