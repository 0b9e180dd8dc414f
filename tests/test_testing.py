"""craft_rag.testing: the fake backend library users test with behaves as its docstring says
(replies, block-granular prefix cache, salts, failure), under a real CraftEngine."""

from __future__ import annotations

import pytest

from craft_rag.engine import EngineFailure
from craft_rag.testing import FAKE_BLOCK, FakeBackend, FakeClock, make_chunks, make_fake_engine


def test_the_docstring_example_and_block_granular_reuse() -> None:
    engine, backend = make_fake_engine()
    try:
        chunks = make_chunks(3)
        first = engine.generate(chunks, "question?", max_tokens=4)
        assert first.text == "t101 t102 t103 t104 "
        assert first.report.cached_tokens == 0
        again = engine.generate(chunks, "question?", max_tokens=4)
        prompt = len(again.prompt_token_ids)
        assert again.report.cached_tokens == (prompt - 1) // FAKE_BLOCK * FAKE_BLOCK > 0
        assert len(backend.added) == 2 and backend.salts == [None, None]
    finally:
        engine.close()
    assert backend.shut_down


def test_a_salt_changes_every_block_hash() -> None:
    backend = FakeBackend()
    ids = list(range(3 * FAKE_BLOCK + 1))
    plain = backend.block_hasher.raw_hashes(ids, None)
    salted = backend.block_hasher.raw_hashes(ids, "tenant")
    assert len(plain) == len(salted) == 3
    assert not set(plain) & set(salted)


def test_the_engine_shares_the_backend_hasher_and_failures_propagate() -> None:
    engine, backend = make_fake_engine(FakeBackend(fail_on_step=True), policy="frequency")
    try:
        assert engine.block_hasher is backend.hasher
        with pytest.raises(EngineFailure):
            engine.generate(make_chunks(1), "q", max_tokens=2)
    finally:
        engine.close()


def test_make_chunks_is_deterministic_and_named() -> None:
    a, b = make_chunks(4, seed=7), make_chunks(4, seed=7)
    assert a == b
    assert [c.key for c in a] == ["doc-0", "doc-1", "doc-2", "doc-3"]
    assert make_chunks(4, seed=8)[0].text != a[0].text


def test_a_store_engine_plans_from_the_store_and_rejects_another_policy() -> None:
    from craft_rag.stores import MemoryStore

    store = MemoryStore()
    engine, _ = make_fake_engine(store=store)
    try:
        assert engine.planner.store is store
        engine.generate(make_chunks(2), "q", max_tokens=1)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="policy='frequency'"):
        make_fake_engine(store=MemoryStore(), policy="frequency")


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(5.0)
    assert clock() == clock() == 5.0
    assert clock.tick() == 6.0 and clock.tick(0.5) == 6.5 == clock()
    clock.now = 1.0
    assert clock() == 1.0
