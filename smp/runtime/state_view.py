"""``smp.state``: SMP v1's module-level state object, as a read-only view of :func:`smp.runtime.state.get`.

Libraries written for SMP v1 read it: Hugging Face's ``Trainer`` reads ``smp.state.cfg.fp16``,
``.prescaled_batch`` and ``.shard_optimizer_state``, and ``save_pretrained`` passes state dicts through
``smp.state.module_manager.translate_functions``. The view holds nothing itself; each read goes to the state
``smp.init`` built, so it is never stale.

Before ``smp.init``, as in SMP v1 (whose state object exists from import): ``initialized`` is False, ``cfg`` is
None and ``module_manager.translate_functions`` is an empty list. After it, ``cfg`` is the checked config under
SMP's attribute names (:class:`ConfigView`), and the translators are the list the state keeps
(:attr:`smp.runtime.state.State.translate_functions`), which tensor parallelism appends to.
"""
from __future__ import annotations

from typing import Any

from smp.runtime import state as _runtime
from smp.runtime.config import Config

__all__ = ["state", "StateView", "ConfigView", "ModuleManagerView"]


class ConfigView:
    """The active :class:`~smp.runtime.config.Config` under SMP v1's attribute names and values: every key reads
    as the config's own, except those whose default SMP v1 resolves at ``smp.init`` (``memory_weight``: 0.2 or 0.8
    by ``optimize``; ``active_microbatches``: stages + 2), which read resolved, and ``pipeline``, which reads as
    SMP's name of the schedule (``"interleaved"`` or ``"simple"``, also when the config used ``"1f1b"`` /
    ``"gpipe"``). Read-only."""

    __slots__ = ("_config",)

    def __init__(self, config: Config):
        object.__setattr__(self, "_config", config)

    @property
    def memory_weight(self) -> float:
        """The memory weight partitioning uses (SMP resolves the default from ``optimize``)."""
        return self._config.effective_memory_weight

    @property
    def active_microbatches(self) -> int:
        """Microbatches in flight at most (SMP's default: stages + 2)."""
        return self._config.max_in_flight

    @property
    def pipeline(self) -> str:
        """SMP's name of the schedule: ``"interleaved"`` (1F1B, backward first) or ``"simple"`` (GPipe)."""
        return "interleaved" if self._config.schedule == "1f1b" else "simple"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        try:
            return getattr(self._config, name)
        except AttributeError:
            raise AttributeError(f"smp.state.cfg has no {name!r}: the config keys are those of smp.Config "
                                 "(docs/smp_api.md, Setup and config)") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"smp.state.cfg is read-only: set {name!r} in the config passed to smp.init")

    def __repr__(self) -> str:
        return f"ConfigView({self._config!r})"


class ModuleManagerView:
    """SMP v1's ``state.module_manager``, for its ``translate_functions``."""

    __slots__ = ()

    @property
    def translate_functions(self) -> list:
        """``(smp_to_hf, hf_to_smp)`` pairs that translate full state dicts between this engine's keys and Hugging
        Face's (empty before ``smp.init``, and without tensor parallelism)."""
        return _runtime.get().translate_functions if _runtime.is_initialized() else []


class StateView:
    """``smp.state``: ``initialized``, ``cfg``, ``module_manager``; read-only."""

    __slots__ = ()

    @property
    def initialized(self) -> bool:
        """Has ``smp.init`` run in this process?"""
        return _runtime.is_initialized()

    @property
    def cfg(self) -> ConfigView | None:
        """The active config (:class:`ConfigView`), or None before ``smp.init``, as in SMP v1."""
        return ConfigView(_runtime.get().config) if _runtime.is_initialized() else None

    @property
    def module_manager(self) -> ModuleManagerView:
        """SMP's module manager, for its ``translate_functions``."""
        return ModuleManagerView()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"smp.state is read-only (setting {name!r}): smp.init builds the state")

    def __repr__(self) -> str:
        return f"smp.state(initialized={self.initialized})"


state = StateView()
