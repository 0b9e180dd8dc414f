"""Chunk-caches switched on in the engine (EngineSettings.chunk_cache), on the real in-process
vLLM CPU engine: a cold request is seeded as chunk spans and answers as vLLM does alone; a
request with the same chunks reordered plus a new one is served from chunk-caches
(approximate, fixed tokens, counts adding up to the prompt); plain requests of both prompts
get no exact hit from their blocks. Its own engine config (the approximate connector), hence
its own process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_engine_serves_reordered_chunks_from_chunk_caches(model_dir: Path) -> None:
    if rerun_in_own_process(__file__, "test_engine_serves_reordered_chunks_from_chunk_caches"):
        return
    from craft_rag.chunk import make_chunk
    from craft_rag.engine import ChunkCacheSettings, CraftEngine, EngineSettings
    from craft_rag.kvtiers import KVTierSettings

    t0 = time.monotonic()
    engine = CraftEngine(EngineSettings(
        model=str(model_dir), block_size=32, max_model_len=1024,
        kv_cache_memory_bytes=256 << 20, seed=0,
        kv_tiers=KVTierSettings(ram_bytes=64 << 20),
        # seed_cold (off by default since plan v2): the cold request goes out as chunk spans,
        # which this test's first half checks; harvest is left at its default.
        chunk_cache=ChunkCacheSettings(rule="kv_deviation", fraction=0.3, seed_cold=True),
    ))
    try:
        a, b, c = (
            make_chunk(text, id=name)
            for name, text in (
                ("A", "The river Elbe flows through Dresden and Hamburg into the North Sea. " * 2),
                ("B", "Marie Curie won Nobel prizes in physics and in chemistry, in Paris. " * 2),
                ("C", "The castle of Neuschwanstein was built for King Ludwig II of Bavaria. " * 2),
            )
        )
        first = engine.generate([a, b], "Who won two Nobel prizes?", max_tokens=8)
        r1 = first.report
        assert not r1.approximate and r1.fixed_tokens == 0, r1  # nothing cached yet: seeded
        assert r1.chunk_cache_refused is None, r1.chunk_cache_refused
        assert r1.exact_reused_tokens is not None and r1.computed_tokens is not None
        assert (r1.exact_reused_tokens + r1.fixed_tokens + r1.recomputed_tokens
                + r1.computed_tokens) == r1.prompt_tokens
        assert r1.recomputed_tokens > 0  # the connector computed the new chunks (and stored them)

        second = engine.generate([b, a, c], "Where does the Elbe flow?", max_tokens=8)
        r2 = second.report
        assert r2.chunk_cache_refused is None, r2.chunk_cache_refused
        assert r2.approximate and r2.fixed_tokens > 0, r2
        assert r2.exact_reused_tokens is not None and r2.computed_tokens is not None
        assert (r2.exact_reused_tokens + r2.fixed_tokens + r2.recomputed_tokens
                + r2.computed_tokens) == r2.prompt_tokens
        assert r2.reused_chunks == 0  # only exact reuse counts as reused chunks

        # Plain requests (no chunk spans: token prompts) of both prompts. The first computes
        # request 1's prompt from scratch: the seeded request's blocks were request-scoped.
        plain1 = engine.generate_tokens(first.prompt_token_ids, max_tokens=8)
        assert plain1.report.cached_tokens == 0 and plain1.report.exact_reused_tokens is None
        assert plain1.token_ids == first.token_ids  # computed in full: vLLM's own answer
        # The second can hit only what plain1 left in the pool, never request 2's blocks.
        plain2 = engine.generate_tokens(second.prompt_token_ids, max_tokens=8)
        shared = common_prefix(first.prompt_token_ids, second.prompt_token_ids)
        assert plain2.report.cached_tokens <= shared, (plain2.report, shared)
        assert not plain2.report.approximate
    finally:
        engine.close()
    print(f"chunk-cache engine test: {time.monotonic() - t0:.1f} s", file=sys.stderr)
