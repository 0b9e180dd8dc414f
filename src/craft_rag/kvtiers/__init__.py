"""Tiered KV block storage (host RAM + local disk) for a vLLM KV connector.

Framework-free: nothing here imports vLLM or torch. ``keys`` names blocks, ``policies`` ranks
them (LRU, RAGCache's PGDSF), ``cost_model`` prices them, ``disk_tier`` owns the files and
``store`` ties them together behind :class:`TieredBlockStore`.
"""

from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings
from craft_rag.kvtiers.cost_model import DEFAULT_CPU_PROFILE, PrefillCostModel, default_cost_model
from craft_rag.kvtiers.keys import BlockKey, chain_keys
from craft_rag.kvtiers.policies import (
    TIER_POLICIES,
    LRUPolicy,
    PGDSFPolicy,
    TierPolicy,
    get_tier_policy,
)
from craft_rag.kvtiers.store import TieredBlockStore
from craft_rag.kvtiers.tier_settings import KVTierSettings
from craft_rag.kvtiers.tier_types import Tier, TierStats

# The connector (connector.py) and the layout adapter (layout_cpu.py) import vLLM and torch:
# vLLM loads the connector by its module path, so they are not imported here.

__all__ = [
    "DEFAULT_CPU_PROFILE",
    "TIER_POLICIES",
    "BlockKey",
    "ChunkCacheSettings",
    "KVTierSettings",
    "LRUPolicy",
    "PGDSFPolicy",
    "PrefillCostModel",
    "Tier",
    "TierPolicy",
    "TierStats",
    "TieredBlockStore",
    "chain_keys",
    "default_cost_model",
    "get_tier_policy",
]
