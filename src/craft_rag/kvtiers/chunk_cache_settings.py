"""The chunk-cache switch: how chunks are reused at any position, and the vLLM config that loads it.

Framework-free (no vLLM, no torch). ``EngineSettings.chunk_cache`` holds one; with it set the
engine loads :class:`craft_rag.kvtiers.approx_connector.CraftApproxConnector` (the tier
connector plus chunk-caches) instead of the tier connector, and sends ``chunk`` spans
(:mod:`craft_rag.kvtiers.approx_params`) for RAG requests where the per-chunk plan
(:mod:`craft_rag.engine.chunk_cache_plan`) finds a chunk-cache to reuse, and the chunk list
(``craft_chunks``) of every other RAG request, whose exactly computed chunks the connector keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from craft_rag.kvtiers.approx_params import (
    BLEND_RULES,
    DEFAULT_BLEND_FRACTION,
    DEFAULT_BLEND_RULE,
)
from craft_rag.kvtiers.tier_settings import KVTierSettings

__all__ = ["APPROX_CONNECTOR_MODULE", "APPROX_CONNECTOR_NAME", "ChunkCacheSettings"]

APPROX_CONNECTOR_NAME = "CraftApproxConnector"
APPROX_CONNECTOR_MODULE = "craft_rag.kvtiers.approx_connector"
# blend_source's defaults, repeated so that this module does not import torch
# (tests/kvtiers/test_chunk_cache_settings.py keeps them equal).
DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
DEFAULT_VARIANTS = 2


@dataclass(frozen=True, slots=True)
class ChunkCacheSettings:
    """Chunk-caches fixed by selective recomputation (Cache-Craft / CacheBlend), off by default.

    ``rule``: how the tokens to recompute are ranked, one of
    :data:`~craft_rag.kvtiers.approx_params.BLEND_RULES` (``"kv_deviation"``, the default;
    ``"cci"``; ``"random"``). ``fraction``: the share of every reused chunk recomputed
    (``ceil(fraction x |C|)`` tokens, 0.3 by default: the quality in docs/benchmarks.md
    "Chunk-caches" holds only at >= 30% with ``kv_deviation``); or ``alpha`` (with
    ``fraction=None``) for Cache-Craft's CFO count ``ceil(min(1, alpha x CCI x (1 - beta'))
    x |C|)``. ``cache_bytes``: the connector's in-memory chunk-cache bound (256 MiB);
    ``variants``: variants kept per chunk (2). ``max_chunks``: the engine's record of the chunk
    keys it has sent (per tenant, least recently used dropped first: whether each is in the
    connector's store and whether its last send was exact), which mirrors the store
    approximately (the store is bounded in bytes, the record in entries).
    ``harvest`` (on): every exact RAG request lists its chunks (``craft_chunks``,
    :data:`~craft_rag.kvtiers.approx_params.HARVEST_PARAMS_KEY`) so that the connector keeps
    each chunk lying in the request's full prompt blocks as a chunk-cache variant, read back
    from the exactly computed blocks: the store fills at no extra forward and the request stays
    exact. Harvested variants carry no attention statistics, so harvest takes ``rule``
    ``"kv_deviation"`` or ``"random"`` with a ``fraction``; with ``"cci"`` or ``alpha`` pass
    ``harvest=False``. ``seed_cold`` (off): a request with no predicted exact prefix over its
    chunks and no chunk-cache to reuse is still sent as chunk spans over all its chunks, so they
    enter the store computed in full by the connector's model copy. It costs: that request runs
    under a request-scoped salt, so its blocks are no exact prefix for any later request, and
    its chunks are computed by the connector (about vLLM's cost per token) instead of vLLM;
    with ``harvest`` on, exact requests fill the store without that cost.

    ``ValueError`` (naming the fix) for an unknown rule, a fraction outside [0, 1], both or
    neither of ``fraction`` and ``alpha``, a negative or non-finite alpha, bad sizes, a
    non-bool ``harvest``/``seed_cold``, or ``harvest`` with rule ``"cci"`` or ``alpha``.
    """

    rule: str = DEFAULT_BLEND_RULE
    fraction: float | None = DEFAULT_BLEND_FRACTION
    alpha: float | None = None
    cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES
    variants: int = DEFAULT_VARIANTS
    max_chunks: int = 65536
    seed_cold: bool = False
    harvest: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.rule, str) or self.rule not in BLEND_RULES:
            msg = f"unknown chunk-cache rule {self.rule!r}; valid: {', '.join(BLEND_RULES)}"
            raise ValueError(msg)
        if (self.fraction is None) == (self.alpha is None):
            msg = "give fraction (share recomputed, e.g. 0.3) or alpha (Cache-Craft CFO), not both"
            raise ValueError(msg)
        for name, upper in (("fraction", 1.0), ("alpha", math.inf)):
            value = getattr(self, name)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or not 0 <= value <= upper):
                bound = "in [0, 1] (0.3: 30% of each reused chunk recomputed)" if upper == 1.0 \
                    else ">= 0 and finite"
                msg = f"chunk-cache {name} must be a number {bound}; got {value!r}"
                raise ValueError(msg)
        for name, minimum in (("cache_bytes", 0), ("variants", 1), ("max_chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                msg = f"chunk-cache {name} must be an integer >= {minimum}; got {value!r}"
                raise ValueError(msg)
        for name in ("seed_cold", "harvest"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                msg = f"{name} must be true or false; got {value!r}"
                raise ValueError(msg)
        if self.harvest and (self.rule == "cci" or self.alpha is not None):
            used = "rule 'cci'" if self.rule == "cci" else "alpha"
            msg = (f"harvest cannot be used with {used}: harvested chunk-caches carry no "
                   "attention statistics; pass harvest=False, or use rule 'kv_deviation' or "
                   "'random' with a fraction")
            raise ValueError(msg)

    def blend(self) -> dict[str, Any]:
        """The ``blend`` field of a ``craft_approx`` request
        (:func:`~craft_rag.kvtiers.approx_params.parse_blend` reads it back)."""
        if self.alpha is not None:
            return {"rule": self.rule, "alpha": float(self.alpha)}
        assert self.fraction is not None
        return {"rule": self.rule, "fraction": float(self.fraction)}

    def transfer_config(self, tiers: KVTierSettings | None) -> dict[str, Any]:
        """Keyword arguments of ``vllm.config.KVTransferConfig`` loading the approximate
        connector over ``tiers`` (default :class:`KVTierSettings` when ``None``: a
        request-scoped request's exact prefix can come only from the tiers)."""
        tiers = tiers if tiers is not None else KVTierSettings()
        extra = {**tiers.extra_config(), "chunk_cache_bytes": self.cache_bytes,
                 "chunk_cache_variants": self.variants}
        return {
            "kv_connector": APPROX_CONNECTOR_NAME,
            "kv_connector_module_path": APPROX_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
