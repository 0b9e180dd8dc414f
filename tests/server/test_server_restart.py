"""The real server stopped and started again mid-session (runs last: its file sorts last).
Costs one more server start-up (~70-120 s)."""

from __future__ import annotations

import time

import pytest

from conftest import ServerHandle
from craft_rag.chunk import make_chunk
from craft_rag.engine import CraftEngine, ServerUnavailable

pytestmark = pytest.mark.server


def test_server_restart_clears_the_tree_and_requests_go_on(
    vllm_server_handle: ServerHandle,
) -> None:
    engine = CraftEngine(server=vllm_server_handle.url)
    try:
        chunks = [
            make_chunk(f"Restart passage {i}: " + "the valley river turns west. " * 12, id=f"r{i}")
            for i in range(3)
        ]
        engine.generate(chunks, "Where does the river turn?", max_tokens=1)
        tree = engine.planner.prefix_tree  # type: ignore[attr-defined]
        assert len(tree) == 3

        vllm_server_handle.stop()
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="craft-rag serve"):
            engine.generate(chunks, "Where does the river turn?", max_tokens=1)
        assert time.monotonic() - start < 10
        assert len(tree) == 0  # the restarted server's cache will be empty: resync by clearing

        vllm_server_handle.start()
        cold = engine.generate(chunks[::-1], "Where does the river turn?", max_tokens=1)
        assert cold.report.cached_tokens == 0 and cold.report.predicted_chunks == 0
        warm = engine.generate(chunks, "Which passage is first?", max_tokens=1)
        assert warm.report.chunk_order == cold.report.chunk_order
        assert warm.report.cached_tokens >= (warm.report.predicted_tokens or 0) // 32 * 32 > 0
    finally:
        engine.close()
