"""Tenant-scoped conversations across two workers sharing a store (a real SQLite file, the
real redis-server): one conversation id under two cache salts is two conversations, and ending
one on any worker never reaches the other tenant's. Fake vLLM backend (two real engines cannot
share one process); planners, renderer and stores are the real ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.stores import StateStore, open_store
from craft_rag.testing import FakeBackend, make_chunks, make_fake_engine

SECRET_A = "tenant-a-secret-9f1c"
SECRET_B = "tenant-b-secret-77d0"
CONV = "support-1"


def _engine(store: StateStore) -> CraftEngine:
    return make_fake_engine(FakeBackend(max_model_len=1024), store=store)[0]


@pytest.fixture(params=["sqlite", "redis"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'tenants.db'}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def two_workers(shared_url: str) -> Iterator[tuple[CraftEngine, CraftEngine]]:
    stores = [open_store(shared_url), open_store(shared_url)]
    engines = [_engine(s) for s in stores]
    yield engines[0], engines[1]
    for engine in engines:
        engine.close()
    for store in stores:
        store.close()


def test_two_workers_keep_tenants_conversations_apart(
    two_workers: tuple[CraftEngine, CraftEngine],
) -> None:
    """Worker 1 serves tenant A's "support-1", worker 2 tenant B's: B ending its conversation
    (with or without the salt) never reaches A's, on either worker."""
    w1, w2 = two_workers
    chunks = make_chunks(4)
    a1 = w1.generate(chunks[:2], "Q1?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    b1 = w2.generate(chunks[:2], "Q1?", conversation_id=CONV, cache_salt=SECRET_B, max_tokens=2)
    assert (a1.report.turn, b1.report.turn) == (1, 1)
    # A's next turn is served by worker 2: it continues A's conversation, not B's.
    a2 = w2.generate(chunks[1:3], "Q2?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    assert a2.report.turn == 2 and a2.report.removed_duplicates == (chunks[1].key,)
    assert w2.end_conversation(CONV, cache_salt=SECRET_B)
    assert not w2.end_conversation(CONV)  # the unsalted tenant has no such conversation
    a3 = w1.generate(chunks[2:], "Q3?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    assert a3.report.turn == 3 and a3.report.removed_duplicates == (chunks[2].key,)
    assert a3.prompt_token_ids[: len(a2.prompt_token_ids)] == a2.prompt_token_ids
    b2 = w1.generate(chunks[:1], "Q?", conversation_id=CONV, cache_salt=SECRET_B, max_tokens=2)
    assert b2.report.turn == 1 and b2.report.removed_duplicates == ()
    a4 = w2.generate(chunks[:1], "Q4?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    assert a4.report.turn == 4 and a4.report.removed_duplicates == (chunks[0].key,)


def test_ending_on_a_worker_that_never_served_the_tenant(
    two_workers: tuple[CraftEngine, CraftEngine],
) -> None:
    """The end is logged in the tenant's namespace even where the worker holds no planner of
    that salt yet, and only there."""
    w1, w2 = two_workers
    chunks = make_chunks(2)
    w1.generate(chunks, "Q1?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    w1.generate(chunks, "Q1?", conversation_id=CONV, cache_salt=SECRET_B, max_tokens=2)
    assert w2.end_conversation(CONV, cache_salt=SECRET_A)
    a = w1.generate(chunks, "Q?", conversation_id=CONV, cache_salt=SECRET_A, max_tokens=2)
    b = w1.generate(chunks, "Q?", conversation_id=CONV, cache_salt=SECRET_B, max_tokens=2)
    assert a.report.turn == 1 and b.report.turn == 2


def test_store_errors_do_not_name_a_salts_namespace(shared_url: str) -> None:
    """A salted namespace's name is a digest of the tenant's key: store errors say "the
    namespace of a cache_salt" instead (the default namespace is still named)."""
    from craft_rag import CraftPlanner, PlannerConfig
    from craft_rag.stores import StoreCorrupted, namespace_for_salt

    store = open_store(shared_url)
    try:
        for salt in (SECRET_A, None):
            namespace = namespace_for_salt(salt)
            first = CraftPlanner(PlannerConfig(policy="tree"), store=store, namespace=namespace)
            first.commit(first.plan(make_chunks(2), CONV))
            other = PlannerConfig(policy="tree", max_conversations=7)  # another config
            with pytest.raises(StoreCorrupted) as refused:
                CraftPlanner(other, store=store, namespace=namespace).plan(make_chunks(1), CONV)
            text = str(refused.value)
            if salt is None:
                assert "namespace 'default'" in text
            else:
                assert "namespace of a cache_salt" in text
                assert namespace not in text and namespace[5:13] not in text
                assert SECRET_A not in text
    finally:
        store.close()
