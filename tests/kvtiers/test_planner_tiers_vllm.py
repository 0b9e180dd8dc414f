"""The planner sees the KV tiers, on the real in-process vLLM CPU engine: a chunk-prefix the
pool evicted while the RAM tier holds it stays in the CP-Tree (the connector's residency events,
medium CPU), so the next request's plan puts it first and its blocks come from the tier. Its
own engine config (a small pool, the connector), hence its own process."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_flood import flood_until_evicted, make_chunks

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine

def test_a_tier_resident_chunk_prefix_stays_planned_first(model_dir: Path) -> None:
    if rerun_in_own_process(__file__, "test_a_tier_resident_chunk_prefix_stays_planned_first"):
        return
    from craft_rag.engine import CraftEngine, EngineSettings
    from craft_rag.kvtiers import KVTierSettings

    engine = CraftEngine(EngineSettings(
        model=str(model_dir), block_size=32, max_model_len=1024,
        num_gpu_blocks_override=48,  # ~2 prompts: the flood evicts the first from the pool
        kv_cache_memory_bytes=256 << 20, seed=0,
        kv_tiers=KVTierSettings(ram_bytes=256 << 20),  # ~170 blocks: the tier evicts nothing
    ))
    try:
        sync, tree = engine.kv_events, engine.planner.prefix_tree
        assert sync is not None
        chunks = make_chunks(4, repeat=4, prefix="keep")
        keys = tuple(c.key for c in chunks)
        first = engine.generate(chunks, "Which?", max_tokens=1)
        assert first.report.chunk_order == keys
        hashes, dropped = flood_until_evicted(engine, keys)
        assert hashes
        assert dropped, "the flood did not evict the first prompt's blocks"
        assert sync.residency.held > 0  # pool removals the RAM tier made the sync hold back
        assert keys in tree.iter_paths()  # without the tier events the path was dropped

        new = make_chunks(1, repeat=4, prefix="new")
        again = engine.generate(new + chunks[::-1], "Which one?", max_tokens=1)
        report = again.report
        assert report.predicted_chunks == 4
        assert report.chunk_order[:4] == keys  # the tier-resident prefix is put first
        assert report.tier_ram_tokens > 0, report
        # the last chunk's final block also holds "new"'s first tokens: 3 whole chunks cached,
        # but every full block of the 4 was a hit, so the commit keeps all 4 nodes
        assert report.reused_chunks >= 3 and report.cached_tokens >= report.predicted_tokens - 32
        assert keys in tree.iter_paths()
    finally:
        engine.close()
