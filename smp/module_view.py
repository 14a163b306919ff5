"""``DistributedModel.module`` as SMP v1 scripts reach it: the wrapped module, whose ``.module`` is the module again.

In SMP v1, ``model.module`` was a wrapper around the module given to ``smp.DistributedModel``, and scripts of 2021-22
reached the model through it: SageMaker's published GPT-2 script takes its transformer layers as
``model.module.module.transformer.h`` (and, with its ``FP16_Module`` wrapper, ``model.module.module.module...``).
SMP's documentation also reads the model's own attributes on it (``model.module.submodule``). Here ``model.module`` is
:func:`module_view` of the wrapped module: the same module object's state under a subclass of its class that adds a
``module`` property returning the wrapped module. The view shares the module's ``__dict__``, so its parameters,
buffers, submodules, hooks, ``training`` flag and attributes are the module's (names unchanged: the engine traces,
partitions and checkpoints the view), and ``model.module.module`` is ``model.get_module()``.

A wrapped module with a submodule named ``module`` of its own (``FP16_Module``, ``DistributedDataParallel``) keeps it:
the view's ``forward`` runs the module's class ``forward`` on the module (not as a module call, which would run its
hooks twice), where ``self.module`` is that submodule; and the view's ``module`` is then a face of the wrapper that
also finds its submodule's attributes (``model.module.module.transformer``), as the view's own parameter names
(``module.transformer...``) need. A deep copy of the view (the engine traces one with fake weights) is a view of the
copy.
"""
from __future__ import annotations

import weakref
from typing import Any, cast

import torch

__all__ = ["module_view", "wrapped_module"]


def _base(view: torch.nn.Module) -> type[torch.nn.Module]:
    """The class of the module a view shows."""
    return cast(type[torch.nn.Module], type(view).__mro__[1])


def _as_base(view: torch.nn.Module) -> torch.nn.Module:
    """The wrapped module the view shows: the original object, or (for a copy of the view) a module of the original
    class sharing the copy's state."""
    original = type(view)._smp_wrapped()  # type: ignore[attr-defined]
    if original is not None and original.__dict__ is view.__dict__:
        return original
    return _sharing(_base(view), view)


def _sharing(cls: type[torch.nn.Module], like: torch.nn.Module) -> torch.nn.Module:
    """A ``cls`` object whose state is ``like``'s (the same ``__dict__``)."""
    out = cast(torch.nn.Module, object.__new__(cls))
    object.__setattr__(out, "__dict__", like.__dict__)
    return out


def _has_own_module(module: torch.nn.Module) -> bool:
    return "module" in dict(module.named_children())


def _reaching_getattr(self: torch.nn.Module, name: str) -> Any:
    """``nn.Module``'s lookup, then the wrapper's own ``module``'s attribute."""
    try:
        return torch.nn.Module.__getattr__(self, name)
    except AttributeError:
        return getattr(torch.nn.Module.__getattr__(self, "module"), name)


_REACHING: dict[type, type[torch.nn.Module]] = {}


def _reaching_class(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    if cls not in _REACHING:
        _REACHING[cls] = type(cls.__name__, (cls,), {"__getattr__": _reaching_getattr, "__module__": cls.__module__,
                                                     "__doc__": cls.__doc__})
    return _REACHING[cls]


def _shown(view: torch.nn.Module) -> torch.nn.Module:
    """The view's ``module``: the wrapped module; for a wrapper of its own, a face of it that also finds its
    submodule's attributes."""
    module = _as_base(view)
    return _sharing(_reaching_class(type(module)), module) if _has_own_module(module) else module


def _delegated_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The wrapped module's own forward, where ``self.module`` is its own submodule."""
    return _base(self).forward(_as_base(self), *args, **kwargs)


def module_view(module: torch.nn.Module) -> torch.nn.Module:
    """A view of ``module`` (see the module docstring): the same state, its class's behaviour, and ``.module``
    returning ``module``."""
    base = type(module)
    namespace: dict[str, Any] = {"module": property(_shown, doc="The module smp.DistributedModel wraps."),
                                 "_smp_wrapped": weakref.ref(module), "__module__": base.__module__,
                                 "__doc__": base.__doc__}
    if _has_own_module(module):  # FP16_Module, DDP: its forward reads self.module
        namespace["forward"] = _delegated_forward
    return _sharing(type(base.__name__, (base,), namespace), module)


def wrapped_module(view: torch.nn.Module) -> torch.nn.Module:
    """The module a :func:`module_view` shows (a module that is no view is returned as it is)."""
    return _as_base(view) if hasattr(type(view), "_smp_wrapped") else view
