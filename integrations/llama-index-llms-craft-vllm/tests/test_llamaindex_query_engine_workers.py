"""One conversation through ``craft_query_engine`` alternating between two workers (issue 25):
two ``CraftEngine`` instances on one SQLite file or one real redis-server. Worker B's turn
continues worker A's prompt token for token (A's prompt, reply and answer close), with the
dedup one worker gives, and a turn that must drop earlier turns to fit never counts a dropped
turn's chunk as "already sent". Real engines (planners, tokenizer, prompt assembly, stores) over
a fake forward pass (two vLLM engines cannot share one process); the ``engine`` test puts the
real vLLM engine (session fixture) in worker A's place."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.craft_vllm import CraftVLLM, craft_query_engine

from craft_rag.engine import ReuseReport
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine
from craft_rag.stores import StateStore, open_store
from craft_rag.testing import CHATML, FakeBackend, make_fake_engine

CONV = "qe-chat"


def passage(i: int, words: int = 12) -> NodeWithScore:
    """A node whose text is the same on every worker (keys are content hashes on a shared
    store: each worker builds its own nodes with other random ids)."""
    text = " ".join(f"p{i}w{j}" for j in range(words))
    return NodeWithScore(node=TextNode(text=text), score=1.0)


class Fixed(BaseRetriever):
    def __init__(self, nodes: Sequence[NodeWithScore]) -> None:
        super().__init__()
        self.nodes = list(nodes)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return list(self.nodes)


def fake_engine(store: StateStore | str, max_model_len: int = 1024) -> CraftEngine:
    return make_fake_engine(FakeBackend(max_model_len=max_model_len), store=store)[0]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    """A real redis-server database: ``CRAFT_RAG_TEST_REDIS``, else one started here."""
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    from craft_rag.stores.local_redis import local_redis

    with local_redis() as started:
        yield started


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'state.db'}"
    import redis

    url = str(request.getfixturevalue("redis_server"))
    client = redis.Redis.from_url(url)
    client.flushdb()  # the test's own database: start empty
    client.close()
    return url


class Workers:
    """Fake-backend engines on stores of one URL (one connection each), closed by
    :meth:`close`; ``CraftVLLM`` s over them; the prompts each engine's backend received."""

    def __init__(self, urls: Sequence[str], max_model_len: int = 1024) -> None:
        self.stores = [open_store(u) for u in urls]
        self.engines = [fake_engine(s, max_model_len) for s in self.stores]
        self.llms = [CraftVLLM(e, max_tokens=2) for e in self.engines]

        self.prompts: list[tuple[int, ...]] = []
        """The prompt of each turn :meth:`ask` served, in turn order."""

    def ask(
        self, worker: int, nodes: Sequence[NodeWithScore], question: str, **kw: Any
    ) -> ReuseReport:
        """One turn of the conversation through ``craft_query_engine`` on ``worker``."""
        report = ask(self.llms[worker], nodes, question, **kw)
        backend = self.engines[worker]._backend
        assert isinstance(backend, FakeBackend)
        self.prompts.append(backend.added[-1][1])
        return report

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for s in self.stores:
            s.close()


def ask(llm: CraftVLLM, nodes: Sequence[NodeWithScore], question: str, **kw: Any) -> ReuseReport:
    engine = craft_query_engine(Fixed(nodes), llm, conversation_id=CONV, **kw)
    response = engine.query(question)
    assert isinstance(response, Response)
    report = (response.metadata or {}).get("craft_reuse")
    assert isinstance(report, ReuseReport), f"no engine call: {response.response!r}"
    return report


# Turn i: the passages retrieved and the question. Turn 2 retrieves only passages sent in turn 1
# (the synthesizer gets no node: the turn still goes to the engine); turn 3 one old, one new.
TURNS: list[tuple[list[int], str]] = [
    ([0, 1], "what is p0?"),
    ([1, 0], "and p1?"),
    ([2, 0], "compare p2"),
    ([3, 2], "last one"),
]


