"""Several app workers sharing one routing state: ``CraftEngine(server=[url, url],
store="redis://...")`` twice in one process (two workers) over two in-process fakes of vLLM's
HTTP API and a real redis-server database (``CRAFT_RAG_TEST_REDIS``; flushed per test). Fakes
for the servers only: the real two-server, two-process test is test_routed_workers.py.

What N workers must agree on: a conversation's home (first writer wins, the second worker's
turn goes there and continues the conversation), the replicas' trees (a worker routes back to
the replica another worker filled, and orders the prompt to hit it), the loads in flight (each
worker sees the other's), and a crashed worker's load (gone after its lease)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import CHATML, FORMAT, FakeServer, chunks, running

from craft_rag.engine.backends.server.backend import ServerSettings
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.routed_engine import RoutedEngine
from craft_rag.routing import shared_state
from craft_rag.stores import MemoryStore
from craft_rag.tokenizer import HashingTokenizer


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


@pytest.fixture
def urls() -> Iterator[list[str]]:
    with running(FakeServer()) as a, running(FakeServer()) as b:
        yield [a, b]


def worker(urls: list[str], model_dir: Path, store: Any, **kw: Any) -> RoutedEngine:
    """One app worker's engine (as each process would build it)."""
    settings = [ServerSettings(u, kv_events=False, backoff=0.01, retries=0) for u in urls]
    engine = CraftEngine(
        EngineSettings(model=model_dir),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        server=settings,
        store=store,
        **kw,
    )
    assert isinstance(engine, RoutedEngine)
    return engine


def test_two_workers_share_homes_trees_and_loads(
    urls: list[str], model_dir: Path, redis_url: str
) -> None:
    a = worker(urls, model_dir, redis_url)
    # The second worker lists the servers in the other order: same replica ids, same state.
    b = worker(list(reversed(urls)), model_dir, redis_url)
    try:
        # A conversation started on worker A continues on worker B, on A's replica.
        one = a.generate(chunks(2, "a"), "first?", conversation_id="c1", max_tokens=2)
        home = one.report.replica
        assert b.router.home("c1") == home
        two = b.generate(chunks(2, "b"), "second?", conversation_id="c1", max_tokens=2)
        assert (two.report.replica, two.report.turn, two.report.rehomed) == (home, 2, False)
        assert two.report.cached_tokens > 0  # the history A's turn left on that server
        assert a.turn_count("c1") == 2 and b.turn_count("c1") == 2
        # Chunks A served: B routes them back to that replica, in A's cached order.
        docs = chunks(4, "d")
        first = a.generate(docs, "who?", max_tokens=1)
        again = b.generate(list(reversed(docs)), "what?", max_tokens=1)
        assert again.report.replica == first.report.replica
        assert again.report.chunk_order == first.report.chunk_order
        assert again.report.cached_tokens > 0 and again.report.reused_chunks == 4
        # A request in flight on A (routed, not finished) is B's load too, and back to zero
        # once A finishes it.
        decision = a.router.route(chunks(3, "e"), prompt_tokens=300)
        seen = b.router.load()[decision.replica]
        assert (seen.requests, seen.prompt_tokens) == (1, 300)
        assert a.router.finish(decision)
        assert all(x.requests == 0 for x in b.router.load().values())
        # Ended on B: gone for A too.
        assert b.end_conversation("c1")
        assert a.router.home("c1") is None and a.turn_count("c1") == 0
    finally:
        a.close()
        b.close()


def test_first_writer_wins_the_home(urls: list[str], model_dir: Path, redis_url: str) -> None:
    a = worker(urls, model_dir, redis_url)
    b = worker(urls, model_dir, redis_url)
    try:
        # A claims "c2" on the second replica behind B's back (its router routes the first
        # turn; the decision is not served): B's first turn of "c2" goes there, not where
        # B's own policy would put it (the first replica: both empty, tie by index).
        decision = a.router.route(chunks(2, "z"), prompt_tokens=50, conversation_id="c2")
        a.router.finish(decision)
        assert decision.replica == a.replicas[0]
        a.router.end_conversation("c2")
        shared = a.router._shared
        assert shared is not None
        conv = (None, "c2")
        assert shared.claim_home(conv, a.replicas[1]) == a.replicas[1]  # type: ignore[arg-type]
        assert shared.claim_home(conv, a.replicas[0]) == a.replicas[1]  # type: ignore[arg-type]
        turn = b.generate(chunks(2, "y"), "hi?", conversation_id="c2", max_tokens=1)
        assert turn.report.replica == a.replicas[1]
    finally:
        a.close()
        b.close()


def test_a_crashed_workers_load_expires_with_its_lease(
    urls: list[str], model_dir: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_state, "DEFAULT_LOAD_LEASE_S", 0.4)
    a = worker(urls, model_dir, redis_url)
    b = worker(urls, model_dir, redis_url)
    try:
        decision = a.router.route(chunks(3, "e"), prompt_tokens=200)
        assert b.router.load()[decision.replica].requests == 1
        # A "crashes": it never finishes the request nor renews its lease.
        time.sleep(0.6)
        assert all(x.requests == 0 for x in b.router.load().values())
        # B's own load is untouched by A's expiry, and a closed worker withdraws its load.
        mine = b.router.route(chunks(3, "f"), prompt_tokens=100)
        c = worker(urls, model_dir, redis_url)
        try:
            assert c.router.load()[mine.replica].requests == 1
            b.router.finish(mine)
            b.close()
            assert all(x.requests == 0 for x in c.router.load().values())
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_replica_lost_on_one_worker_is_rehomed_for_all(model_dir: Path, redis_url: str) -> None:
    fakes = [FakeServer(), FakeServer()]
    with running(fakes[0]) as u0, running(fakes[1]) as u1:
        a = worker([u0, u1], model_dir, redis_url)
        b = worker([u0, u1], model_dir, redis_url)
        try:
            one = a.generate(chunks(2, "a"), "first?", conversation_id="c3", max_tokens=1)
            home = one.report.replica
            assert home is not None
            other = next(u for u in (u0, u1) if u != home)
            a.mark_down(home)  # A lost it (e.g. a failed request): the home moves for both
            assert a.router.home("c3") == other and b.router.home("c3") == other
            turn = b.generate(chunks(2, "b"), "second?", conversation_id="c3", max_tokens=1)
            assert turn.report.replica == other
            assert turn.report.turn == 1  # with a store the history is not carried
        finally:
            a.close()
            b.close()


def test_memory_store_shares_within_one_process(urls: list[str], model_dir: Path) -> None:
    store = MemoryStore()
    a = worker(urls, model_dir, store)
    b = worker(urls, model_dir, store)
    try:
        one = a.generate(chunks(2, "a"), "first?", conversation_id="c4", max_tokens=1)
        two = b.generate(chunks(2, "b"), "second?", conversation_id="c4", max_tokens=1)
        assert (two.report.replica, two.report.turn) == (one.report.replica, 2)
    finally:
        a.close()
        b.close()


def test_sqlite_store_is_refused_with_the_fix(
    urls: list[str], model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"redis://"):
        worker(urls, model_dir, f"sqlite:///{tmp_path}/state.db")
