"""Engine conversations across workers sharing a store (issue 13): a chat's turns land on
different CraftEngine instances and still get the append-only prompt and the dedup one engine
gives. Two engines per store (fake vLLM backend: two real engines cannot share one process;
the tokenizer, prompt assembly, planners and stores are the real ones); SQLite file and a real
redis-server, plus a MemoryStore shared in-process. One ``engine`` test puts the real vLLM
engine (session fixture) in worker A's place."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from craft_rag.chunk import Chunk
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.conversation_prompts import HistoryBudget
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.results import GenerationResult
from craft_rag.stores import (
    DEFAULT_NAMESPACE,
    HistoryRecord,
    StateStore,
    StoreCorrupted,
    open_store,
)
from craft_rag.testing import CHATML, FAKE_FORMAT, FakeBackend, make_chunks, make_fake_engine
from craft_rag.tokenizer import HashingTokenizer

StoreFactory = Callable[..., StateStore]

CONV = "chat-1"


def _engine(store: StateStore, budget: HistoryBudget | None) -> CraftEngine:
    return make_fake_engine(FakeBackend(max_model_len=1024), store=store, history_budget=budget)[0]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store_pair(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[StateStore, StateStore, StateStore]]:
    """(worker A's store, worker B's connection to the SAME store, a separate reference
    store of the same kind for the one-engine run)."""
    kind = request.param
    opened: list[StateStore] = []
    if kind == "memory":
        shared = open_store("memory://")
        pair = (shared, shared, open_store("memory://"))
    else:
        if kind == "sqlite":
            url, ref = f"sqlite://{tmp_path / 's.db'}", f"sqlite://{tmp_path / 'ref.db'}"
        else:
            url = str(request.getfixturevalue("redis_url"))
            ref = url.rsplit("/", 1)[0] + "/1"  # another database of the test Redis
            import redis

            client = redis.Redis.from_url(ref)
            client.flushdb()
            client.close()
        opened = [open_store(url), open_store(url), open_store(ref)]
        pair = (opened[0], opened[1], opened[2])
    yield pair
    for store in opened:
        store.close()


TURNS: list[tuple[list[int], str]] = [
    ([0, 1, 2, 3], "what is w1?"),
    ([2, 3, 4, 5], "and w4?"),  # 2 and 3 were sent in turn 1
    ([5, 6, 0, 7], "compare them"),  # 5 (turn 2) and 0 (turn 1) were sent
    ([8, 1, 6], "last one"),
]


def _serve(engines: list[CraftEngine], chunks: list[Chunk]) -> list[GenerationResult]:
    """Turn i of the chat on ``engines[i % len(engines)]``."""
    out = []
    for i, (idx, question) in enumerate(TURNS):
        engine = engines[i % len(engines)]
        out.append(
            engine.generate(
                [chunks[j] for j in idx], question, conversation_id=CONV, max_tokens=3
            )
        )
    return out


@pytest.mark.parametrize(
    "budget", [None, HistoryBudget(max_tokens=120, keep_tokens=60)], ids=["nobudget", "budget"]
)
def test_turns_on_two_workers_render_what_one_worker_renders(
    store_pair: tuple[StateStore, StateStore, StateStore], budget: HistoryBudget | None
) -> None:
    store_a, store_b, store_ref = store_pair
    chunks = make_chunks(9, words=12)
    one = _engine(store_ref, budget)
    a, b = _engine(store_a, budget), _engine(store_b, budget)
    try:
        want = _serve([one], chunks)
        got = _serve([a, b], chunks)  # turns 1, 3 on A; 2, 4 on B
    finally:
        for engine in (one, a, b):
            engine.close()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.prompt_token_ids == w.prompt_token_ids, f"turn {i + 1} prompt differs"
        assert g.report.removed_duplicates == w.report.removed_duplicates, f"turn {i + 1}"
        assert g.report.chunk_order == w.report.chunk_order
        assert g.report.turn == w.report.turn == i + 1
        assert g.report.dropped_turns == w.report.dropped_turns
    # Dedup happened across workers: B's turn 2 dropped what A's turn 1 sent.
    assert set(got[1].report.removed_duplicates) == {chunks[2].key, chunks[3].key}
    if budget is None:
        # B's turn-2 prompt continues A's turn-1 prompt and reply token for token; A's turn 3
        # continues B's turn 2.
        for prev, nxt in itertools.pairwise(got):
            head = prev.prompt_token_ids + prev.token_ids
            assert nxt.prompt_token_ids[: len(head)] == head
    else:
        assert sum(r.report.dropped_turns for r in want) > 0, "the budget never dropped a turn"


def test_a_worker_that_served_nothing_follows_the_store(tmp_path: Path) -> None:
    """Worker B's stale copy (it served turn 1, A served turns 2 and 3) is replaced."""
    url = f"sqlite://{tmp_path / 's.db'}"
    store_a, store_b = open_store(url), open_store(url)
    a, b = _engine(store_a, None), _engine(store_b, None)
    chunks = make_chunks(9, words=12)
    try:
        r = [b.generate([chunks[0], chunks[1]], "q1", conversation_id=CONV, max_tokens=3)]
        r.append(a.generate([chunks[2]], "q2", conversation_id=CONV, max_tokens=3))
        r.append(a.generate([chunks[1], chunks[3]], "q3", conversation_id=CONV, max_tokens=3))
        assert b.conversations.turn_count(CONV) == 1
        r.append(b.generate([chunks[2], chunks[4]], "q4", conversation_id=CONV, max_tokens=3))
        assert b.conversations.turn_count(CONV) == 4
        head = r[2].prompt_token_ids + r[2].token_ids
        assert r[3].prompt_token_ids[: len(head)] == head
        assert r[3].report.removed_duplicates == (chunks[2].key,)
    finally:
        for x in (a, b, store_a, store_b):
            x.close()


