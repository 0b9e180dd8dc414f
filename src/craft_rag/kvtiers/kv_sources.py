"""Where approximate KV comes from: sources the approximate-KV connector asks for a span's K/V.

A source turns ``(prompt token ids, [start, end), the span's own fields)`` into per-layer
post-RoPE K and V, each ``[end - start, kv_heads, head_size]`` in float32, or ``None`` when
it cannot (a missing or corrupt chunk-cache variant): the connector then computes the tokens
normally. Sources are looked up by name in a registry (:data:`BUILTIN_SOURCES` plus the
connector's ``kv_sources`` setting, ``{"name": "package.module:Class"}``, for sources that live
outside this package, as vLLM loads connectors by module path).

Built in: ``hf_prefill`` runs a separate copy of the served model in Hugging Face
``transformers`` (float32, loaded lazily from the served model's folder) over the prompt up to
``end`` and returns positions ``[start, end)``. It is exact up to the numerics of a second
implementation, so it measures whether KV computed outside vLLM can stand in for vLLM's own,
and it is the connector's way to compute tokens vLLM cannot (any span that is not a suffix).
Its KV counts as *recomputed*; a chunk-cache source's counts as *fixed*.
Cost of ``hf_prefill``: one forward over ``end`` tokens (the model's own prefill cost, on the
scheduler's thread); the model is loaded once per connector (~3 s, ~0.6 GB for SmolLM2-135M).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

__all__ = ["BUILTIN_SOURCES", "HFPrefillSource", "KVSource", "LayerKV", "build_sources"]

LayerKV = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values, each ``[tokens, kv_heads, head_size]``."""


class KVSource(Protocol):
    """Provides K/V for a span of a prompt. ``counts_as`` is ``"fixed"`` (reused approximate
    KV) or ``"recomputed"`` (computed by the connector); it only feeds the reuse report."""

    counts_as: ClassVar[str]

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None: ...


class HFPrefillSource:
    """K/V of ``[start, end)`` from a ``transformers`` copy of the model run over
    ``token_ids[:end]`` (positions from 0, as vLLM's prefill). ``spec`` must be empty.
    Thread-safe lazy load; the model is never trained or mutated."""

    counts_as: ClassVar[str] = "recomputed"

    def __init__(self, model_dir: str, **_: Any) -> None:
        self._model_dir = model_dir
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32)
                model.requires_grad_(False)
                model.train(False)
                self._model = model
        return self._model

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None:
        if spec:
            msg = f"hf_prefill takes no span fields; got {sorted(spec)}"
            raise ValueError(msg)
        if not 0 <= start < end <= len(token_ids):
            msg = f"span [{start}, {end}) outside a prompt of {len(token_ids)} tokens"
            raise ValueError(msg)
        model = self._load()
        with torch.inference_mode():
            out = model(torch.tensor([list(token_ids[:end])]), use_cache=True)
        keys = [layer.keys[0, :, start:end].transpose(0, 1).contiguous()
                for layer in out.past_key_values.layers]
        values = [layer.values[0, :, start:end].transpose(0, 1).contiguous()
                  for layer in out.past_key_values.layers]
        return keys, values


BUILTIN_SOURCES: Mapping[str, type] = {"hf_prefill": HFPrefillSource}
"""Sources every connector knows, by the name a span's ``source`` field uses."""


def _import(path: str) -> type:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        msg = f"kv source {path!r} must be 'package.module:Class'"
        raise ValueError(msg)
    obj = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(obj, type):
        msg = f"kv source {path!r}: no class {attr} in {module_name}"
        raise ValueError(msg)
    return obj


def build_sources(model_dir: str, extra: Mapping[str, str] | None = None) -> dict[str, KVSource]:
    """One instance of every built-in source and of each ``extra`` one (``name ->
    'package.module:Class'``, from the operator's connector config, never from a request),
    each constructed as ``Class(model_dir)``. ``ValueError`` for a bad path or a name that
    shadows a built-in. Nothing loads a model until a span asks for it."""
    classes = dict(BUILTIN_SOURCES)
    for name, path in (extra or {}).items():
        if name in classes:
            msg = f"kv source {name!r} shadows a built-in; choose another name"
            raise ValueError(msg)
        classes[name] = _import(path)
    return {name: cls(model_dir) for name, cls in classes.items()}
