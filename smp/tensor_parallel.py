"""SMP v1's tensor-parallel surface: ``smp.tensor_parallelism``, ``smp.set_tensor_parallelism``, and the
substitution ``smp.DistributedModel`` makes of the modules they mark.

Marking: modules created inside ``with smp.tensor_parallelism(enabled, **kwargs):`` are marked with that
context's setting (the innermost context wins; an inner context's keywords add to the outer's);
``smp.set_tensor_parallelism(module, enabled, **kwargs)`` marks a built module and resets its descendants'
marks, which then follow it. A module without a mark follows its parent.

:func:`distribute`, when the model is wrapped: walking from the root, the first enabled module whose class is
registered (:mod:`smp.tp_registry`: GPT-2, BERT, RoBERTa, GPT-J, GPT-Neo, a user's ``smp.tp_register``) is
replaced by its distributed module, built from it with the marking keywords the module takes, and its
descendants are not visited (only the outermost supported module is distributed). The distributed module
gets the replaced module's weights through the state-dict translator (SMP v1 initialised it afresh: here the
model computes what it computed before), and the translator pair is recorded for checkpoints
(``smp.state.module_manager.translate_functions``). Enabled ``nn.Linear``/``nn.Embedding`` modules (SMP's
``DistributedLinear``/``DistributedEmbedding``) and any ``smp.nn`` module stay as they are and are split.

What tensor parallelism may split: the parameters of the distributed and enabled modules; when nothing is
marked and no ``smp.nn`` module is used, every parameter (the engine's in-place sharding of the traced graph,
:mod:`partitioner.tp.sharding`, which keeps the model's own names). ``distribute_embedding=False`` (SMP's
default) keeps a distributed LM's embedding and head whole on every tp rank.
"""
from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed

from partitioner.capture.program import tensor_aliases
from smp.delayed_init import delay_param_initialization
from smp.nn.config import TransformerConfig
from smp.nn.dist_module import DistributedModule
from smp.nn.lm_head import DistributedTransformerLMHead
from smp.runtime import state
from smp.runtime.compat import warn_no_effect
from smp.tp_registry import Substitution, substitution_for

__all__ = ["TPMark", "tensor_parallelism", "set_tensor_parallelism", "model_creation", "distribute"]

_LEAVES = (torch.nn.Linear, torch.nn.Embedding)  # SMP's DistributedLinear / DistributedEmbedding


