"""State-dict translation between Hugging Face models and SMP v1's distributed modules, as tables of rules.

A :class:`Rule` pairs one Hugging Face key pattern with one SMP key pattern: ``{i}`` is a layer index, ``{p}``
the parameter (``weight``/``bias``), ``{qkv}`` one of ``query``/``key``/``value``, and ``{last}`` on the SMP side
the last layer's index (GPT-2's final layer norm lives in SMP's last layer). Whatever precedes the pattern
(``bert.``, a user's wrapper module) is kept on both sides. A rule's ``kind`` says how the tensor changes:
``same``; ``conv1d`` (GPT-2's ``Conv1D`` keeps its weight as ``[in, out]``, SMP's ``nn.Linear`` as ``[out,
in]``: transposed); ``fused`` (GPT-2's one ``c_attn`` projection is SMP's ``query``, ``key`` and ``value``:
split into thirds, or concatenated back, and transposed). :func:`to_smp` and :func:`to_hf` apply a table
both ways; keys no rule matches (heads, poolers, BERT's embeddings) pass unchanged, and the causal-mask
buffers of old Hugging Face checkpoints (``attn.bias``, ``attn.masked_bias``) are dropped on the way in.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Rule", "to_smp", "to_hf"]

_TOKENS = {"{i}": r"(?P<i>\d+)", "{p}": r"(?P<p>weight|bias)", "{qkv}": r"(?P<qkv>query|key|value)",
           "{last}": r"(?P<last>\d+)"}
_MASK_BUFFER = re.compile(r"(^|\.)attn(\.attention)?\.(bias|masked_bias)$")


def _regex(pattern: str) -> re.Pattern[str]:
    out = re.escape(pattern)
    for token, group in _TOKENS.items():
        out = out.replace(re.escape(token), group)
    return re.compile(r"(?P<pre>(?:.+\.)?)" + out + "$")


@dataclass(frozen=True)
class Rule:
    """One key of a Hugging Face model and its SMP counterpart (see the module docstring)."""

    hf: str
    smp: str
    kind: str = "same"

    def fill(self, side: str, groups: dict[str, str]) -> str:
        """The key of ``side`` (``"hf"`` or ``"smp"``) with the placeholders set from ``groups``."""
        key = getattr(self, side)
        for name in ("i", "p", "qkv", "last"):
            if name in groups:
                key = key.replace("{" + name + "}", groups[name])
        return groups["pre"] + key


def _last_layer(state_dict: dict[str, Any], rules: list[Rule]) -> str:
    found = [int(m["i"]) for k in state_dict for r in rules if "{i}" in r.hf and (m := _regex(r.hf).match(k))]
    return str(max(found)) if found else "0"


def to_smp(state_dict: dict[str, Any], rules: list[Rule]) -> dict[str, Any]:
    """``state_dict`` of a Hugging Face model with SMP's keys and layouts for the parts ``rules`` cover."""
    last = _last_layer(state_dict, rules)
    compiled = [(r, _regex(r.hf.replace("{last}", last))) for r in rules]
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        hit = next(((r, m) for r, m in ((r, rx.match(key)) for r, rx in compiled) if m), None)
        if hit is None:
            if not _MASK_BUFFER.search(key):
                out[key] = value
            continue
        rule, m = hit
        groups = {k: v for k, v in m.groupdict().items() if v is not None} | {"last": last}
        if rule.kind == "fused":
            parts = value.chunk(3, dim=-1)
            for name, part in zip(("query", "key", "value"), parts):
                out[rule.fill("smp", groups | {"qkv": name})] = part.t().contiguous() if value.dim() == 2 \
                    else part.clone()
        else:
            weight = rule.kind == "conv1d" and groups.get("p") == "weight"
            out[rule.fill("smp", groups)] = value.t().contiguous() if weight else value
    return out


def to_hf(state_dict: dict[str, Any], rules: list[Rule]) -> dict[str, Any]:
    """The inverse of :func:`to_smp`: SMP's keys and layouts back to the Hugging Face model's."""
    compiled = [(r, _regex(r.smp)) for r in rules]
    out: dict[str, Any] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        hit = next(((r, m) for r, m in ((r, rx.match(key)) for r, rx in compiled) if m), None)
        if hit is None:
            out[key] = value
            continue
        rule, m = hit
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        target = rule.fill("hf", groups)
        if rule.kind == "fused":
            fused.setdefault(target, {})[groups["qkv"]] = value
            out.setdefault(target, None)  # keeps the model's key order
        else:
            weight = rule.kind == "conv1d" and groups.get("p") == "weight"
            out[target] = value.t().contiguous() if weight else value
    for target, parts in fused.items():
        missing = {"query", "key", "value"} - set(parts)
        if missing:
            raise KeyError(f"{target}: the state dict has no {sorted(missing)} to fuse with the others")
        tensors = [parts[n] for n in ("query", "key", "value")]
        out[target] = torch.cat([t.t() for t in tensors], dim=1).contiguous() if tensors[0].dim() == 2 \
            else torch.cat(tensors)
    return out
