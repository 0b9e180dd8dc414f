"""The per-chunk plan with chunk-caches on (engine/chunk_cache_plan.py), and its wiring into RAG
turns over the fake backend (what is sent: spans, request-scoped salt, nothing when exact)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.engine import ChunkCacheSettings, EngineSettings
from craft_rag.engine.chunk_cache_plan import (
    COMPUTE,
    EXACT,
    FIXED,
    ChunkCachePlan,
    ChunkCachePlanner,
    ChunkNote,
    ChunkRecord,
)
from craft_rag.kvtiers.approx_params import (
    APPROX_PARAMS_KEY,
    HARVEST_PARAMS_KEY,
    is_request_scoped,
    parse_approx,
    parse_harvest,
    tenant_salt,
)
from craft_rag.testing import FAKE_BLOCK, FakeBackend
from craft_rag.types import ChunkKey

K = ChunkKey
# Three chunks of 100 tokens after a 20-token head, then a 30-token question.
SPANS = [(20, 120), (120, 220), (220, 320)]
PROMPT = 350
BLOCK = 16  # full prompt blocks end at 336: every chunk of SPANS lies inside them


def planner(**kwargs: object) -> ChunkCachePlanner:
    return ChunkCachePlanner(ChunkCacheSettings(**kwargs))  # type: ignore[arg-type]


def plan_of(
    p: ChunkCachePlanner,
    keys: list[ChunkKey],
    spans: list[tuple[int, int]],
    predicted: int | None,
    salt: str | None = None,
    prompt: int = PROMPT,
    block: int = BLOCK,
) -> ChunkCachePlan:
    return p.plan(keys, spans, predicted, prompt, salt, block_size=block)


def cached(p: ChunkCachePlanner, *names: str, salt: str | None = None) -> None:
    """Chunks the connector holds (harvested or in a span run), last sent not exactly."""
    p.record.note(salt, [K(n) for n in names], exact_last=False, cached=True)


def exact(p: ChunkCachePlanner, *names: str, salt: str | None = None) -> None:
    p.record.note(salt, [K(n) for n in names], exact_last=True)


def test_cold_request_is_served_exactly_and_harvested_by_default() -> None:
    p = planner()
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, None)
    assert plan.routes == (COMPUTE, COMPUTE, COMPUTE)
    assert not plan.send and plan.reason == "nothing fixable" and plan.spans == ()
    assert plan.harvest_spans == tuple(SPANS)
    params = plan.params(p.settings)
    assert set(params) == {HARVEST_PARAMS_KEY}  # an exact request: no craft_approx
    assert parse_harvest(params, PROMPT) == tuple(SPANS)
    assert parse_approx(params, PROMPT, {"chunk"}) is None
    p.sent(None, [K("a"), K("b"), K("c")], plan)
    for name in "abc":  # not before the request finished: the connector reads them then
        assert p.record.get(None, K(name)) == ChunkNote(cached=False, exact_last=True)
    p.finished(None, [K("a"), K("b"), K("c")], plan)
    for name in "abc":
        assert p.record.get(None, K(name)) == ChunkNote(cached=True, exact_last=True)
    with pytest.raises(ValueError, match="chunk keys"):
        p.finished(None, [K("a")], plan)


def test_harvest_lists_only_chunks_inside_the_full_prompt_blocks() -> None:
    p = planner()
    # 350 // 128 x 128 = 256: chunk a (ends 120) and b (ends 220) fit, c (ends 320) does not.
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, None, block=128)
    assert plan.harvest_spans == tuple(SPANS[:2])
    assert plan.params(p.settings) == {HARVEST_PARAMS_KEY: {"spans": [[20, 120], [120, 220]]}}
    p.sent(None, [K("a"), K("b"), K("c")], plan)
    p.finished(None, [K("a"), K("b"), K("c")], plan)
    assert p.record.get(None, K("b")) == ChunkNote(cached=True, exact_last=True)
    assert p.record.get(None, K("c")) == ChunkNote(cached=False, exact_last=True)
    # A chunk ending exactly on the bound is in; one past it is out (bound 320 at block 32).
    assert plan_of(p, [K("x")], [(20, 320)], None, prompt=340, block=32).harvest_spans == (
        (20, 320),)
    assert plan_of(p, [K("x")], [(20, 321)], None, prompt=340, block=32).harvest_spans == ()
    # No full block past the chunks' start: nothing listed, nothing sent.
    tiny = plan_of(p, [K("x")], [(2, 5)], None, prompt=9, block=16)
    assert tiny.harvest_spans == () and tiny.params(p.settings) == {}


def test_harvest_off_sends_nothing_for_exact_requests() -> None:
    p = planner(harvest=False)
    plan = plan_of(p, [K("a"), K("b")], SPANS[:2], None)
    assert not plan.send and plan.harvest_spans == () and plan.params(p.settings) == {}
    p.sent(None, [K("a"), K("b")], plan)
    assert p.record.get(None, K("a")) == ChunkNote(cached=False, exact_last=True)
    # Nothing is ever cached, so nothing is ever fixed.
    again = plan_of(p, [K("b"), K("a")], SPANS[:2], None)
    assert again.routes == (COMPUTE, COMPUTE) and not again.send


def test_cold_request_with_seed_cold_is_sent_as_spans_over_all_chunks() -> None:
    p = planner(seed_cold=True)
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, None)
    assert plan.routes == (COMPUTE, COMPUTE, COMPUTE)
    assert plan.send and plan.spans == tuple(SPANS) and plan.harvest_spans == ()
    params = plan.params(p.settings)
    assert set(params) == {APPROX_PARAMS_KEY}  # a span request carries no craft_chunks
    ask = parse_approx(params, PROMPT, {"chunk"})
    assert ask is not None and ask.blend is not None
    assert [(s.start, s.end) for s in ask.spans] == SPANS
    assert (ask.blend.rule, ask.blend.fraction) == ("kv_deviation", 0.3)
    p.sent(None, [K("a"), K("b"), K("c")], plan)
    for name in "abc":
        assert p.record.get(None, K(name)) == ChunkNote(cached=True, exact_last=False)


def test_exact_prefix_and_nothing_fixable_is_served_exactly() -> None:
    p = planner(harvest=False)
    exact(p, "a", "b")  # sent exactly before
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, 220)
    assert plan.routes == (EXACT, EXACT, COMPUTE)
    assert not plan.send and plan.reason == "nothing fixable"
    assert plan.params(p.settings) == {}


def test_span_run_ends_at_the_last_fixed_chunk() -> None:
    p = planner()
    exact(p, "a")
    cached(p, "b")
    # a exact, b fixed, c and d new: the spans cover a..b; vLLM computes c, d and the question.
    spans = [(20, 120), (120, 220), (220, 320), (320, 420)]
    plan = plan_of(p, [K("a"), K("b"), K("c"), K("d")], spans, 120, prompt=450)
    assert plan.routes == (EXACT, FIXED, COMPUTE, COMPUTE)
    assert plan.send and plan.spans == tuple(spans[:2])
    assert plan.harvest_spans == ()
    ask = parse_approx(plan.params(p.settings), 450, {"chunk"})
    assert ask is not None and [(s.start, s.end) for s in ask.spans] == spans[:2]
    # exact: all past chunk a; spans: 30% of b + ranking b + everything after b.
    assert plan.exact_cost == 450 - 120
    assert plan.span_cost == pytest.approx(0.3 * 100 + 100 * 2 / 30 + (450 - 220))


def test_new_chunks_between_fixed_ones_are_in_the_run_and_priced() -> None:
    p = planner()
    cached(p, "a", "c")
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, None)
    assert plan.routes == (FIXED, COMPUTE, FIXED)
    assert plan.send and plan.spans == tuple(SPANS)
    assert plan.span_cost == pytest.approx(0.3 * 200 + 100 + 200 * 2 / 30 + 30)
    assert plan.exact_cost == PROMPT - 20


def test_fixable_chunks_after_the_exact_prefix_are_sent() -> None:
    p = planner()
    exact(p, "a")
    cached(p, "b", "c")
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, 120)
    assert plan.routes == (EXACT, FIXED, FIXED)
    assert plan.send and plan.spans == tuple(SPANS)  # from chunk a: the connector clips at E
    assert plan.exact_cost == PROMPT - 120
    assert plan.span_cost == pytest.approx(0.3 * 200 + 200 * 2 / 30 + 30)


def test_exact_prefix_keys_stay_exact_after_a_span_request() -> None:
    p = planner()
    exact(p, "a")
    cached(p, "b")
    keys = [K("a"), K("b"), K("c")]
    plan = plan_of(p, keys, SPANS, 120)
    assert plan.routes == (EXACT, FIXED, COMPUTE) and plan.spans == tuple(SPANS[:2])
    p.sent(None, keys, plan)
    assert p.record.get(None, K("a")) == ChunkNote(cached=False, exact_last=True)
    assert p.record.get(None, K("b")) == ChunkNote(cached=True, exact_last=False)
    # c: computed by vLLM under the request-scoped salt: no exact blocks, not in the store.
    assert p.record.get(None, K("c")) == ChunkNote(cached=False, exact_last=False)
    # The next request with the same exact prefix still gets it (v1 lost it here).
    second = plan_of(p, [K("a"), K("c"), K("b")], SPANS, 220)
    assert second.routes == (EXACT, COMPUTE, FIXED)


def test_prefix_past_a_chunk_last_sent_in_a_span_run_is_not_trusted() -> None:
    # Request-scoped requests leave no exact blocks: the CP-Tree's prediction stops there.
    p = planner()
    cached(p, "a", "b")
    plan = plan_of(p, [K("a"), K("b"), K("c")], SPANS, 320)
    assert plan.routes == (FIXED, FIXED, COMPUTE)
    assert plan.send and plan.spans == tuple(SPANS[:2])


def test_harvested_chunks_are_exact_in_place_and_fixed_elsewhere() -> None:
    p = planner()
    first = plan_of(p, [K("a"), K("b")], SPANS[:2], None)
    p.sent(None, [K("a"), K("b")], first)
    p.finished(None, [K("a"), K("b")], first)
    # Same order, same place: the CP-Tree predicts them, the record trusts it.
    assert plan_of(p, [K("a"), K("b")], SPANS[:2], 220).routes == (EXACT, EXACT)
    # b first (no prefix predicted), then a new chunk: b fixed, c computed by vLLM.
    moved = plan_of(p, [K("b"), K("c")], SPANS[:2], None)
    assert moved.routes == (FIXED, COMPUTE)
    assert moved.send and moved.spans == (SPANS[0],)


def test_cost_model_refuses_spans_when_exact_is_cheaper() -> None:
    p = planner(fraction=1.0)  # recomputing everything saves nothing
    cached(p, "b")
    plan = plan_of(p, [K("a"), K("b")], SPANS[:2], None)
    assert plan.routes == (COMPUTE, FIXED)
    assert not plan.send and plan.reason == "exact serving predicted cheaper"
    assert plan.harvest_spans == tuple(SPANS[:2])  # served exactly: listed for harvest


def test_tenants_do_not_share_the_record() -> None:
    p = planner()
    cached(p, "a", salt="t1")
    assert plan_of(p, [K("a")], SPANS[:1], None, "t2").routes == (COMPUTE,)
    assert plan_of(p, [K("a")], SPANS[:1], None, "t1").routes == (FIXED,)


def test_fixable_first_is_stable() -> None:
    p = planner()
    cached(p, "c", "e")
    keys = [K(x) for x in "abcde"]
    assert p.fixable_first(keys, lambda k: k, None) == [K(x) for x in "ceabd"]
    assert p.fixable_first(keys, lambda k: k, "other") == keys


def test_chunks_reaching_the_last_token_send_no_spans() -> None:
    plan = plan_of(planner(), [K("a")], [(0, 10)], None, prompt=10, block=16)
    assert not plan.send and plan.params(ChunkCacheSettings()) == {}


def test_bad_plan_input() -> None:
    with pytest.raises(ValueError, match="2 chunk keys for 1 chunk spans"):
        plan_of(planner(), [K("a"), K("b")], SPANS[:1], None)
    for block in (0, True, 1.5):
        with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
            plan_of(planner(), [K("a")], SPANS[:1], None, block=block)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_chunks must be an integer >= 1"):
        ChunkRecord(0)
    p = planner()
    plan = plan_of(p, [K("a")], SPANS[:1], None)
    with pytest.raises(ValueError, match="2 chunk keys for a plan of 1 chunks"):
        p.sent(None, [K("a"), K("b")], plan)
    assert len(p.record) == 0  # nothing noted


def test_record_stress_stays_bounded_and_lru() -> None:
    rng = random.Random(7)
    record = ChunkRecord(5)
    model: dict[tuple[str, str], ChunkNote] = {}  # recency order, oldest first
    for _ in range(500):
        salt = rng.choice([None, "t"])
        keys = [K(f"k{rng.randrange(9)}") for _ in range(rng.randrange(1, 4))]
        exact_last = rng.random() < 0.5
        mark = rng.choice([None, True, False])
        record.note(salt, keys, exact_last=exact_last, cached=mark)
        for k in keys:
            slot = (salt or "", str(k))
            old = model.pop(slot, None)
            held = mark if mark is not None else (old is not None and old.cached)
            model[slot] = ChunkNote(cached=held, exact_last=exact_last)
        while len(model) > 5:
            del model[next(iter(model))]
        record._check_invariants()
        assert len(record) == len(model)
        for (salt_s, key), note in model.items():
            assert record.get(salt_s or None, ChunkKey(key)) == note


def test_planner_is_thread_safe_under_concurrent_turns() -> None:
    p = planner(max_chunks=8)
    errors: list[BaseException] = []

    def turns(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                keys = [K(f"k{rng.randrange(12)}") for _ in range(3)]
                if len(set(keys)) < 3:
                    continue
                plan = plan_of(p, keys, SPANS, rng.choice([None, 120, 220]))
                p.sent(None, keys, plan)
                assert len(p.record) <= 8
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=turns, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    p.record._check_invariants()


def test_rag_turns_send_harvest_lists_exactly_and_spans_request_scoped(
    make_fake_engine: Callable[..., tuple[object, FakeBackend]],
) -> None:
    """Over the fake backend: a cold request goes out exactly under the tenant's salt with its
    chunks listed for harvest (inside the full prompt blocks); a request with a harvested
    chunk moved to another place and a new chunk after it sends spans over the harvested
    chunk only, under a request-scoped salt; a conversation turn sends nothing extra."""
    engine, backend = make_fake_engine(settings=EngineSettings(chunk_cache=ChunkCacheSettings()))
    chunks = [make_chunk(f"document {w} " * 6, id=w) for w in ("alpha", "beta", "gamma")]
    first = engine.generate(chunks[:2], "first?", cache_salt="tenant")  # type: ignore[attr-defined]
    second = engine.generate(  # type: ignore[attr-defined]
        [chunks[1], chunks[2]], "second?", cache_salt="tenant"
    )
    engine.generate(chunks[:2], "third?", conversation_id="c")  # type: ignore[attr-defined]
    sent = [(salt, dict(s.extra)) for salt, (_, _, s) in zip(backend.salts, backend.added,
                                                                strict=True)]
    assert len(sent) == 3
    # 1: exact, normal salt, craft_chunks only, every listed chunk inside the full blocks.
    salt, extra = sent[0]
    assert salt == "tenant"
    params = extra["extra_args"]["kv_transfer_params"]
    assert set(params) == {HARVEST_PARAMS_KEY}
    prompt = len(first.prompt_token_ids)
    listed = parse_harvest(params, prompt)
    assert len(listed) == 2  # both chunks end inside the full blocks of this prompt
    assert listed[-1][1] <= prompt // FAKE_BLOCK * FAKE_BLOCK
    # 2: beta (harvested) at a new place, gamma new: spans over beta only, scoped salt.
    salt, extra = sent[1]
    assert is_request_scoped(salt) and tenant_salt(salt) == "tenant"
    params = extra["extra_args"]["kv_transfer_params"]
    assert set(params) == {APPROX_PARAMS_KEY}  # no craft_chunks on a span request
    ask = parse_approx(params, len(second.prompt_token_ids), {"chunk"})
    assert ask is not None and len(ask.spans) == 1
    assert second.report.chunk_order == (chunks[1].key, chunks[2].key)
    assert sent[2] == (None, {})  # a conversation turn: served exactly
    with pytest.raises(ValueError, match="reserved"):
        engine.generate(chunks[:1], "q?", cache_salt="craft-approx:x")  # type: ignore[attr-defined]
