"""KV sources for the approximate-KV connector tests, loaded by the connector from its
``kv_sources`` setting (``"approx_sources:NoisySource"``; this folder is on ``sys.path`` under
pytest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from craft_rag.kvtiers.kv_sources import HFPrefillSource, LayerKV


class NoisySource:
    """``hf_prefill``'s K/V plus seeded Gaussian noise of ``scale`` times each tensor's std
    (span field ``scale``, default 1.0): deliberately wrong KV that still has the right shape.
    Counts as fixed (it stands for a stale chunk-cache)."""

    counts_as: ClassVar[str] = "fixed"

    def __init__(self, model_dir: str, **_: Any) -> None:
        self._exact = HFPrefillSource(model_dir)

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None:
        scale = float(spec.get("scale", 1.0))
        kv = self._exact.kv(token_ids, start, end, {})
        assert kv is not None
        gen = torch.Generator().manual_seed(start * 7919 + end)
        keys, values = kv
        return (
            [k + scale * k.std() * torch.randn(k.shape, generator=gen) for k in keys],
            [v + scale * v.std() * torch.randn(v.shape, generator=gen) for v in values],
        )


class MissingSource:
    """A chunk-cache source whose variant is never there (a missing or corrupt variant)."""

    counts_as: ClassVar[str] = "fixed"

    def __init__(self, model_dir: str, **_: Any) -> None:
        pass

    def kv(
        self, token_ids: Sequence[int], start: int, end: int, spec: Mapping[str, Any]
    ) -> LayerKV | None:
        return None
