"""Server backend against an in-process fake of vLLM's HTTP API (fast; fakes for unit tests
only: the real server runs in test_real_server.py). What this covers that the real server
cannot cheaply: scripted 5xx answers, dropped streams, missing endpoints, KV event gaps."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import CHATML, FORMAT, FakeServer, chunks, running

from craft_rag.engine.backends.server.backend import (
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
    parse_cache_config,
)
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.tokenizer import HashingTokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


def make_engine(url: str, model_dir: Path, **server: Any) -> CraftEngine:
    server.setdefault("kv_events", False)
    server.setdefault("backoff", 0.01)
    return CraftEngine(
        EngineSettings(model=model_dir),
        CraftPlanner(PlannerConfig(policy="tree")),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        server=ServerSettings(url, **server),
    )


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


@pytest.fixture
def served(fake: FakeServer, model_dir: Path) -> Iterator[tuple[CraftEngine, FakeServer]]:
    with running(fake) as url:
        engine = make_engine(url, model_dir)
        try:
            yield engine, fake
        finally:
            engine.close()


# ---- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://", "http://h:99999", "http://h:80/v1/x"],
)
def test_bad_url_is_a_value_error_naming_the_form(url: str) -> None:
    with pytest.raises(ValueError, match="server"):
        ServerSettings(url)


def test_kv_events_port_rule() -> None:
    assert ServerSettings("http://127.0.0.1:8000").kv_events_endpoint == "tcp://127.0.0.1:9000"
    assert ServerSettings("http://h:8000", kv_events=5555).kv_events_endpoint == "tcp://h:5555"
    assert ServerSettings("http://h:8000", kv_events=False).kv_events_endpoint is None
    assert ServerSettings("http://h:80/v1").base_url == "http://h:80"
    with pytest.raises(ValueError, match="tcp://"):
        ServerSettings("http://h:8000", kv_events="ipc:///tmp/x")
    with pytest.raises(ValueError, match="kv_events=PORT"):
        _ = ServerSettings("http://h:65000").kv_events_endpoint


def test_parse_cache_config() -> None:
    text = '# HELP x\nvllm:cache_config_info{block_size="32",enable_prefix_caching="True"} 1.0\n'
    assert parse_cache_config(text) == {"block_size": "32", "enable_prefix_caching": "True"}
    assert parse_cache_config("nothing") == {}


# ---- requests ----------------------------------------------------------------------------------


def test_reordered_chunks_reuse_and_report_the_servers_cached_tokens(
    served: tuple[CraftEngine, FakeServer],
) -> None:
    engine, fake = served
    assert engine.block_size == 4 and engine.max_model_len == 512
    first = engine.generate(chunks(), "what is w1x3?", max_tokens=3)
    assert first.report.cached_tokens == 0 and len(first.token_ids) == 3
    second = engine.generate(list(reversed(chunks())), "what is w2x4?", max_tokens=3)
    body = fake.bodies[-1]
    assert body["prompt"] == list(second.prompt_token_ids)  # token-exact, as token ids
    assert body["stream"] is True and body["return_token_ids"] is True
    # CRAFT served the cached order: everything up to the question came from the cache.
    assert second.report.chunk_order == first.report.chunk_order
    assert second.report.cached_tokens == fake.reported[-1] > 0
    assert second.report.cached_tokens >= second.report.prefix_tokens + 4 * 10
    assert second.report.reused_chunks == 4


def test_stream_and_astream_match_generate(served: tuple[CraftEngine, FakeServer]) -> None:
    engine, _ = served
    ids = list(range(10, 40))
    whole = engine.generate_tokens(ids, max_tokens=4)
    pieces = list(engine.stream_tokens(ids, max_tokens=4))
    assert pieces[-1].finished and pieces[-1].result is not None
    assert "".join(p.text for p in pieces) == whole.text
    assert pieces[-1].result.report.ttft_ms <= pieces[-1].result.report.latency_ms
    assert pieces[-1].result.report.cached_tokens == 28  # 7 whole blocks; the last token recomputed

    async def collect() -> str:
        return "".join([p.text async for p in engine.astream_tokens(ids, max_tokens=4)])

    assert asyncio.run(collect()) == whole.text


def test_cache_salt_goes_in_the_body_and_isolates(served: tuple[CraftEngine, FakeServer]) -> None:
    engine, fake = served
    ids = list(range(100, 140))
    assert engine.generate_tokens(ids, max_tokens=1, cache_salt="tenant-a").report.salted
    assert fake.bodies[-1]["cache_salt"] == "tenant-a"
    again_b = engine.generate_tokens(ids, max_tokens=1, cache_salt="tenant-b")
    assert again_b.report.cached_tokens == 0
    again_a = engine.generate_tokens(ids, max_tokens=1, cache_salt="tenant-a")
    assert again_a.report.cached_tokens > 0
    nocache = engine.generate_tokens(
        ids, max_tokens=1, cache_salt="tenant-a", read_prefix_cache=False
    )
    assert nocache.report.cached_tokens == 0
    assert fake.bodies[-1]["cache_salt"].startswith("nocache-")


@pytest.mark.parametrize("salt", ["", "a/b", "x" * 200, 7])
def test_bad_cache_salt_is_refused_before_any_request(
    served: tuple[CraftEngine, FakeServer], salt: Any
) -> None:
    engine, fake = served
    sent = len(fake.bodies)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate(chunks(), "q?", max_tokens=1, cache_salt=salt)
    assert len(fake.bodies) == sent


def test_5xx_is_retried_then_succeeds(served: tuple[CraftEngine, FakeServer]) -> None:
    engine, fake = served
    fake.fail_next = [503, 500]
    assert len(engine.generate_tokens(list(range(20)), max_tokens=2).token_ids) == 2
    assert fake.fail_next == []


def test_5xx_past_the_retries_is_a_server_error_and_nothing_committed(
    served: tuple[CraftEngine, FakeServer],
) -> None:
    engine, fake = served
    fake.fail_next = [503] * 3  # retries=2: three attempts
    with pytest.raises(ServerError, match="3 attempts"):
        engine.generate(chunks(), "q?", max_tokens=1, conversation_id="c1")
    assert len(engine.planner.prefix_tree) == 0  # type: ignore[attr-defined]
    # The failed turn left no conversation behind: the next one is turn 1 again.
    assert engine.generate(chunks(), "q?", max_tokens=1, conversation_id="c1").report.turn == 1


def test_4xx_is_a_value_error_with_the_servers_message(
    served: tuple[CraftEngine, FakeServer],
) -> None:
    engine, fake = served
    fake.fail_next = [400]
    with pytest.raises(ServerRejected, match=r"HTTP 400.*scripted 400"):
        engine.generate_tokens(list(range(20)), max_tokens=1)
    assert isinstance(ServerRejected("x"), ValueError)


def test_dropped_stream_is_unavailable_clears_the_tree_and_recovers(
    served: tuple[CraftEngine, FakeServer],
) -> None:
    engine, fake = served
    engine.generate(chunks(), "q?", max_tokens=2)
    tree = engine.planner.prefix_tree  # type: ignore[attr-defined]
    assert len(tree) > 0
    fake.drop_after = 1
    with pytest.raises(ServerUnavailable, match="without \\[DONE\\]"):
        engine.generate(chunks(), "q again?", max_tokens=3)
    assert len(tree) == 0  # the server may have restarted: resync by clearing
    fake.drop_after = None
    assert engine.generate(chunks(), "q?", max_tokens=2).report.cached_tokens > 0


def test_unreachable_server_fails_fast_naming_the_url_and_fix(model_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=f"{url}.*craft-rag serve"):
        make_engine(url, model_dir)
    assert time.monotonic() - start < 5.0
    assert issubclass(ServerUnavailable, ConnectionError)


def test_server_without_cached_token_reports_is_refused(model_dir: Path) -> None:
    fake = FakeServer(report_cached=False)
    with running(fake) as url, pytest.raises(RuntimeError, match="--enable-prompt-tokens"):
        make_engine(url, model_dir)


def test_tokenizer_mismatch_is_refused(model_dir: Path) -> None:
    class Other(HashingTokenizer):
        def encode(self, text: str) -> list[int]:
            return [t + 1 for t in super().encode(text)]

    with running(FakeServer()) as url, pytest.raises(ValueError, match="tokenizer"):
        CraftEngine(
            EngineSettings(model=model_dir),
            tokenizer=Other(),
            prompt_format=FORMAT,
            server=ServerSettings(url, kv_events=False),
        )


def test_unknown_model_name_is_refused(model_dir: Path) -> None:
    with running(FakeServer()) as url, pytest.raises(ValueError, match="fake-model"):
        make_engine(url, model_dir, model_name="other")


def test_reset_prefix_cache(served: tuple[CraftEngine, FakeServer], model_dir: Path) -> None:
    engine, fake = served
    ids = list(range(50, 80))
    engine.generate_tokens(ids, max_tokens=1)
    assert engine.reset_prefix_cache()
    assert engine.generate_tokens(ids, max_tokens=1).report.cached_tokens == 0
    engine.generate_tokens(ids, max_tokens=1)
    fake.reset_success = False  # vLLM's {"success": false}: nothing was reset
    assert not engine.reset_prefix_cache()
    assert engine.generate_tokens(ids, max_tokens=1).report.cached_tokens > 0
    fake.reset_success = True
    fake.reset_endpoint = False
    with pytest.raises(RuntimeError, match="craft-rag serve --dev"):
        engine.reset_prefix_cache()


def test_closing_a_stream_early_commits_nothing(served: tuple[CraftEngine, FakeServer]) -> None:
    engine, _ = served
    pieces = engine.stream(chunks(), "q?", max_tokens=5)
    next(pieces)
    pieces.close()
    assert len(engine.planner.prefix_tree) == 0  # type: ignore[attr-defined]


def test_messages_are_rendered_locally_and_sent_as_ids(
    served: tuple[CraftEngine, FakeServer],
) -> None:
    engine, fake = served
    messages = [("user", "hello there"), ("assistant", "hi"), ("user", "how are you?")]
    result = engine.generate_messages(messages, max_tokens=2)
    assert fake.bodies[-1]["prompt"] == list(engine.message_token_ids(messages))
    assert result.report.prompt_tokens == len(fake.bodies[-1]["prompt"])


# ---- KV events over tcp (int hashes, gaps, restarts) -------------------------------------------


@pytest.fixture
def with_events(
    fake: FakeServer, model_dir: Path
) -> Iterator[tuple[CraftEngine, Any, Callable[[int, list[dict[str, Any]]], None]]]:
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")  # the server binds tcp://*:PORT

    def publish(seq: int, events: list[dict[str, Any]]) -> None:
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), msgpack.packb([time.time(), events])))

    with running(fake) as url:
        engine = make_engine(url, model_dir, kv_events=port)
        sync = engine.kv_events
        assert sync is not None and sync.endpoint == f"tcp://127.0.0.1:{port}"
        # PUB drops messages until the subscription arrives: probe until one gets through.
        deadline = time.monotonic() + 10
        while sync.stats.batches == 0 and time.monotonic() < deadline:
            publish(0, [])
            time.sleep(0.05)
        assert sync.stats.batches >= 1
        try:
            yield engine, sync, publish
        finally:
            engine.close()
            pub.close(linger=0)
            ctx.term()


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_int_block_hashes_from_the_server_reach_the_cp_tree(
    with_events: tuple[CraftEngine, Any, Callable[[int, list[dict[str, Any]]], None]],
) -> None:
    engine, sync, publish = with_events
    result = engine.generate(chunks(), "q?", max_tokens=1)
    hasher = engine.block_hasher
    assert hasher is not None and hasher.int_hashes
    raw = hasher.raw_hashes(result.prompt_token_ids)
    as_ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in raw]
    tree = engine.planner.prefix_tree  # type: ignore[attr-defined]
    assert len(tree) == 4
    first = list(result.prompt_token_ids[: hasher.block_size])
    stored = {
        "type": "BlockStored",
        "block_hashes": as_ints[:1],
        "parent_block_hash": None,
        "token_ids": first,
        "block_size": hasher.block_size,
    }
    publish(1, [stored])
    # The prompt's blocks evicted (as ints, as the server sends them): the chunk nodes go.
    publish(2, [{"type": "BlockRemoved", "block_hashes": as_ints}])
    assert _wait(lambda: sync.stats.nodes_removed >= 1)
    assert len(tree) == 0
    assert sync.stats.hash_checks == 1 and sync.stats.hash_mismatches == 0


def test_sequence_gap_and_restart_clear_the_cp_tree(
    with_events: tuple[CraftEngine, Any, Callable[[int, list[dict[str, Any]]], None]],
) -> None:
    engine, sync, publish = with_events
    tree = engine.planner.prefix_tree  # type: ignore[attr-defined]
    engine.generate(chunks(), "q?", max_tokens=1)
    assert len(tree) > 0
    publish(1, [])
    publish(5, [])  # batches 2-4 lost: evictions we never heard
    assert _wait(lambda: sync.stats.gaps == 1)
    assert len(tree) == 0
    engine.generate(chunks(), "q?", max_tokens=1)
    assert len(tree) > 0
    publish(0, [])  # the server restarted: its sequence starts over, its cache is empty
    assert _wait(lambda: sync.stats.restarts == 1)
    assert len(tree) == 0
    publish(1, [{"type": "AllBlocksCleared"}])
    assert _wait(lambda: sync.stats.clears == 1) and sync.stats.gaps == 1