@pytest.mark.parametrize(
    "data",
    [
        '{"t":[["x"]],"k":[[]],"d":0}',  # a token that is not an int
        '{"t":[[1,-2]],"k":[[]],"d":0}',  # a negative token id
        '{"t":[[1,2]],"k":[],"d":0}',  # keys and turns differ in length
        '{"t":[[1,2]],"k":[[""]],"d":0}',  # an empty chunk key
        '{"t":[[1]],"k":[["a"]]}',  # no dropped count
        "[1, 2]",
        "not json",
    ],
)
def test_malformed_stored_history_is_refused_and_changes_nothing(
    tmp_path: Path, data: str
) -> None:
    url = f"sqlite://{tmp_path / 's.db'}"
    store_a, store_b = open_store(url), open_store(url)
    a, b = _engine(store_a, None), _engine(store_b, None)
    chunks = make_chunks(4, words=12)
    try:
        a.generate(chunks[:2], "q1", conversation_id=CONV, max_tokens=3)
        assert store_a.put_history(DEFAULT_NAMESPACE, CONV, 10**6, data, None)
        before = store_a.get_history(DEFAULT_NAMESPACE, CONV)
        with pytest.raises(StoreCorrupted, match=CONV) as info:
            b.generate(chunks[1:3], "q2", conversation_id=CONV, max_tokens=3)
        assert isinstance(info.value, ValueError)
        assert b.conversations.turn_count(CONV) == 0
        assert store_b.get_history(DEFAULT_NAMESPACE, CONV) == before
        planner = b.planner
        assert not planner.in_flight(CONV)  # type: ignore[attr-defined]
        # Worker A's copy is unaffected and newer than nothing: its own view still works
        # once the entry is fixed (ended) by the operator.
        assert a.conversations.turn_count(CONV) == 1
    finally:
        for x in (a, b, store_a, store_b):
            x.close()


