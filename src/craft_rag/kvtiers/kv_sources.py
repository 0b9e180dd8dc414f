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
Its KV counts as *recomputed*; a chunk-cache source's counts as *fixed*. ``chunk_head_only``
is naive chunk reuse (a chunk's variant computed after the head only, re-rotated to its new
position, nothing recomputed; :mod:`craft_rag.chunkcache`). The built-ins share one model.
Cost of ``hf_prefill``: one forward over ``end`` tokens (the model's own prefill cost, on the
scheduler's thread); the model is loaded once per connector (~3 s, ~0.6 GB for SmolLM2-135M),
with eager attention (:func:`craft_rag.chunkcache.layers.load_model`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

__all__ = [
    "BUILTIN_SOURCES",
    "HFPrefillSource",
    "HeadOnlyChunkSource",
    "KVSource",
    "LayerKV",
    "LazyModel",
    "build_sources",
]

LayerKV = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values, each ``[tokens, kv_heads, head_size]``."""


class KVSource(Protocol):
    """Provides K/V for a span of a prompt. ``counts_as`` is ``"fixed"`` (reused approximate
    KV) or ``"recomputed"`` (computed by the connector); it only feeds the reuse report."""

    counts_as: ClassVar[str]

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None: ...


class LazyModel:
    """One ``transformers`` float32 copy of the served model, loaded on first use and shared by
    the built-in sources (thread-safe; never trained or mutated)."""

    def __init__(self, model_dir: str, loaded: Any = None) -> None:
        self._model_dir = model_dir
        self._model: Any = loaded  # an already loaded copy (tests), else loaded on first use
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._model is None:
                from craft_rag.chunkcache.layers import load_model

                self._model = load_model(self._model_dir)
        return self._model


def _to_rows(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> LayerKV:
    """HF ``[kv_heads, tokens, head]`` per layer -> ``[tokens, kv_heads, head]`` per layer."""
    return ([k.transpose(0, 1).contiguous() for k in keys],
            [v.transpose(0, 1).contiguous() for v in values])


def _check_span(token_ids: Sequence[int], start: int, end: int) -> None:
    if not 0 <= start < end <= len(token_ids):
        msg = f"span [{start}, {end}) outside a prompt of {len(token_ids)} tokens"
        raise ValueError(msg)


class HFPrefillSource:
    """K/V of ``[start, end)`` from the model copy run over ``token_ids[:end]`` (positions from
    0, as vLLM's prefill). ``spec`` must be empty."""

    counts_as: ClassVar[str] = "recomputed"

    def __init__(self, model_dir: str, model: LazyModel | None = None, **_: Any) -> None:
        self._model = model or LazyModel(model_dir)

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None:
        if spec:
            msg = f"hf_prefill takes no span fields; got {sorted(spec)}"
            raise ValueError(msg)
        _check_span(token_ids, start, end)
        from craft_rag.chunkcache.blend import full_prefill

        kv = full_prefill(self._model.get(), token_ids[:end]).slice(start, end)
        return _to_rows(kv.keys, kv.values)


class HeadOnlyChunkSource:
    """Naive chunk reuse, 0% recomputed: the span is a chunk whose cache variant was computed
    after the prompt's head only (``token_ids[:head_end]``, span field ``head_end`` <=
    ``start``), as if cached when the chunk first followed the system prompt, then re-rotated
    from position ``head_end`` to ``start`` (:mod:`craft_rag.chunkcache`). With
    ``head_end == start`` it is exact (a re-rotation by 0); otherwise the chunk has not seen
    the tokens between, which is the approximation chunk-caches make. The variant is computed
    on demand (there is no variant store yet): the measurement path for naive reuse.
    Cost: one forward over ``head_end + end - start`` tokens."""

    counts_as: ClassVar[str] = "fixed"

    def __init__(self, model_dir: str, model: LazyModel | None = None, **_: Any) -> None:
        self._model = model or LazyModel(model_dir)

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None:
        _check_span(token_ids, start, end)
        head_end = spec.get("head_end")
        if (set(spec) != {"head_end"} or isinstance(head_end, bool)
                or not isinstance(head_end, int) or not 0 <= head_end <= start):
            msg = f"chunk_head_only takes one field, head_end, an int in [0, {start}]"
            raise ValueError(msg)
        from craft_rag.chunkcache.blend import full_prefill
        from craft_rag.chunkcache.layers import rope_of

        model = self._model.get()
        ids = list(token_ids[:head_end]) + list(token_ids[start:end])
        kv = full_prefill(model, ids).slice(head_end, len(ids)).moved_to(start, rope_of(model))
        return _to_rows(kv.keys, kv.values)


BUILTIN_SOURCES: Mapping[str, type] = {
    "hf_prefill": HFPrefillSource,
    "chunk_head_only": HeadOnlyChunkSource,
}
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


def build_sources(model_dir: str, extra: Mapping[str, str] | None = None, *,
                  model: LazyModel | None = None) -> dict[str, KVSource]:
    """One instance of every built-in source and of each ``extra`` one (``name ->
    'package.module:Class'``, from the operator's connector config, never from a request),
    each constructed as ``Class(model_dir)``. The built-ins share ``model`` (a new
    :class:`LazyModel` by default). ``ValueError`` for a bad path or a name that shadows a
    built-in. Nothing loads a model until a span asks for it."""
    classes = dict(BUILTIN_SOURCES)
    for name, path in (extra or {}).items():
        if name in classes:
            msg = f"kv source {name!r} shadows a built-in; choose another name"
            raise ValueError(msg)
        classes[name] = _import(path)
    shared = model or LazyModel(model_dir)  # the built-ins share one model copy
    return {name: cls(model_dir, model=shared) if name in BUILTIN_SOURCES else cls(model_dir)
            for name, cls in classes.items()}