def serve(workers: Workers) -> list[ReuseReport]:
    """Turn i on worker ``i % n``; each call builds its own nodes (as a worker does)."""
    n = len(workers.llms)
    return [
        workers.ask(i % n, [passage(j) for j in idx], question)
        for i, (idx, question) in enumerate(TURNS)
    ]


def test_turns_alternating_workers_render_what_one_worker_renders(
    store_url: str, tmp_path: Path
) -> None:
    one = Workers([f"sqlite://{tmp_path / 'ref.db'}"])
    two = Workers([store_url, store_url])
    try:
        want = serve(one)
        got = serve(two)  # turns 1, 3 on A; 2, 4 on B
    finally:
        one.close()
        two.close()
    assert [r.turn for r in got] == [1, 2, 3, 4]
    assert two.prompts == one.prompts
    for g, w in zip(got, want, strict=True):
        assert g.chunk_order == w.chunk_order
        assert g.removed_duplicates == w.removed_duplicates
    # Cross-worker dedup: B's turn 2 sent nothing again, A's turn 3 only the new passage.
    assert got[1].chunk_order == () and len(got[1].removed_duplicates) == 2
    assert len(got[2].chunk_order) == 1 and len(got[2].removed_duplicates) == 1
    # Append-only across workers: each prompt starts with the previous one (and its reply).
    for prev, nxt in itertools.pairwise(two.prompts):
        assert nxt[: len(prev)] == prev


@pytest.mark.parametrize("shape", ["two-workers", "one-worker"])
def test_a_turn_that_drops_earlier_turns_resends_their_chunks(store_url: str, shape: str) -> None:
    """Turn 3 (worker A) needs the room of turn 1 (served by A) and turn 2 (served by B, or
    by A too): the engine drops them before the turn is planned, so passage 0, sent in turn 1,
    is sent again instead of being "deduplicated" against a turn no longer in the prompt (on
    one worker that plan used to be refused at render time: "plan ... removed chunks ... as
    already sent, but the turns carrying them were dropped")."""
    two = Workers([store_url, store_url], max_model_len=512)
    second = 1 if shape == "two-workers" else 0
    try:
        two.ask(0, [passage(0, words=150)], "first?")
        two.ask(second, [passage(1, words=150)], "second?")
        third = two.ask(0, [passage(0, words=150), passage(2, words=150)], "third?")
    finally:
        two.close()
    assert third.turn == 3
    assert third.dropped_turns >= 1
    assert third.removed_duplicates == ()
    assert len(third.chunk_order) == 2
    assert len(two.prompts[2]) <= 512 - 2


def test_a_second_query_engine_on_one_worker_follows_a_turn_of_the_other(
    store_url: str,
) -> None:
    """The reported failure: worker B's first turn of a conversation A started
    ("a turn served by another worker is not in this worker's history")."""
    two = Workers([store_url, store_url])
    try:
        two.ask(0, [passage(0)], "one?")
        report = two.ask(1, [passage(1)], "two?")
    finally:
        two.close()
    assert report.turn == 2
    assert report.prefix_tokens > 0  # rendered after A's turn


def test_every_node_sent_before_still_answers_and_frees_the_conversation() -> None:
    """One worker: a follow-up whose passages were all sent earlier is served without chunks
    (it used to be LlamaIndex's "Empty Response" with the parked plan left in flight, so the
    next turn failed with "has a plan in flight")."""
    one = Workers(["memory://"])
    try:
        (llm,) = one.llms
        ask(llm, [passage(0), passage(1)], "q1")
        second = ask(llm, [passage(1), passage(0)], "q2")
        third = ask(llm, [passage(0), passage(2)], "q3")
    finally:
        one.close()
    assert second.turn == 2 and second.chunk_order == ()
    assert len(second.removed_duplicates) == 2
    assert third.turn == 3 and len(third.chunk_order) == 1