def test_without_a_store_nothing_is_stored() -> None:
    backend = FakeBackend()
    engine = CraftEngine(
        backend=backend,
        tokenizer=HashingTokenizer(),
        prompt_format=FAKE_FORMAT,
        block_hasher=backend.hasher,
        chat_renderer=jinja_renderer(CHATML),
    )
    try:
        engine.generate(make_chunks(2), "q", conversation_id=CONV, max_tokens=2)
        assert engine.conversations.version(CONV) == 0
        assert engine.conversations.turn_count(CONV) == 1
    finally:
        engine.close()


def test_history_primitives_keep_the_newest_version(make_store: StoreFactory) -> None:
    """put_history keeps only newer versions; get_history pairs it with the conversation
    record's last seq; clear() removes it (every backend)."""
    store, other = make_store(), make_store()
    assert store.get_history("ns", CONV) == HistoryRecord(0)
    store.append("ns", "{}", since=0, conversation=CONV)
    assert store.put_history("ns", CONV, 1, "one", None)
    assert not other.put_history("ns", CONV, 1, "stale", None)
    assert not other.put_history("ns", CONV, 0, "older", None)
    assert other.get_history("ns", CONV) == HistoryRecord(1, 1, "one")
    store.append("ns", "{}", since=1, conversation=CONV)
    assert other.put_history("ns", CONV, 2, "two", 60.0)
    assert store.get_history("ns", CONV) == HistoryRecord(2, 2, "two")
    assert store.get_history("ns", "another") == HistoryRecord(0)
    assert store.get_history("other-ns", CONV) == HistoryRecord(0)
    store.clear("ns")
    assert other.get_history("ns", CONV) == HistoryRecord(0)


@pytest.mark.engine
def test_real_engine_turn_continues_on_another_worker(
    craft_engine: CraftEngine, tmp_path: Path
) -> None:
    """Worker A is the real vLLM engine (its reply is the model's), worker B a fake-backend
    engine with A's tokenizer and prompt format on the same SQLite store: B's turn 2 continues
    A's turn-1 prompt, reply and answer close token for token, and A's turn 3 continues B's."""
    from craft_rag.planner import CraftPlanner, PlannerConfig

    url = f"sqlite://{tmp_path / 's.db'}"
    craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree"), store=url))
    backend = FakeBackend(max_model_len=craft_engine.max_model_len)
    b = CraftEngine(
        backend=backend,
        tokenizer=craft_engine.assembler.tokenizer,
        prompt_format=craft_engine.prompt_format,
        chat_prompt_format=craft_engine.chat_prompt_format,  # the workers render alike
        block_hasher=backend.hasher,
        chat_renderer=jinja_renderer(CHATML),
        store=url,
    )
    chunks = make_chunks(5, words=10)
    close = craft_engine.assembler.answer_ids("")
    stops = craft_engine._backend.eos_token_ids
    conv = "real-chat"

    def stored(r: GenerationResult) -> tuple[int, ...]:
        reply = list(r.token_ids)
        while reply and reply[-1] in stops:
            reply.pop()
        return r.prompt_token_ids + tuple(reply) + close

    try:
        r1 = craft_engine.generate(chunks[:3], "what is w1?", conversation_id=conv, max_tokens=4)
        r2 = b.generate(chunks[1:4], "and w2?", conversation_id=conv, max_tokens=4)
        assert set(r2.report.removed_duplicates) == {chunks[1].key, chunks[2].key}
        b_part = b.conversations.turn_token_count([chunks[3]], "and w2?", conv)
        assert r2.prompt_token_ids[: len(stored(r1))] == stored(r1)
        assert len(r2.prompt_token_ids) == len(stored(r1)) + b_part
        r3 = craft_engine.generate(
            [chunks[3], chunks[4]], "compare", conversation_id=conv, max_tokens=4
        )
        assert r3.report.turn == 3
        assert r3.report.removed_duplicates == (chunks[3].key,)
        assert r3.prompt_token_ids[: len(stored(r2))] == stored(r2)
        assert r3.report.prefix_tokens == len(stored(r2))
    finally:
        b.close()
        craft_engine.end_conversation(conv)
        craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