@dataclass(frozen=True)
class TPMark:
    """A module's tensor-parallel setting: enabled or not, and the keywords for its distributed module."""

    enabled: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Modules created inside are marked for tensor parallelism (``enabled``), with ``kwargs`` for the
    distributed modules that replace them (``fused_bias_gelu``, ``attention_in_fp32``, ``distribute_embedding``,
    ...): see the module docstring."""
    if not isinstance(enabled, bool):
        raise TypeError(f"smp.tensor_parallelism(enabled={enabled!r}): enabled must be True or False")
    st = state.get()  # as in SMP: smp.init comes first
    outer = st.tp_context[-1].kwargs if st.tp_context else {}
    st.tp_context.append(TPMark(enabled, {**outer, **kwargs}))
    original = torch.nn.Module.__init__ if len(st.tp_context) == 1 else None

    def marking_init(module: torch.nn.Module, *args: Any, **kw: Any) -> None:
        assert original is not None
        original(module, *args, **kw)
        if st.tp_context:
            st.tp_marks.setdefault(module, st.tp_context[-1])

    if original is not None:
        torch.nn.Module.__init__ = marking_init  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        st.tp_context.pop()
        if original is not None:
            torch.nn.Module.__init__ = original  # type: ignore[method-assign]


@contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """SMP v1's later context for building the model: modules created inside are marked for tensor parallelism
    when ``tensor_parallelism`` (with ``tensor_parallel_config`` as :func:`tensor_parallelism`'s keywords),
    parameters are created without memory when the config's ``delayed_parameter_initialization`` is on, and in
    ``dtype`` when given (the default dtype inside)."""
    st = state.get()
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with delay_param_initialization(st.config.delayed_parameter_initialization), \
                _marking(tensor_parallelism, tensor_parallel_config):
            yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def _marking(enabled: bool, kwargs: dict[str, Any]) -> Iterator[None]:
    if enabled or kwargs:
        with tensor_parallelism(enabled, **kwargs):
            yield
    else:
        yield


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark ``module`` and, through it, its descendants (SMP v1's ``smp.set_tensor_parallelism``; call it before
    ``smp.DistributedModel``)."""
    st = state.get()
    if st.model is not None:
        raise RuntimeError("smp.set_tensor_parallelism must be called before smp.DistributedModel wraps the model")
    for sub in module.modules():
        st.tp_marks.pop(sub, None)
    st.tp_marks[module] = TPMark(enabled, dict(kwargs))


def distribute(root: torch.nn.Module) -> tuple[torch.nn.Module, set[str] | None]:
    """``root`` with its marked supported modules replaced (the root itself may be), and the names of the
    parameters tensor parallelism may split (None: all); see the module docstring."""
    st = state.get()
    marks = st.tp_marks
    if not any(m in marks for m in root.modules()) and not any(isinstance(m, DistributedModule)
                                                               for m in root.modules()):
        return root, None
    split: list[torch.nn.Module] = []
    unused: set[str] = set()
    shared: list[int] = []

    def seed() -> int:
        if not shared:  # one collective, on every rank alike (they substitute the same modules)
            shared.append(_shared_seed(st.world_group))
        return shared[0]

    def walk(module: torch.nn.Module, path: str, inherited: TPMark | None) -> torch.nn.Module:
        mark = marks.get(module, inherited)
        if isinstance(module, DistributedModule):
            split.append(module)
            return module
        if mark is not None and mark.enabled:
            sub = substitution_for(module)
            if sub is not None:
                dist = _substitute(module, path, sub, mark.kwargs, unused, seed)
                split.append(dist)
                return dist
            if isinstance(module, _LEAVES):
                split.append(module)
                return module
        for name, child in list(module.named_children()):
            new = walk(child, f"{path}{name}.", mark)
            if new is not child:
                setattr(module, name, new)
        return module

    new_root = walk(root, "", None)
    if unused:
        warn_no_effect(f"smp.tensor_parallelism({', '.join(f'{k}=...' for k in sorted(unused))})",
                       "no distributed module that replaced a marked module takes them", 3)
    ids = {id(p) for m in split for p in _splittable(m)}
    return new_root, {name for name, p in new_root.named_parameters(remove_duplicate=False) if id(p) in ids}


def _splittable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A distributed module's parameters tensor parallelism may split (a distributed LM's embedding and head
    only with ``distribute_embedding``)."""
    params = list(module.parameters())
    if isinstance(module, DistributedTransformerLMHead) and not module.config.distribute_embedding:
        whole = {id(p) for sub in (module.word_embedding, getattr(module, "lm_head", None)) if sub is not None
                 for p in sub.parameters()}
        params = [p for p in params if id(p) not in whole]
    return params


def _substitute(module: torch.nn.Module, path: str, sub: Substitution, kwargs: dict[str, Any], unused: set[str],
                seed: Callable[[], int]) -> torch.nn.Module:
    """``module`` (at ``path``) replaced by ``sub``'s distributed module: with ``module``'s weights when they were
    initialised (:func:`_initialised`), else with SMP's initialisation, drawn from ``seed()`` (the same on every
    rank) in a forked random state (the user's stream is not advanced)."""
    keys = set(inspect.signature(sub.dist_class).parameters) | set(TransformerConfig.__dataclass_fields__)
    taken = {k: v for k, v in kwargs.items() if k in keys}
    unused.update(set(kwargs) - set(taken))
    ref = next(iter(module.parameters()), None)
    with delay_param_initialization(ref is not None and ref.is_meta), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed())
        dist = sub.build(module, taken)
    if ref is not None:
        dist.to(dtype=ref.dtype) if ref.is_meta else dist.to(device=ref.device, dtype=ref.dtype)
    dist.train(module.training)
    if sub.translate is not None:
        st = state.get()
        if sub.translate not in st.translate_functions:
            st.translate_functions.append(sub.translate)
        if ref is not None and not ref.is_meta and _initialised(module, sub):
            _carry_weights(module, dist, path, sub)
    return dist


def _initialised(module: torch.nn.Module, sub: Substitution) -> bool:
    """Whether ``module``'s weights are worth carrying over: a ``transformers`` module's when ``transformers``
    initialised or loaded them (its ``_is_hf_initialized`` bookkeeping; SMP's published GPT-2 recipe skips that
    initialisation, because SMP initialises the distributed module itself); any other module's always."""
    if not sub.name.startswith("huggingface-"):
        return True
    return any(getattr(m, "_is_hf_initialized", False) for m in module.modules())


def _shared_seed(world_group: Any) -> int:
    """Global rank 0's torch seed, on every rank (tp ranks may have seeded their streams apart)."""
    value = [torch.initial_seed()]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(value, src=0, group=world_group)
    return int(value[0]) % 2**63


def _carry_weights(module: torch.nn.Module, dist: torch.nn.Module, path: str, sub: Substitution) -> None:
    """Load ``module``'s weights into ``dist`` through the Hugging Face to SMP translator (keys are translated
    under the module's path in the model, as the translators expect, then made relative again)."""
    assert sub.translate is not None
    translated = sub.translate[1]({path + k: v for k, v in module.state_dict().items()})
    # A tied weight loads through its first name only: SMP ties the head to the embedding as the config says, and
    # a model built with ``init_weights`` skipped (SMP's published recipe) has an untied head whose values would win.
    aliases = {name for name, first in tensor_aliases(dist).items() if name != first}
    own = {k[len(path):]: v for k, v in translated.items() if k.startswith(path) and k[len(path):] not in aliases}
    result = dist.load_state_dict(own, strict=False)
    missing = [k for k in result.missing_keys if k not in aliases]
    if missing or result.unexpected_keys:
        warnings.warn(f"{sub.name}: the weights of {path.rstrip('.') or type(module).__name__} did not translate "
                      f"onto {type(dist).__name__} (missing {missing[:3]}, unexpected "
                      f"{result.unexpected_keys[:3]}); it starts from SMP's initialisation", stacklevel=4)
