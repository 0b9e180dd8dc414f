"""Chunk-caches switched on in the engine (EngineSettings.chunk_cache, defaults), on the real
in-process vLLM CPU engine: a cold request is served exactly and its chunks are read back from
its blocks; a request with one of them at another position plus a new chunk is served from the
chunk-cache (approximate, fixed tokens, counts adding up to the prompt) with vLLM computing the
new chunk; the first request's exact prefix stays exact; a plain request gets no exact hit from
approximate blocks. Its own engine config (the approximate connector), hence its own process."""

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
        chunk_cache=ChunkCacheSettings(),  # defaults: kv_deviation, 30%, harvest, no seeding
    ))
    # questions longer than a block, so that every chunk ends inside a full prompt block
    q1 = ("Who won two Nobel prizes, in which two sciences, in which city did she work, and "
          "what else do the passages above say about rivers and cities? Answer briefly.")
    q2 = ("Where does the Elbe flow, which cities does it pass on its way to the sea, and who "
          "had the castle of Neuschwanstein built in Bavaria? Answer briefly.")
    try:
        a, b, c = (
            make_chunk(text, id=name)
            for name, text in (
                ("A", "The river Elbe flows through Dresden and Hamburg into the North Sea. " * 2),
                ("B", "Marie Curie won Nobel prizes in physics and in chemistry, in Paris. " * 2),
                ("C", "The castle of Neuschwanstein was built for King Ludwig II of Bavaria. " * 2),
            )
        )
        # cold: served exactly (no chunk spans), its chunks listed for read-back
        first = engine.generate([a, b], q1, max_tokens=8)
        r1 = first.report
        assert not r1.approximate and r1.fixed_tokens == 0, r1
        assert r1.chunk_cache_refused is None, r1.chunk_cache_refused
        plain1 = engine.generate_tokens(first.prompt_token_ids, max_tokens=8)
        assert plain1.report.cached_tokens > 0  # its exact blocks serve later requests
        assert plain1.token_ids == first.token_ids

        # B was seen after A: no exact prefix for it here, but a chunk-cache read back from
        # request 1's blocks. Spans over B only (fixed, 30% recomputed); vLLM computes C.
        second = engine.generate([b, c], q2, max_tokens=8)
        r2 = second.report
        assert r2.chunk_cache_refused is None, r2.chunk_cache_refused
        assert r2.approximate and r2.fixed_tokens > 0, r2
        assert 0 < r2.recomputed_tokens < r2.fixed_tokens, r2  # found, not computed in full
        assert r2.exact_reused_tokens is not None and r2.computed_tokens is not None
        assert (r2.exact_reused_tokens + r2.fixed_tokens + r2.recomputed_tokens
                + r2.computed_tokens) == r2.prompt_tokens
        assert r2.reused_chunks == 0  # only exact reuse counts as reused chunks

        # request 1's exact prefix is still trusted after the span request: exact again
        again = engine.generate([a, b], q1, max_tokens=8)
        assert not again.report.approximate and again.report.reused_chunks == 2, again.report
        assert again.token_ids == first.token_ids

        # A plain request of prompt 2 hits only what exact requests left, never request 2's
        # approximate blocks (request-scoped).
        plain2 = engine.generate_tokens(second.prompt_token_ids, max_tokens=8)
        shared = common_prefix(first.prompt_token_ids, second.prompt_token_ids)
        assert plain2.report.cached_tokens <= shared, (plain2.report, shared)
        assert not plain2.report.approximate
    finally:
        engine.close()
    print(f"chunk-cache engine test: {time.monotonic() - t0:.1f} s", file=sys.stderr)
