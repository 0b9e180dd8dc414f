"""CraftEngine request logic against a fake backend: plan -> render -> generate -> commit."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from craft_rag.chunk import Chunk
from craft_rag.engine.engine import CraftEngine, EngineFailure, reused_chunk_count
from craft_rag.engine.results import RagRequest, SamplingRequest, StreamChunk
from craft_rag.planner import CraftPlanner, Plan
from craft_rag.testing import FakeBackend, make_chunks
from craft_rag.types import ConversationId

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]


def planner_of(engine: CraftEngine) -> CraftPlanner:
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    return planner


def test_reused_chunk_count_needs_every_token_of_a_chunk_cached() -> None:
    spans = [(10, 40), (40, 70), (70, 100)]
    assert reused_chunk_count(spans, 0, 16) == 0
    assert reused_chunk_count(spans, 32, 16) == 0  # chunk 1's tail 32-40 was recomputed
    assert reused_chunk_count(spans, 48, 16) == 1
    assert reused_chunk_count(spans, 64, 16) == 1
    assert reused_chunk_count(spans, 80, 16) == 2
    assert reused_chunk_count(spans, 96, 16) == 2
    assert reused_chunk_count(spans, 112, 16) == 3
    assert reused_chunk_count([], 96, 16) == 0
    # Cold: chunks shorter than a block used to count with 0 cached tokens (issue 11 item 9).
    assert reused_chunk_count([(2, 6), (6, 10)], 0, 16) == 0
    assert reused_chunk_count([(2, 6), (6, 10)], 0) == 0


def test_craft_order_reuses_the_whole_chunk_prefix_retriever_order_does_not(
    make_fake_engine: Factory,
) -> None:
    chunks = make_chunks(5)
    orders = [chunks, [chunks[3], chunks[0], chunks[4], chunks[1], chunks[2]]]
    reused = {}
    for policy in ("tree", "retriever"):
        engine, _ = make_fake_engine(policy=policy)
        first = engine.generate(orders[0], "Which?", max_tokens=2)
        second = engine.generate(orders[1], "Which one?", max_tokens=2)
        assert first.report.cached_tokens == 0
        reused[policy] = second.report
    tree, retriever = reused["tree"], reused["retriever"]
    # The 5th chunk ends at token 120, past the 112 cached (7 blocks of 16: the block holding
    # its tail and the question start differs from the first request's question).
    assert (tree.predicted_tokens, tree.cached_tokens) == (120, 112)
    assert tree.reused_chunks == 4
    assert tree.chunk_order == tuple(c.key for c in chunks)
    # Everything but the question (and the block it shares with the last chunk) was a hit.
    assert tree.prompt_tokens - tree.cached_tokens < 32
    assert retriever.reused_chunks == 0
    assert retriever.cached_tokens < tree.cached_tokens


def test_report_fields_and_commit(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    chunks = make_chunks(3)
    dup = chunks[1]
    result = engine.generate([*chunks, dup], "What?", max_tokens=3)
    report = result.report
    assert result.token_ids == (101, 102, 103)
    assert result.text == "t101 t102 t103 "
    assert result.finish_reason == "length"
    assert report.prompt_tokens == len(backend.added[0][1])
    assert report.output_tokens == 3
    assert report.repeated_in_request == (dup.key,)
    assert report.turn == 1 and report.dropped_turns == 0
    assert 0 <= report.ttft_ms <= report.latency_ms
    assert planner_of(engine).stats.commits == 1


def test_engine_failure_raises_and_commits_nothing(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    planner = planner_of(engine)
    chunks = make_chunks(3)
    engine.generate(chunks, "first?", conversation_id="c", max_tokens=2)
    history = engine.conversations.history_tokens("c")
    table_before = planner.access_table.to_json()
    tree_before = planner.prefix_tree.to_json()

    backend.fail_on_step = True
    with pytest.raises(EngineFailure, match="simulated engine crash"):
        engine.generate(make_chunks(2, prefix="new"), "second?", conversation_id="c")
    assert planner.stats.commits == 1
    assert planner.access_table.to_json() == table_before
    assert planner.prefix_tree.to_json() == tree_before
    assert engine.conversations.history_tokens("c") == history
    assert planner.conversations.turn_count(ConversationId("c")) == 1

    # The engine keeps serving, and the conversation continues from turn 2.
    backend.fail_on_step = False
    again = engine.generate(make_chunks(2, prefix="new"), "second?", conversation_id="c")
    assert again.report.turn == 2
    planner._check_invariants()
    engine.conversations._check_invariants()


def test_bad_inputs(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(max_model_len=200))
    with pytest.raises(ValueError, match="question"):
        engine.generate(make_chunks(1), "  ")
    # Empty chunks are fine.
    assert engine.generate([], "Anything?", max_tokens=1).report.chunk_order == ()
    # Too long even alone: a clear error, nothing sent, nothing committed.
    sent = len(backend.added)
    with pytest.raises(ValueError, match="max_model_len 200"):
        engine.generate(make_chunks(12, words=30), "Why?", max_tokens=4)
    assert len(backend.added) == sent
    assert planner_of(engine).stats.commits == 1
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingRequest(max_tokens=0)


def test_second_turn_appends_to_the_first_and_dedups(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    chunks = make_chunks(4)
    first = engine.generate(chunks[:3], "Q1?", conversation_id="conv", max_tokens=4)
    second = engine.generate(chunks[1:], "Q2?", conversation_id="conv", max_tokens=4)
    prompt1, prompt2 = backend.added[0][1], backend.added[1][1]

    assert prompt2[: len(prompt1)] == prompt1
    reply_and_close = prompt2[len(prompt1) : second.report.prefix_tokens]
    assert reply_and_close[:4] == first.token_ids
    assert second.report.turn == 2
    assert set(second.report.removed_duplicates) == {chunks[1].key, chunks[2].key}
    assert second.report.chunk_order == (chunks[3].key,)
    # Everything up to turn 1's last full block (prompt + reply) was a hit.
    assert second.report.cached_tokens == (len(prompt1) + 4) // 16 * 16


def test_oldest_turns_are_dropped_whole_when_the_context_fills(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(max_model_len=260))
    reports = []
    for turn in range(6):
        chunks = make_chunks(2, words=25, prefix=f"t{turn}", seed=turn)
        reports.append(
            engine.generate(chunks, f"Q{turn}?", conversation_id="long", max_tokens=4).report
        )
        prompt = backend.added[-1][1]
        assert len(prompt) + 4 <= 260
        # This turn's chunks are in the prompt whole.
        chunk_ids = [engine.assembler.chunk_ids(c) for c in chunks]
        joined = tuple(i for ids in chunk_ids for i in ids)
        start = reports[-1].prefix_tokens
        assert prompt[start : start + len(joined)] == joined
    assert reports[0].dropped_turns == 0
    assert sum(r.dropped_turns for r in reports) > 0
    dropped_at = next(i for i, r in enumerate(reports) if r.dropped_turns)
    after = backend.added[dropped_at][1]
    # The head stays; the oldest turn is gone.
    assert after[: len(engine.assembler.head_ids)] == engine.assembler.head_ids
    engine.conversations._check_invariants()


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_conversation_whose_history_was_evicted_starts_over_in_the_planner_too(
    make_fake_engine: Factory, salt: str | None
) -> None:
    """The prompt history keeps max_conversations=1: starting "b" evicts "a"'s history. The
    planner must forget "a" too, else a's next turn is planned as turn 2 (c0 removed as sent)
    but rendered without turn 1, and c0 silently vanishes from the prompt."""
    engine, backend = make_fake_engine(max_conversations=1)
    c0, c1, c2 = make_chunks(3)
    engine.generate([c0, c1], "Q1?", conversation_id="a", max_tokens=2, cache_salt=salt)
    engine.generate([c2], "Q?", conversation_id="b", max_tokens=2, cache_salt=salt)
    assert engine.turn_count("a", cache_salt=salt) == 0  # evicted by "b"
    again = engine.generate([c0, c2], "Q2?", conversation_id="a", max_tokens=2, cache_salt=salt)
    assert again.report.turn == 1 and again.report.removed_duplicates == ()
    assert set(again.report.chunk_order) == {c0.key, c2.key}
    prompt = backend.added[-1][1]
    c0_ids = engine.assembler.chunk_ids(c0)
    assert any(
        prompt[i : i + len(c0_ids)] == c0_ids for i in range(len(prompt) - len(c0_ids) + 1)
    )
    # Explicitly ending a conversation also forgets it in its salt's planner.
    planner = engine.planner_for(salt)
    assert engine.end_conversation("a", cache_salt=salt)
    assert planner.plan([c0], "a").turn == 1  # type: ignore[union-attr]
    engine.conversations._check_invariants()


def test_a_conversation_ended_between_planning_and_rendering_is_not_planned_again(
    make_fake_engine: Factory,
) -> None:
    """A conversation ended (end_conversation) after its next turn was planned (as turn 2)
    and before it is rendered: the turn is refused (nothing sent, no re-planning: the plan's
    removed duplicates are in no prompt any more); sent again, it is a fresh first turn."""
    engine, backend = make_fake_engine()
    c0, c1, c2 = make_chunks(3)

    class EndingPlanner(CraftPlanner):
        evict = False

        def plan(self, chunks: Sequence[Chunk], conversation_id: str | None = None) -> Plan:
            made = super().plan(chunks, conversation_id)
            if self.evict and conversation_id is not None:
                self.evict = False
                engine.conversations.end(conversation_id)
            return made

    planner = EndingPlanner()
    engine.set_planner(planner)
    engine.generate([c0, c1], "Q1?", conversation_id="a", max_tokens=2)
    planner.evict = True
    sent = len(backend.added)
    with pytest.raises(RuntimeError, match="send the turn again"):
        engine.generate([c0, c2], "Q2?", conversation_id="a", max_tokens=2)
    assert len(backend.added) == sent and not planner.in_flight("a")
    again = engine.generate([c0, c2], "Q2?", conversation_id="a", max_tokens=2)
    assert again.report.turn == 1 and again.report.removed_duplicates == ()
    assert set(again.report.chunk_order) == {c0.key, c2.key}
    assert planner.stats.commits == 2
    # A caller-made plan whose conversation was ended is stale: refused before anything is sent.
    made = planner.plan([c1], "a")
    assert made.turn == 2
    engine.conversations.end("a")
    sent = len(backend.added)
    with pytest.raises(RuntimeError, match="plan the turn again"):
        engine.generate(list(made.ordered), "Q3?", plan=made, max_tokens=2)
    assert len(backend.added) == sent
    engine.conversations._check_invariants()


def test_a_planned_conversation_is_not_evicted_before_it_is_rendered(
    make_fake_engine: Factory,
) -> None:
    """One LRU bound (max_conversations=1) on the planner's store: other conversations
    recorded while "a"'s turn 2 waits between planning and rendering do not evict "a" (the
    planner holds it), so turn 2 is served as planned, its duplicate c0 kept in the prompt by
    turn 1; no re-planning."""
    engine, backend = make_fake_engine(max_conversations=1)
    c0, c1, c2 = make_chunks(3)

    class CrowdingPlanner(CraftPlanner):
        crowd = False

        def plan(self, chunks: Sequence[Chunk], conversation_id: str | None = None) -> Plan:
            made = super().plan(chunks, conversation_id)
            if self.crowd:
                self.crowd = False
                for other in ("x", "y"):
                    self.conversations.record_turn(ConversationId(other), [c2.key], (1, 2))
            return made

    planner = CrowdingPlanner(engine.planner.config)
    engine.set_planner(planner)
    engine.generate([c0, c1], "Q1?", conversation_id="a", max_tokens=2)
    planner.crowd = True
    again = engine.generate([c0, c2], "Q2?", conversation_id="a", max_tokens=2)
    assert again.report.turn == 2 and again.report.removed_duplicates == (c0.key,)
    prompt = backend.added[-1][1]
    c0_ids = engine.assembler.chunk_ids(c0)
    assert any(prompt[i : i + len(c0_ids)] == c0_ids for i in range(len(prompt)))
    assert planner.stats.commits == 2
    assert engine.conversations.turn_count("a") == 2
    assert engine.conversations.turn_count("x") == 0  # evicted by "y"; "a" (in flight) kept
    planner._check_invariants()
    engine.conversations._check_invariants()


def test_closing_a_stream_early_aborts_and_commits_nothing(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.02))
    stream = engine.stream(make_chunks(2), "Q?", conversation_id="s", max_tokens=8)
    first = next(stream)
    assert first.token_ids == (101,) and not first.finished
    stream.close()
    assert backend.aborted
    assert planner_of(engine).stats.commits == 0
    assert engine.conversations.history_tokens("s") == 0
    # The conversation is not stuck in flight.
    engine.generate(make_chunks(1), "again?", conversation_id="s", max_tokens=1)


def test_stream_yields_deltas_then_the_result(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    pieces = list(engine.stream(make_chunks(2), "Q?", max_tokens=3))
    assert [p.token_ids for p in pieces[:-1]] == [(101,), (102,), (103,)]
    final = pieces[-1].result
    assert final is not None and final.token_ids == (101, 102, 103)
    assert pieces[0].elapsed_ms == pytest.approx(final.report.ttft_ms)
    assert planner_of(engine).stats.commits == 1


def test_astream_yields_deltas_and_cancellation_aborts(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.02))

    async def consume(limit: int | None) -> list[tuple[int, ...]]:
        got = []
        gen = engine.astream(make_chunks(2), "Q?", max_tokens=4)
        async for piece in gen:
            got.append(piece.token_ids)
            if limit is not None and len(got) >= limit:
                await gen.aclose()
                break
        return got

    full = asyncio.run(consume(None))
    assert full[:4] == [(101,), (102,), (103,), (104,)] and full[4] == ()
    assert asyncio.run(consume(1)) == [(101,)]
    assert backend.aborted
    assert planner_of(engine).stats.commits == 1


def test_batch_results_in_order_and_conversation_once_per_batch(
    make_fake_engine: Factory,
) -> None:
    engine, _ = make_fake_engine()
    requests = [RagRequest(make_chunks(2, prefix=f"b{i}"), f"Q{i}?") for i in range(3)]
    results = engine.generate_batch(requests, max_tokens=2)
    assert [r.report.chunk_order[0] for r in results] == ["b0-0", "b1-0", "b2-0"]
    with pytest.raises(ValueError, match="at most once per batch"):
        engine.generate_batch(
            [RagRequest([], "a?", "same"), RagRequest([], "b?", "same")], max_tokens=1
        )


def test_one_turn_in_flight_per_conversation(make_fake_engine: Factory) -> None:
    gate = threading.Event()
    engine, _ = make_fake_engine(FakeBackend(step_gate=gate))
    stream = engine.stream(make_chunks(1), "Q?", conversation_id="busy", max_tokens=2)
    worker = threading.Thread(target=lambda: list(stream))
    worker.start()
    try:
        # The worker thread may start late on a loaded machine: wait for it (10 s, not 1 s).
        deadline = time.monotonic() + 10
        while not engine._driver.in_flight() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert engine._driver.in_flight()
        with pytest.raises(RuntimeError, match="in flight"):
            engine.generate([], "next?", conversation_id="busy")
    finally:
        gate.set()
        worker.join(5)


def test_no_cache_baseline_reads_nothing_and_keeps_the_tree(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    chunks = make_chunks(3)
    for _ in range(3):
        engine.generate(chunks, "Q?", max_tokens=1)
    tree_size = len(planner_of(engine).prefix_tree)
    assert tree_size > 0
    cold = engine.generate(chunks, "Q?", max_tokens=1, read_prefix_cache=False)
    assert cold.report.cached_tokens == 0 and not cold.report.read_prefix_cache
    assert len(planner_of(engine).prefix_tree) == tree_size


def test_reset_prefix_cache_without_events_clears_the_tree(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    chunks = make_chunks(3)
    engine.generate(chunks, "Q?", max_tokens=1)
    engine.generate(chunks, "Q?", max_tokens=1)
    assert len(planner_of(engine).prefix_tree) > 0
    assert engine.reset_prefix_cache()
    assert len(planner_of(engine).prefix_tree) == 0
    assert engine.generate(chunks, "Q?", max_tokens=1).report.cached_tokens == 0


# ---- cache salts ---------------------------------------------------------------------------


def test_salted_requests_reuse_only_within_their_salt(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    chunks = make_chunks(4)
    first = engine.generate(chunks, "Q?", max_tokens=1, cache_salt="tenant-a")
    again = engine.generate(chunks, "Q?", max_tokens=1, cache_salt="tenant-a")
    other = engine.generate(chunks, "Q?", max_tokens=1, cache_salt="tenant-b")
    plain = engine.generate(chunks, "Q?", max_tokens=1)
    assert backend.salts == ["tenant-a", "tenant-a", "tenant-b", None]
    assert first.report.cached_tokens == 0 and first.report.salted
    assert again.report.cached_tokens == (again.report.prompt_tokens - 1) // 16 * 16
    # Chunk 4 ends at token 98, past the 96 cached (the last prompt token is never cached).
    assert (again.report.predicted_tokens, again.report.cached_tokens) == (98, 96)
    assert again.report.predicted_chunks == 4 and again.report.reused_chunks == 3
    # Same token ids, other salt: nothing cached, nothing predicted.
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.report.cached_tokens == 0 and other.report.predicted_chunks == 0
    assert plain.report.cached_tokens == 0 and not plain.report.salted
    # Each salt has its own planner; the default planner saw only the unsalted request.
    a, b = engine.planner_for("tenant-a"), engine.planner_for("tenant-b")
    assert isinstance(a, CraftPlanner) and isinstance(b, CraftPlanner)
    assert (a.stats.commits, b.stats.commits, planner_of(engine).stats.commits) == (2, 1, 1)


def test_salted_commits_record_salted_block_hashes(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    chunks = make_chunks(3)
    result = engine.generate(chunks, "Q?", max_tokens=1, cache_salt="s1")
    salted = backend.hasher.block_hashes(result.prompt_token_ids, "s1")
    unsalted = backend.hasher.block_hashes(result.prompt_token_ids)
    assert not set(salted) & set(unsalted)  # the salt changes every chained hash
    planner = engine.planner_for("s1")
    assert isinstance(planner, CraftPlanner)
    # Evicting the salted blocks removes the salted path; unsalted hashes touch nothing.
    assert engine._namespaces.on_blocks_removed(unsalted) == 0
    assert len(planner.prefix_tree) == 3
    assert engine._namespaces.on_blocks_removed(salted) > 0
    assert len(planner.prefix_tree) < 3


def test_a_conversation_is_scoped_by_its_salt(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    engine.generate(make_chunks(2), "Q1?", conversation_id="c", max_tokens=2, cache_salt="a")
    for other in ("b", None):  # the same id under another salt: another conversation
        first = engine.generate(make_chunks(1), "Q2?", conversation_id="c", cache_salt=other)
        assert first.report.turn == 1 and first.report.cached_tokens == 0
    second = engine.generate(
        make_chunks(1, prefix="n"), "Q2?", conversation_id="c", max_tokens=2, cache_salt="a"
    )
    assert second.report.turn == 2 and second.report.cached_tokens > 0
    assert engine.end_conversation("c", cache_salt="a")
    assert engine.generate([], "Q?", conversation_id="c", cache_salt="a").report.turn == 1
    assert engine.generate([], "Q?", conversation_id="c", cache_salt="b").report.turn == 2


def test_salt_namespaces_are_bounded_and_reset_with_the_planner(
    make_fake_engine: Factory,
) -> None:
    engine, _ = make_fake_engine(max_salt_namespaces=2)
    for salt in ("a", "b", "c"):
        engine.generate(make_chunks(2), "Q?", max_tokens=1, cache_salt=salt)
    assert engine._namespaces.salts() == ["b", "c"]
    engine.set_planner(CraftPlanner())
    assert engine._namespaces.salts() == []


def test_bad_salts_and_backends_without_salts(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    for bad in ("", "a/b", "x" * 200):
        with pytest.raises(ValueError, match="cache_salt"):
            engine.generate([], "Q?", cache_salt=bad)
    assert backend.added == []

    class NoSaltBackend(FakeBackend):
        def add_request(  # type: ignore[override]
            self, request_id: str, token_ids: Sequence[int], sampling: SamplingRequest
        ) -> None:
            super().add_request(request_id, token_ids, sampling)

    old, old_backend = make_fake_engine(NoSaltBackend())
    with pytest.raises(ValueError, match="takes no cache_salt"):
        old.generate([], "Q?", cache_salt="a")
    assert old.generate([], "Q?", max_tokens=1).report.prompt_tokens > 0  # unsalted still fine
    assert old_backend.salts == [None]


# ---- caller-made plans (plan=) --------------------------------------------------------------


def test_a_given_plan_is_served_in_its_order_and_committed_once(
    make_fake_engine: Factory,
) -> None:
    engine, backend = make_fake_engine()
    planner = planner_of(engine)
    chunks = make_chunks(4)
    plan = planner.plan([chunks[2], chunks[0], chunks[3], chunks[1]])
    plans_before = planner.stats.plans
    result = engine.generate(plan.ordered, "Q?", plan=plan, max_tokens=2)
    assert planner.stats.plans == plans_before  # the engine did not plan again
    assert planner.stats.commits == 1
    assert result.report.chunk_order == plan.keys
    assert result.report.plan_id == plan.plan_id
    ids = backend.added[-1][1]
    spans = [engine.assembler.chunk_ids(c) for c in plan.ordered]
    start = result.report.prefix_tokens
    assert ids[start : start + sum(map(len, spans))] == tuple(i for s in spans for i in s)
    with pytest.raises(RuntimeError, match="already committed"):
        engine.generate(plan.ordered, "Q?", plan=plan)
    assert planner.stats.commits == 1 and len(backend.added) == 1


def test_a_given_plan_through_streams_and_batches(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    planner = planner_of(engine)
    p1 = planner.plan(make_chunks(2, prefix="s"))
    final = list(engine.stream(p1.ordered, "Q?", plan=p1, max_tokens=2))[-1].result
    assert final is not None and final.report.plan_id == p1.plan_id

    async def consume() -> int | None:
        p2 = planner.plan(make_chunks(2, prefix="a"), "conv")
        pieces = [p async for p in engine.astream(p2.ordered, "Q?", plan=p2, max_tokens=2)]
        result = pieces[-1].result
        assert result is not None and result.report.conversation_id == "conv"
        return result.report.plan_id

    assert asyncio.run(consume()) is not None
    p3, p4 = planner.plan(make_chunks(1, prefix="b")), planner.plan(make_chunks(1, prefix="c"))
    results = engine.generate_batch(
        [RagRequest(p3.ordered, "Q?", plan=p3), RagRequest(p4.ordered, "Q?", plan=p4)],
        max_tokens=1,
    )
    assert [r.report.plan_id for r in results] == [p3.plan_id, p4.plan_id]
    assert planner.stats.commits == 4
    # The same plan twice in one batch: refused before either runs past planning.
    p5 = planner.plan(make_chunks(1, prefix="d"))
    with pytest.raises(RuntimeError, match="already being served"):
        engine.generate_batch([RagRequest(p5.ordered, "Q?", plan=p5)] * 2, max_tokens=1)
    assert engine.generate(p5.ordered, "Q?", plan=p5, max_tokens=1).report.plan_id == p5.plan_id


def test_a_given_plan_must_fit_the_request(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    chunks = make_chunks(3)
    stranger = CraftPlanner().plan(chunks)
    with pytest.raises(RuntimeError, match="another planner"):
        engine.generate(chunks, "Q?", plan=stranger)
    plan = planner_of(engine).plan(chunks, "conv")
    with pytest.raises(ValueError, match="conversation 'conv', not 'other'"):
        engine.generate(chunks, "Q?", plan=plan, conversation_id="other")
    with pytest.raises(ValueError, match="do not match"):
        engine.generate(chunks[:1], "Q?", plan=plan)
    # A plan of the default planner is not a plan of a salt's planner.
    with pytest.raises(RuntimeError, match="planner of this cache_salt"):
        engine.generate(chunks, "Q?", plan=plan, cache_salt="tenant")
    with pytest.raises(ValueError, match=r"craft_rag\.planner\.Plan"):
        engine.generate(chunks, "Q?", plan=object())  # type: ignore[arg-type]
    assert backend.added == []
    # The conversation comes from the plan.
    served = engine.generate(chunks, "Q?", plan=plan, max_tokens=1)
    assert served.report.conversation_id == "conv" and served.report.turn == 1
    salted = engine.planner_for("tenant").plan(chunks)
    assert engine.generate(chunks, "Q?", plan=salted, cache_salt="tenant", max_tokens=1)


def test_a_failed_plan_is_not_committed_and_can_be_served_again(
    make_fake_engine: Factory,
) -> None:
    engine, backend = make_fake_engine()
    planner = planner_of(engine)
    plan = planner.plan(make_chunks(2), "c")
    backend.fail_on_step = True
    with pytest.raises(EngineFailure):
        engine.generate(plan.ordered, "Q?", plan=plan, max_tokens=1)
    assert planner.stats.commits == 0
    backend.fail_on_step = False
    assert engine.generate(plan.ordered, "Q?", plan=plan, max_tokens=1).report.turn == 1
    assert planner.stats.commits == 1
    # A stream closed early releases its plan too.
    nxt = planner.plan(make_chunks(1, prefix="n"), "c")
    backend.step_delay = 0.02
    stream = engine.stream(nxt.ordered, "Q?", plan=nxt, max_tokens=8)
    next(stream)
    stream.close()
    assert engine.generate(nxt.ordered, "Q?", plan=nxt, max_tokens=1).report.turn == 2


# ---- prompts without chunks -----------------------------------------------------------------


def test_messages_are_served_without_planning_and_reuse_earlier_messages(
    make_fake_engine: Factory,
) -> None:
    engine, backend = make_fake_engine()
    chat = [("system", "Be brief. " * 8), ("user", "Where does the river flow today?")]
    first = engine.generate_messages(chat, max_tokens=3)
    assert first.prompt_token_ids == engine.message_token_ids(chat)
    assert first.report.chunk_order == () and first.report.plan_id is None
    assert planner_of(engine).stats.plans == 0
    longer = [*chat, ("assistant", first.text), ("user", "And tomorrow, where will it go?")]
    second = engine.generate_messages(longer, max_tokens=1, cache_salt="t")
    assert second.report.cached_tokens == 0  # another salt
    third = engine.generate_messages(longer, max_tokens=1, cache_salt="t")
    assert third.report.cached_tokens == (third.report.prompt_tokens - 1) // 16 * 16
    fourth = engine.generate_messages(longer, max_tokens=1)
    bare = engine.message_token_ids(chat)
    # Unsalted: every full block of the first chat's messages is reused.
    assert fourth.report.cached_tokens >= (len(bare) - 8) // 16 * 16 > 0
    assert backend.salts == [None, "t", "t", None]


def test_token_and_message_streams(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine()
    pieces = list(engine.stream_tokens([5, 6, 7], max_tokens=2))
    assert [p.token_ids for p in pieces[:-1]] == [(101,), (102,)]
    final = pieces[-1].result
    assert final is not None and final.prompt_token_ids == (5, 6, 7)
    assert final.report.prompt_tokens == 3

    async def consume() -> list[tuple[int, ...]]:
        chat = [("user", "Hi there")]
        return [p.token_ids async for p in engine.astream_messages(chat, max_tokens=2)]

    assert asyncio.run(consume()) == [(101,), (102,), ()]
    assert list(engine.stream_messages([("user", "Hi")], max_tokens=1))[-1].finished


def test_prompts_without_chunks_bad_input(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(max_model_len=64))
    with pytest.raises(ValueError, match="token_ids must be"):
        engine.generate_tokens([])
    with pytest.raises(ValueError, match="token_ids must be"):
        engine.generate_tokens([1, -2])
    with pytest.raises(ValueError, match="max_model_len 64"):
        engine.generate_tokens(list(range(60)), max_tokens=8)
    with pytest.raises(ValueError, match="messages"):
        engine.generate_messages([])
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate_tokens([1], cache_salt="")
    assert backend.added == []


def test_seeded_stress_with_salts_plans_and_failures_keeps_invariants(
    make_fake_engine: Factory,
) -> None:
    """Random requests over 4 salts (2 namespaces kept), conversations with fixed salts, given
    plans, failures, resets and ends. Oracle: the fake cache never evicts (and, unlike vLLM,
    caches prompt blocks only), so a request's cached tokens are exactly its longest
    full-block prefix shared with a prompt sent earlier (since the last reset) under the same
    salt, capped so the last token is recomputed."""
    rng = random.Random(7)
    engine, backend = make_fake_engine(max_salt_namespaces=2)
    salts = [None, "a", "b", "c"]
    conv_salt = {f"conv{i}": salts[i] for i in range(4)}
    since_reset = 0
    pool = make_chunks(10, words=12)

    def expected_cached(ids: tuple[int, ...], salt: str | None) -> int:
        sent = zip(backend.added[since_reset:-1], backend.salts[since_reset:-1], strict=True)
        best = 0
        for (_, earlier, _), earlier_salt in sent:
            if earlier_salt != salt:
                continue
            n = 0
            while n < min(len(ids), len(earlier)) and ids[n] == earlier[n]:
                n += 1
            best = max(best, n // 16 * 16)
        return min(best, (len(ids) - 1) // 16 * 16)

    for step in range(150):
        action = rng.random()
        chunks = rng.sample(pool, rng.randrange(0, 4))
        salt = rng.choice(salts)
        cid = rng.choice([None, *conv_salt]) if action < 0.75 else None
        if cid is not None and rng.random() < 0.9:
            salt = conv_salt[cid]
        use_plan = rng.random() < 0.3
        backend.fail_on_step = rng.random() < 0.05
        plan = None
        try:
            if action < 0.05:
                assert engine.reset_prefix_cache()
                since_reset = len(backend.added)
                continue
            if action < 0.08 and cid is not None:
                engine.end_conversation(cid)
                continue
            plan = engine.planner_for(salt).plan(chunks, cid) if use_plan else None
            result = engine.generate(
                chunks, f"Q{step}?", conversation_id=cid, cache_salt=salt, plan=plan, max_tokens=2
            )
        except ValueError as exc:  # a conversation sent with another salt
            assert cid is not None and salt != conv_salt[cid] and "was started" in str(exc)
            if plan is not None:  # a caller drops a plan it will not serve (issue 11 item 11)
                assert engine.planner_for(salt).abort(plan)  # type: ignore[attr-defined]
            continue
        except EngineFailure:
            assert backend.fail_on_step
            if plan is not None:
                assert engine.planner_for(salt).abort(plan)  # type: ignore[attr-defined]
            continue
        finally:
            backend.fail_on_step = False
            engine._namespaces._check_invariants()
            engine.conversations._check_invariants()
            for planner in engine._namespaces.all():
                assert isinstance(planner, CraftPlanner)
                planner._check_invariants()
                assert not planner._leases.claimed()  # no plan left being served
        ids = result.prompt_token_ids
        assert result.report.cached_tokens == expected_cached(ids, salt), step
        assert result.report.salted == (salt is not None)
        assert backend.added[-1][1] == ids and backend.salts[-1] == salt
    assert len(engine._namespaces.salts()) == 2


def test_closing_an_async_stream_aborts_at_once(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.02))
    planner = planner_of(engine)

    async def close_after_first(pieces: AsyncIterator[StreamChunk]) -> None:
        await anext(pieces)
        await pieces.aclose()  # type: ignore[attr-defined]
        # Aborted now, not when the loop shuts down or the generator is collected.
        assert backend.aborted and not backend.running
        backend.aborted.clear()

    plan = planner.plan(make_chunks(2), "c")

    async def run() -> None:
        await close_after_first(engine.astream(plan.ordered, "Q?", plan=plan, max_tokens=8))
        await close_after_first(engine.astream_tokens([1, 2, 3], max_tokens=8))
        await close_after_first(engine.astream_messages([("user", "Hi")], max_tokens=8))

    asyncio.run(run())
    assert planner.stats.commits == 0 and not planner._leases.claimed()
    assert engine.generate(plan.ordered, "Q?", plan=plan, max_tokens=1).report.turn == 1


def test_cold_request_reports_no_reused_chunks_even_when_chunks_fit_in_one_block(
    make_fake_engine: Factory,
) -> None:
    # Issue 11 item 9: chunks whose ends lie inside the first (uncached) block used to count
    # as reused with 0 cached tokens. One definition now: every token inside the cached prefix.
    from craft_rag.engine.kv_events import BlockHasher

    backend = FakeBackend(block_size=256, hasher=BlockHasher.for_algo(256))
    engine, _ = make_fake_engine(backend=backend)
    chunks = make_chunks(2, words=2)
    cold = engine.generate(chunks, "Q?", max_tokens=1)
    assert cold.report.cached_tokens == 0
    assert cold.report.predicted_tokens is None or cold.report.predicted_tokens < 256
    assert cold.report.reused_chunks == 0
    assert planner_of(engine).stats.reused_chunks == 0
