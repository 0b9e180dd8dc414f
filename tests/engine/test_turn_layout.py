"""Turn layout (issue 15 item 3): append, or restart the prompt with a compacted history.

The cost model and policy are pure; the renderer tests use the real prompt assembler over the
hashing tokenizer on the planner path (``rag_turn_harness``); the engine tests a real
CraftEngine (planner, store, renderer) over the fake backend, and two engines sharing a real
store (memory, SQLite). The real vLLM engine is in ``test_turn_layout_vllm.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from rag_turn_harness import TurnHarness, rag_turn, rendered

from craft_rag.chunk import Chunk
from craft_rag.engine import APPEND_ONLY, DEFAULT_TURN_LAYOUT, TurnCostModel, TurnLayoutPolicy
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.conversation_prompts import ConversationPrompts
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.engine.turn_context import TurnContext
from craft_rag.engine.turn_layout import ChunkSpanMemo, compact_turns
from craft_rag.planner import CraftPlanner
from craft_rag.prompt import PromptAssembler
from craft_rag.stores import StateStore, open_store
from craft_rag.testing import CHATML, FAKE_FORMAT, FakeBackend, make_chunks
from craft_rag.tokenizer import HashingTokenizer
from craft_rag.types import ConversationId

FORCE = TurnLayoutPolicy(mode="always_restart")


# ---- the cost model and the policy ---------------------------------------------------------


def test_cost_model_grows_with_new_and_cached_tokens() -> None:
    m = TurnCostModel(per_token_ms=1.0, per_context_ms=0.01)
    assert m.predict_ms(0, 0) == 0.0
    assert m.predict_ms(0, 100) == pytest.approx(100 * (1 + 0.01 * 50))
    assert m.predict_ms(1000, 100) > m.predict_ms(0, 100)
    # The default fit reproduces the probe it came from within 15%.
    d = DEFAULT_TURN_LAYOUT.cost
    for cached, new, measured in [(0, 1000, 1772), (1000, 1000, 2749), (2000, 1000, 3867)]:
        assert d.predict_ms(cached, new) == pytest.approx(measured, rel=0.15)


def test_bad_policy_values_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="per_context_ms"):
        TurnCostModel(per_context_ms=-1)
    with pytest.raises(ValueError, match="mode"):
        TurnLayoutPolicy(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_gain_ms"):
        TurnLayoutPolicy(min_gain_ms=-5)
    with pytest.raises(ValueError, match="turn_layout"):
        ConversationPrompts(
            PromptAssembler(HashingTokenizer(), FAKE_FORMAT), max_model_len=100,
            stores=PlannerNamespaces(CraftPlanner()),
            turn_layout="append_only",  # type: ignore[arg-type]
        )


def test_policy_picks_the_cheaper_layout_and_append_only_never_restarts() -> None:
    p = TurnLayoutPolicy(min_gain_ms=0)
    long_history = p.choose((2000, 900), (64, 1000), compacted_turns=3)
    assert long_history.restart and long_history.restart_ms < long_history.append_ms
    assert long_history.compacted_turns == 3
    small_new = p.choose((2000, 60), (64, 1000), compacted_turns=3)
    assert not small_new.restart and small_new.compacted_turns == 0
    assert not APPEND_ONLY.choose((2000, 900), (64, 1000), compacted_turns=3).restart
    assert not p.choose((2000, 900), (64, 1000), compacted_turns=0).restart
    assert FORCE.choose((2000, 10), (64, 1000), compacted_turns=1).restart
    # min_gain_ms: a win smaller than it is not taken.
    tiny = TurnLayoutPolicy(min_gain_ms=1e9).choose((2000, 900), (64, 1000), 3)
    assert not tiny.restart


def test_compact_turns_cuts_known_chunk_regions_and_keeps_unknown_turns_whole() -> None:
    memo = ChunkSpanMemo(capacity=8)
    t1 = (1, 2, 3, 4, 50, 51)  # chunks 1-4, question and reply 50-51
    t2 = (60, 61, 5, 6, 70)  # a restarted turn: compacted 60-61, chunks 5-6, then 70
    t3 = (7, 8, 80)  # not known here
    memo.remember(t1, (0, 4))
    memo.remember(t2, (2, 4))
    ids, lead, unknown = compact_turns([t1, t2, t3], memo)
    assert ids == (50, 51, 60, 61, 70, 7, 8, 80)
    assert lead == 0 and unknown == 1
    ids, lead, _ = compact_turns([t2, t1], memo)
    assert ids[:3] == (60, 61, 70) and lead == 2  # the restarted turn's own compacted lead
    with pytest.raises(ValueError, match="span"):
        memo.remember(t3, (2, 9))
    for i in range(20):  # bounded
        memo.remember((i,), (0, 1))
    assert len(memo) == 8


# ---- the renderer --------------------------------------------------------------------------


def _prompts(layout: TurnLayoutPolicy) -> TurnHarness:
    return TurnHarness(max_model_len=4000, turn_layout=layout, block_size=16)


def _turn(
    h: TurnHarness, chunks: list[Chunk], question: str, reply: list[int]
) -> tuple[tuple[int, ...], bool]:
    """One turn on the planner path: layout, plan (dedup), render, commit. Returns the prompt
    ids and whether it restarted."""
    rendered = h.serve(chunks, question, reply, conversation_id="c", max_tokens=4)
    h.prompts._check_invariants()
    return rendered.prompt.token_ids, rendered.layout is not None and rendered.layout.restart


def test_restart_compacts_history_keeps_questions_and_answers_and_resends_chunks() -> None:
    h = _prompts(FORCE)
    prompts = h.prompts
    a = prompts.assembler
    chunks = make_chunks(6, words=15)
    _, r1 = _turn(h, chunks[:3], "first question?", [41, 42])
    assert not r1  # nothing to compact in turn 1
    p2, r2 = _turn(h, [chunks[1], chunks[3]], "second question?", [43])
    assert r2
    text = list(p2)
    # Head, then turn 1's question, tail and reply (its chunks cut out), then ALL of turn 2's
    # chunks (chunk 1 again: the compacted history no longer carries it), then the question.
    q1 = list(a.question_ids("first question?"))
    assert text[: len(a.head_ids)] == list(a.head_ids)
    after_head = text[len(a.head_ids):]
    assert after_head[: len(q1) + 2] == [*q1, 41, 42]
    for chunk in chunks[:3]:
        ids = list(a.chunk_ids(chunk))
        found = any(text[i: i + len(ids)] == ids for i in range(len(text)))
        assert found == (chunk.key == chunks[1].key), chunk.key
    assert text[-len(a.question_ids("second question?")):] == list(
        a.question_ids("second question?")
    )
    # The store holds one live turn carrying exactly turn 2's chunk keys.
    history = h.namespaces.default.conversations.history(ConversationId("c"))
    assert history is not None and len(history.turns) == 1
    assert set(history.keys[0]) == {chunks[1].key, chunks[3].key}
    # Turn 3 appends (or restarts again) after the restarted prompt: dedup of chunk 3 is right
    # because the restarted prompt holds it; chunk 0 (only in the compacted turn 1) is re-sent.
    policy_off = _prompts(APPEND_ONLY).prompts
    assert policy_off.choose_layout(TurnContext("c"), chunks, "q", block_size=16) is None
    prompts.turn_layout = APPEND_ONLY
    p3, r3 = _turn(h, [chunks[3], chunks[0]], "third?", [44])
    assert not r3
    assert p3[: len(p2) + 1] == (*p2, 43)
    assert h.namespaces.default.conversations.split(ConversationId("c"), chunks[:1])[1]


def test_a_restart_that_is_not_served_leaves_the_history_as_it_was() -> None:
    h = _prompts(FORCE)
    prompts = h.prompts
    chunks = make_chunks(4, words=15)
    _turn(h, chunks[:2], "q1?", [41])
    before = h.namespaces.default.conversations.history(ConversationId("c"))
    flight = h.start(chunks[2:], "q2?", conversation_id="c", max_tokens=4)
    turn = rendered(flight)
    assert turn.layout is not None and turn.layout.restart
    assert turn.compacted_turns == 1
    rag_turn(flight).give_up()
    after = h.namespaces.default.conversations.history(ConversationId("c"))
    assert after is not None and before is not None
    assert after.turns == before.turns and after.keys == before.keys and not after.in_flight
    assert prompts.end("c") and prompts.turn_count("c") == 0


# ---- a real engine over the fake backend; two workers sharing a store ------------------------


def _engine(layout: TurnLayoutPolicy, store: StateStore | None = None) -> CraftEngine:
    backend = FakeBackend(max_model_len=2048)
    return CraftEngine(
        backend=backend, tokenizer=HashingTokenizer(), prompt_format=FAKE_FORMAT,
        block_hasher=backend.hasher, chat_renderer=jinja_renderer(CHATML), store=store,
        turn_layout=layout,
    )


TURNS: list[tuple[list[int], str]] = [
    ([0, 1, 2, 3], "what is w1?"),
    ([2, 3, 4, 5], "and w4?"),
    ([5, 6, 0, 7], "compare them"),
    ([8, 1, 6], "last one"),
]


def _serve(engines: list[CraftEngine], chunks: list[Chunk], cid: str) -> list[tuple[int, ...]]:
    out = []
    for i, (idx, question) in enumerate(TURNS):
        engine = engines[i % len(engines)]
        r = engine.generate([chunks[j] for j in idx], question, conversation_id=cid, max_tokens=3)
        layout = r.report.layout
        assert layout is not None or i == 0
        if layout is not None and layout.restart:
            # Every chunk of the turn is in the prompt; nothing reported as removed.
            assert set(r.report.chunk_order) == {chunks[j].key for j in idx}
            assert r.report.removed_duplicates == ()
        out.append(r.prompt_token_ids)
        for e in engines:
            e.conversations._check_invariants()
    return out


def test_engine_restart_is_reported_and_keeps_dedup_correct() -> None:
    chunks = make_chunks(9, words=40)
    engine = _engine(FORCE)
    try:
        results = []
        for idx, question in TURNS:
            results.append(engine.generate(
                [chunks[j] for j in idx], question, conversation_id="c", max_tokens=3
            ))
        assert results[0].report.layout is None
        restarted = [r for r in results[1:] if r.report.layout and r.report.layout.restart]
        assert restarted, "the forcing policy never restarted"
        for r in restarted:
            lay = r.report.layout
            assert lay is not None and lay.restart_new > lay.restart_cached >= 0
            # The prediction matches what was computed (the fake cache: whole blocks).
            assert r.report.uncached_tokens == pytest.approx(lay.restart_new, abs=16)
            assert lay.compacted_turns >= 1
            # Compacted turns are not reported as dropped (not by the restart, nor the next).
            assert r.report.dropped_turns == 0
        # After each restart the store holds one live turn: the restarted one.
        assert engine.conversations.turn_count("c") == 1
        # The last (restarted) turn's prompt holds 8, 1 and 6 (6 was a duplicate in its plan,
        # re-sent by the restart and recorded with the turn): all three are duplicates next
        # time. 2 is in no live turn.
        planner = engine.planner
        assert isinstance(planner, CraftPlanner)
        again = planner.plan([chunks[j] for j in (8, 1, 6, 2)], conversation_id="c")
        assert {c.key for c in again.removed_duplicates} == {
            chunks[8].key, chunks[1].key, chunks[6].key
        }
        planner.abort(again)
        assert engine.end_conversation("c")
    finally:
        engine.close()
    off = _engine(APPEND_ONLY)
    try:
        r = [off.generate([chunks[j] for j in idx], q, conversation_id="c", max_tokens=3)
             for idx, q in TURNS]
        assert all(x.report.layout is None for x in r)
        for prev, nxt in itertools.pairwise(r):
            assert nxt.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
    finally:
        off.close()


def _occurrences(hay: tuple[int, ...], needle: list[int]) -> int:
    n = len(needle)
    return sum(1 for i in range(len(hay) - n + 1) if list(hay[i: i + n]) == needle)


@pytest.mark.parametrize("kind", ["local", "memory", "sqlite"])
def test_a_restart_records_the_chunks_dedup_had_removed_so_they_are_not_sent_again(
    kind: str, tmp_path: Path
) -> None:
    """Turn 2 retrieves chunk 1 again: its plan removes it (turn 1 carried it), the restart
    re-sends it (turn 1 is compacted away) and records it with turn 2, so turn 3 retrieving it
    once more removes it as a duplicate: its prompt holds chunk 1 once. With a shared store the
    other worker replays the commit (the log entry says the removed chunks were re-sent)."""
    chunks = make_chunks(5, words=40)
    stores: list[StateStore | None] = [None, None]
    if kind == "memory":
        stores = [open_store("memory://")] * 2
    elif kind == "sqlite":
        stores = [open_store(f"sqlite://{tmp_path / 's.db'}") for _ in range(2)]
    a, b = (_engine(FORCE, s) for s in stores)
    try:
        a.generate([chunks[j] for j in (0, 1, 2)], "what is w1?", conversation_id="c",
                   max_tokens=3)
        second = a.generate([chunks[j] for j in (1, 3)], "and w3?", conversation_id="c",
                            max_tokens=3)
        lay = second.report.layout
        assert lay is not None and lay.restart
        assert set(second.report.chunk_order) == {chunks[1].key, chunks[3].key}
        served = a if kind == "local" else b  # the next turn on the other worker
        served.conversations.turn_layout = APPEND_ONLY
        third = served.generate([chunks[j] for j in (1, 4)], "and w4?", conversation_id="c",
                                max_tokens=3)
        assert third.report.removed_duplicates == (chunks[1].key,)
        ids = a.assembler.chunk_ids(chunks[1])
        assert _occurrences(third.prompt_token_ids, list(ids)) == 1
        for e in (a, b):
            e.conversations._check_invariants()
    finally:
        for engine in (a, b):
            engine.close()
        for st in {id(x): x for x in stores if x is not None}.values():
            st.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_two_workers_record_the_restarted_turn_and_render_what_one_worker_renders(
    kind: str, tmp_path: Path
) -> None:
    chunks = make_chunks(9, words=40)
    if kind == "memory":
        shared = open_store("memory://")
        stores = [shared, shared, open_store("memory://")]
    else:
        url = f"sqlite://{tmp_path / 's.db'}"
        stores = [open_store(url), open_store(url), open_store(f"sqlite://{tmp_path / 'r.db'}")]
    a, b, one = (_engine(FORCE, s) for s in stores)
    try:
        want = _serve([one], chunks, "chat")
        got = _serve([a, b], chunks, "chat")  # turns 1, 3 on A; 2, 4 on B
        # B's copy of the conversation is A's restarted turn, and vice versa.
        assert a.conversations.turn_count("chat") == b.conversations.turn_count("chat") == 1
    finally:
        for engine in (a, b, one):
            engine.close()
        for s in {id(s): s for s in stores}.values():
            s.close()
    # A worker that did not render a turn keeps it whole when compacting (its chunk regions
    # are unknown there), so its prompts may be longer than one worker's, never missing
    # anything: every prompt holds every question asked so far and all of its turn's chunks.
    asm = PromptAssembler(HashingTokenizer(), FAKE_FORMAT)
    assert got[0] == want[0] and got[1] != want[1]  # B did not know turn 1's chunk region
    for i, prompt in enumerate(got):
        wanted = [asm.question_ids(q) for _, q in TURNS[: i + 1]]
        wanted += [asm.chunk_ids(chunks[j]) for j in TURNS[i][0]]
        for ids in wanted:
            assert any(
                prompt[k: k + len(ids)] == ids for k in range(len(prompt))
            ), f"turn {i + 1} lost something"
    assert len(got[1]) > len(want[1])


@pytest.mark.parametrize("layout", [FORCE, DEFAULT_TURN_LAYOUT], ids=["force", "default"])
def test_caller_plans_get_a_layout_predicted_from_all_their_chunks(
    layout: TurnLayoutPolicy,
) -> None:
    """The LlamaIndex/LangChain paths serve a plan they made (it already holds the
    conversation, its ordered chunks are dedup's survivors): the layout counts the chunks the
    plan removed too, so its prediction is what the engine then computes."""
    chunks = make_chunks(9, words=120)
    engine = _engine(layout)
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    try:
        for i, (idx, question) in enumerate(TURNS):
            plan = planner.plan([chunks[j] for j in idx], conversation_id="c")
            r = engine.generate(list(plan.ordered), question, conversation_id="c", plan=plan,
                                max_tokens=3)
            lay = r.report.layout
            if i == 0:
                assert lay is None
                continue
            assert lay is not None
            predicted = lay.restart_new if lay.restart else lay.append_new
            assert abs(r.report.uncached_tokens - predicted) <= engine.block_size
            if lay.restart:
                assert set(r.report.chunk_order) == {chunks[j].key for j in idx}
        if layout is FORCE:
            assert engine.conversations.turn_count("c") == 1
    finally:
        engine.close()


def test_commit_removed_in_prompt_records_the_removed_keys_and_refuses_a_non_bool() -> None:
    """The planner seam on its own: ``removed_in_prompt`` adds the plan's removed duplicates
    to the turn's recorded keys; a non-bool is a ValueError that leaves the plan committable."""
    chunks = make_chunks(4, words=10)
    planner = CraftPlanner()
    planner.commit(planner.plan(chunks[:2], conversation_id="p"))
    plan = planner.plan([chunks[1], chunks[2]], conversation_id="p")
    assert [c.key for c in plan.removed_duplicates] == [chunks[1].key]
    with pytest.raises(ValueError, match="removed_in_prompt"):
        planner.commit(plan, removed_in_prompt=1)  # type: ignore[arg-type]
    planner.commit(plan, removed_in_prompt=True)
    assert planner.conversations.turns(ConversationId("p"))[-1] == (
        chunks[2].key, chunks[1].key
    )
    planner.conversations.forget_oldest_turns(ConversationId("p"), 1)
    again = planner.plan([chunks[1], chunks[3]], conversation_id="p")
    assert [c.key for c in again.removed_duplicates] == [chunks[1].key]
    planner._check_invariants()
