"""The per-chunk plan with chunk-caches on (engine/chunk_cache_plan.py), and its wiring into RAG
turns over the fake backend (what is sent: spans, request-scoped salt, nothing when exact)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.engine import ChunkCacheSettings, EngineSettings
from craft_rag.engine.chunk_cache_plan import (
    COMPUTE,
    EXACT,
    FIXED,
    ChunkCachePlanner,
    ChunkRecord,
)
from craft_rag.kvtiers.approx_params import is_request_scoped, parse_approx, tenant_salt
from craft_rag.testing import FakeBackend
from craft_rag.types import ChunkKey

K = ChunkKey
# Three chunks of 100 tokens after a 20-token head, then a 30-token question.
SPANS = [(20, 120), (120, 220), (220, 320)]
PROMPT = 350


def planner(**kwargs: object) -> ChunkCachePlanner:
    return ChunkCachePlanner(ChunkCacheSettings(**kwargs))  # type: ignore[arg-type]


def test_cold_request_is_seeded_as_chunk_spans_all_computed() -> None:
    p = planner()
    plan = p.plan([K("a"), K("b"), K("c")], SPANS, None, PROMPT, None)
    assert plan.routes == (COMPUTE, COMPUTE, COMPUTE)
    assert plan.send and plan.spans == tuple(SPANS)
    ask = parse_approx(plan.params(p.settings), PROMPT, {"chunk"})
    assert ask is not None and ask.blend is not None
    assert [(s.start, s.end) for s in ask.spans] == SPANS
    assert (ask.blend.rule, ask.blend.fraction) == ("kv_deviation", 0.3)


def test_cold_request_without_seeding_sends_nothing() -> None:
    plan = planner(seed_cold=False).plan([K("a"), K("b")], SPANS[:2], None, PROMPT, None)
    assert not plan.send and plan.reason == "nothing fixable"
    with pytest.raises(RuntimeError, match=r"check plan\.send"):
        plan.params(ChunkCacheSettings())


def test_exact_prefix_and_nothing_fixable_is_served_exactly() -> None:
    p = planner()
    p.record.note(None, [K("a"), K("b")], spans=False)  # sent exactly before
    plan = p.plan([K("a"), K("b"), K("c")], SPANS, 220, PROMPT, None)
    assert plan.routes == (EXACT, EXACT, COMPUTE)
    assert not plan.send and plan.reason == "nothing fixable"


def test_fixable_chunks_after_the_exact_prefix_are_sent() -> None:
    p = planner()
    p.record.note(None, [K("a")], spans=False)
    p.record.note(None, [K("b"), K("c")], spans=True)
    plan = p.plan([K("a"), K("b"), K("c")], SPANS, 120, PROMPT, None)
    assert plan.routes == (EXACT, FIXED, FIXED)
    assert plan.send and plan.spans == tuple(SPANS)  # all chunks: the connector clips at E
    # exact: everything after chunk a; spans: 30% of 200 + ranking 200 x 2/30 + the question.
    assert plan.exact_cost == PROMPT - 120
    assert plan.span_cost == pytest.approx(0.3 * 200 + 200 * 2 / 30 + 30)


def test_prefix_past_a_chunk_last_sent_as_spans_is_not_trusted() -> None:
    # Request-scoped requests leave no exact blocks: the CP-Tree's prediction stops there.
    p = planner()
    p.record.note(None, [K("a"), K("b")], spans=True)
    plan = p.plan([K("a"), K("b"), K("c")], SPANS, 320, PROMPT, None)
    assert plan.routes == (FIXED, FIXED, COMPUTE)
    assert plan.send


def test_cost_model_refuses_spans_when_exact_is_cheaper() -> None:
    p = planner(fraction=1.0)  # recomputing everything saves nothing
    p.record.note(None, [K("b")], spans=True)
    plan = p.plan([K("a"), K("b")], SPANS[:2], None, PROMPT, None)
    assert plan.routes == (COMPUTE, FIXED)
    assert not plan.send and plan.reason == "exact serving predicted cheaper"


def test_tenants_do_not_share_the_record() -> None:
    p = planner(seed_cold=False)
    p.record.note("t1", [K("a")], spans=True)
    assert p.plan([K("a")], SPANS[:1], None, PROMPT, "t2").routes == (COMPUTE,)
    assert p.plan([K("a")], SPANS[:1], None, PROMPT, "t1").routes == (FIXED,)


def test_fixable_first_is_stable() -> None:
    p = planner()
    p.record.note(None, [K("c"), K("e")], spans=True)
    keys = [K(x) for x in "abcde"]
    assert p.fixable_first(keys, lambda k: k, None) == [K(x) for x in "ceabd"]
    assert p.fixable_first(keys, lambda k: k, "other") == keys


def test_chunks_reaching_the_last_token_send_nothing() -> None:
    plan = planner().plan([K("a")], [(0, 10)], None, 10, None)
    assert not plan.send


def test_bad_plan_input() -> None:
    with pytest.raises(ValueError, match="2 chunk keys for 1 chunk spans"):
        planner().plan([K("a"), K("b")], SPANS[:1], None, PROMPT, None)
    with pytest.raises(ValueError, match="max_chunks must be an integer >= 1"):
        ChunkRecord(0)


def test_record_stress_stays_bounded_and_lru() -> None:
    rng = random.Random(7)
    record = ChunkRecord(5)
    model: list[tuple[str, str]] = []  # recency order, oldest first
    for _ in range(500):
        salt = rng.choice([None, "t"])
        keys = [K(f"k{rng.randrange(9)}") for _ in range(rng.randrange(1, 4))]
        record.note(salt, keys, spans=rng.random() < 0.5)
        for k in keys:
            slot = (salt or "", str(k))
            if slot in model:
                model.remove(slot)
            model.append(slot)
        del model[:-5]
        record._check_invariants()
        assert len(record) == len(model)
        for salt_s, key in model:
            assert record.get(salt_s or None, ChunkKey(key)) is not None


def test_rag_turns_send_spans_under_a_request_scoped_salt(
    make_fake_engine: Callable[..., tuple[object, FakeBackend]],
) -> None:
    """Over the fake backend: cold request seeded (spans, scoped salt), a repeat with a new
    chunk sends spans again (its chunks are fixable), plain requests and conversations none."""
    engine, backend = make_fake_engine(settings=EngineSettings(chunk_cache=ChunkCacheSettings()))
    chunks = [make_chunk(f"document {w} " * 6, id=w) for w in ("alpha", "beta", "gamma")]
    engine.generate(chunks[:2], "first?", cache_salt="tenant")  # type: ignore[attr-defined]
    engine.generate(  # type: ignore[attr-defined]
        [chunks[1], chunks[0], chunks[2]], "second?", cache_salt="tenant"
    )
    engine.generate(chunks[:2], "third?", conversation_id="c")  # type: ignore[attr-defined]
    sent = [(salt, dict(s.extra)) for salt, (_, _, s) in zip(backend.salts, backend.added,
                                                                strict=True)]
    assert len(sent) == 3
    for salt, extra in sent[:2]:
        assert is_request_scoped(salt) and tenant_salt(salt) == "tenant"
        spans = extra["extra_args"]["kv_transfer_params"]["craft_approx"]["spans"]
        assert spans and all(s["source"] == "chunk" for s in spans)
    assert sent[0][0] != sent[1][0]  # a fresh nonce per request
    assert sent[2] == (None, {})  # a conversation turn: served exactly
    with pytest.raises(ValueError, match="reserved"):
        engine.generate(chunks[:1], "q?", cache_salt="craft-approx:x")  # type: ignore[attr-defined]