@pytest.mark.parametrize("retrieved", [[0], [2]], ids=["all-sent-before", "new-passage"])
@pytest.mark.parametrize("streaming", [False, True], ids=["blocking", "streaming"])
def test_a_failed_turn_leaves_no_plan_in_flight(retrieved: list[int], streaming: bool) -> None:
    """A turn the engine refuses (here a question longer than the context) aborts the plan the
    query engine made for it: the next turn is served (it used to be refused with "has a plan
    in flight" until the conversation's TTL). Both the parked all-duplicates plan and a plan
    with chunks, blocking and streaming."""
    one = Workers(["memory://"])
    try:
        (llm,) = one.llms
        ask(llm, [passage(0)], "q1")
        engine = craft_query_engine(
            Fixed([passage(j) for j in retrieved]), llm, conversation_id=CONV, streaming=streaming
        )
        with pytest.raises(ValueError, match="max_model_len"):
            response = engine.query("why " * 2000)
            if isinstance(response, StreamingResponse):  # fails once read
                "".join(response.response_gen)
        assert llm.planner.waiting() == 0
        after = ask(llm, [passage(3)], "q3")
    finally:
        one.close()
    assert after.turn == 2 and len(after.chunk_order) == 1


def test_no_conversation_and_no_nodes_is_still_the_empty_response() -> None:
    one = Workers(["memory://"])
    try:
        (llm,) = one.llms
        response = craft_query_engine(Fixed([]), llm).query("anything")
    finally:
        one.close()
    assert str(response) == "Empty Response"


def test_reorderer_max_tokens_is_checked_and_defaults_to_the_llm() -> None:
    one = Workers(["memory://"])
    try:
        (llm,) = one.llms
        reorderer = llm.reorderer(conversation_id=CONV, keeps_earlier_chunks=True)
        assert reorderer.max_tokens == llm.max_tokens  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
            llm.reorderer(max_tokens=0)
    finally:
        one.close()


@pytest.mark.engine
def test_real_engine_query_engine_turns_alternate_with_another_worker(
    craft_engine: CraftEngine, tmp_path: Path, submitted: list[tuple[int, ...]]
) -> None:
    """Worker A is the real vLLM engine (its replies are the model's), worker B a fake-backend
    engine with A's tokenizer and prompt format on the same SQLite store; turns A, B, A through
    ``craft_query_engine``: each prompt continues the previous one token for token."""
    from craft_rag.planner import CraftPlanner, PlannerConfig

    url = f"sqlite://{tmp_path / 's.db'}"
    craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree"), store=url))
    backend = FakeBackend(max_model_len=craft_engine.max_model_len)
    b_engine = CraftEngine(
        backend=backend,
        tokenizer=craft_engine.assembler.tokenizer,
        prompt_format=craft_engine.prompt_format,
        chat_prompt_format=craft_engine.chat_prompt_format,  # the workers render alike
        block_hasher=backend.hasher,
        chat_renderer=jinja_renderer(CHATML),
        store=url,
    )
    a, b = CraftVLLM(craft_engine, max_tokens=4), CraftVLLM(b_engine, max_tokens=4)
    try:
        r1 = ask(a, [passage(0), passage(1)], "what is p0?")
        r2 = ask(b, [passage(1), passage(2)], "and p2?")
        r3 = ask(a, [passage(2), passage(3)], "compare them")
    finally:
        b_engine.close()
        craft_engine.end_conversation(CONV)
        craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    assert [r1.turn, r2.turn, r3.turn] == [1, 2, 3]
    assert len(r2.removed_duplicates) == 1 and len(r3.removed_duplicates) == 1
    p1, p3 = submitted
    p2 = backend.added[0][1]
    assert p2[: len(p1)] == p1  # B's turn continues A's real prompt (and A's reply after it)
    assert p3[: len(p2)] == p2  # A's turn 3 continues B's turn 2
    assert r3.prefix_tokens >= len(p2)
