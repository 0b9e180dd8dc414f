"""CraftSynthesizer in a RetrieverQueryEngine and CraftChatEngine, on the real engine and a real
faiss index: the engine sees the planned order, token for token; chats stay append-only."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from craft_llm_support import assert_whole_prefix_reused
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import ImageNode, NodeWithScore
from llama_index.llms.craft_vllm import (
    REUSE_KEY,
    SKIPPED_KEY,
    CraftChatEngine,
    CraftSynthesizer,
    CraftVLLM,
    craft_query_engine,
)
from llama_index.postprocessor.craft import CraftCommitEvent, CraftReorderEndEvent, chunk_for_node
from llama_index.postprocessor.craft.testing import EventRecorder, SquadIndex, make_node, node_ids

from craft_rag import CraftPlanner, make_chunk
from craft_rag.engine.results import ReuseReport

pytestmark = [pytest.mark.engine, pytest.mark.retrieval]

TOP_K = 3
MAX_TOKENS = 3


@pytest.fixture
def llm(craft_engine: Any) -> Iterator[CraftVLLM]:
    craft_engine.reset_prefix_cache()
    craft_engine.set_planner(CraftPlanner())  # a fresh planner: the test's choice, not CraftVLLM's
    yield CraftVLLM(craft_engine, max_tokens=MAX_TOKENS)


def _meta(response: Any) -> dict[str, Any]:
    metadata = response.metadata
    assert isinstance(metadata, dict)
    return metadata


def _find(haystack: tuple[int, ...], needle: tuple[int, ...]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def _assert_prompt_order(engine: Any, prompt: tuple[int, ...], nodes: list[NodeWithScore]) -> None:
    """Each node's text is in the prompt as its own token-exact chunk, in ``nodes`` order."""
    positions = []
    for n in nodes:
        ids = engine.assembler.chunk_ids(make_chunk(n.node.get_content(), id=n.node.node_id))
        positions.append(_find(prompt, ids))
    assert -1 not in positions, "a chunk was not sent token-exactly"
    assert positions == sorted(positions)


def test_query_engine_sends_the_planned_order_token_exactly(
    llm: CraftVLLM, squad_index: SquadIndex, events: EventRecorder, submitted: list[Any]
) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    qe = craft_query_engine(retriever, llm)
    assert isinstance(qe, RetrieverQueryEngine)
    q1, q2 = squad_index.questions[0], squad_index.questions[1]
    responses = [qe.query(q) for q in (q1, q2, q1)]
    plans = [e.plan for e in events.of(CraftReorderEndEvent)]
    reports = [_meta(r)[REUSE_KEY] for r in responses]
    for response, plan, report, prompt in zip(responses, plans, reports, submitted, strict=True):
        assert isinstance(report, ReuseReport)
        assert tuple(node_ids(response.source_nodes)) == plan.keys == report.chunk_order
        assert report.plan_id == plan.plan_id  # the engine served the postprocessor's plan
        _assert_prompt_order(llm.engine, prompt, response.source_nodes)
    # Planned once by the postprocessor, served and committed once by the engine.
    commits = events.of(CraftCommitEvent)
    assert [c.source for c in commits] == ["engine"] * 3
    assert [c.plan for c in commits] == plans and [c.reuse for c in commits] == reports
    assert llm.planner.stats.plans == 3 and llm.planner.stats.commits == 3
    assert llm.planner.waiting() == 0  # every parked plan was claimed
    # Asking q1 again: its whole chunk prefix is reused.
    assert reports[2].reused_chunks == TOP_K
    assert reports[2].cached_tokens > reports[0].cached_tokens


def test_streaming_and_async_query_engines(llm: CraftVLLM, squad_index: SquadIndex) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    q = squad_index.questions[2]
    plain = craft_query_engine(retriever, llm).query(q)
    streaming = craft_query_engine(retriever, llm, streaming=True).query(q)
    assert isinstance(streaming, StreamingResponse)
    text = "".join(streaming.response_gen)
    assert text == str(plain)
    report = _meta(streaming)[REUSE_KEY]
    assert report.reused_chunks == TOP_K and report.cached_tokens > 0


async def test_async_query_engine(llm: CraftVLLM, squad_index: SquadIndex) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    q = squad_index.questions[3]
    done = await craft_query_engine(retriever, llm).aquery(q)
    streaming = await craft_query_engine(retriever, llm, streaming=True).aquery(q)
    assert isinstance(streaming, AsyncStreamingResponse)
    text = "".join([d async for d in streaming.async_response_gen()])
    assert text == str(done)
    chunks = [chunk_for_node(n, "node_id") for n in retriever.retrieve(q)]
    assert_whole_prefix_reused(llm.engine, chunks, _meta(streaming)[REUSE_KEY])


def test_synthesizer_keeps_non_text_nodes_as_sources(llm: CraftVLLM) -> None:
    synth = CraftSynthesizer(llm)
    image = NodeWithScore(node=ImageNode(id_="img", image_url="https://e.com/x.png"))
    nodes = [make_node(1, "Paris is the capital of France."), image]
    response = synth.synthesize("What is the capital of France?", nodes)
    assert response.source_nodes == nodes
    assert _meta(response)[SKIPPED_KEY] == ["img"]
    assert _meta(response)[REUSE_KEY].chunk_order == ("n1",)
    assert str(synth.synthesize("anything", [])) == "Empty Response"
    with pytest.raises(ValueError, match="CraftVLLM"):
        CraftSynthesizer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_salt"):
        craft_query_engine(object(), llm, cache_salt="another")  # type: ignore[arg-type]


def test_chat_engine_is_append_only_and_dedups(
    llm: CraftVLLM, squad_index: SquadIndex, submitted: list[Any]
) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    memory = ChatMemoryBuffer.from_defaults(llm=llm)
    # condense=False: turn 3 must retrieve exactly turn 1's chunks (the raw question).
    chat = CraftChatEngine(
        retriever, llm, memory=memory, conversation_id="li-chat-test", condense=False
    )
    questions = squad_index.questions[:2]
    first = chat.chat(questions[0])
    r1 = chat.last_reuse_report
    second = chat.chat(questions[1])
    r2 = chat.last_reuse_report
    third = chat.chat(questions[0])  # same retrieval as turn 1: every chunk already sent
    r3 = chat.last_reuse_report
    assert r1 and r2 and r3
    assert (r1.turn, r2.turn, r3.turn) == (1, 2, 3)
    # Append-only: each prompt starts with the previous one; cached tokens rise turn by turn.
    assert submitted[1][: len(submitted[0])] == submitted[0]
    assert submitted[2][: len(submitted[1])] == submitted[1]
    assert r1.cached_tokens < r2.cached_tokens < r3.cached_tokens
    block = llm.engine.block_size
    assert r3.cached_tokens >= r2.prompt_tokens // block * block  # all of turn 2's full blocks
    # Turn 3 retrieved turn 1's chunks again: nothing new is sent, all are reported as sources.
    assert r3.chunk_order == () and len(r3.removed_duplicates) == TOP_K
    assert {n.node.node_id for n in third.source_nodes} == set(r1.chunk_order)
    assert chat.last_reorder is not None and len(chat.last_reorder.removed_duplicates) == TOP_K
    # LlamaIndex memory holds the messages.
    history = chat.chat_history
    assert [m.role.value for m in history] == ["user", "assistant"] * 3
    assert history[1].content == str(first) and history[3].content == str(second)


async def test_chat_engine_streaming_and_async(llm: CraftVLLM, squad_index: SquadIndex) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    chat = CraftChatEngine(retriever, llm)
    q = squad_index.questions[4:7]
    streamed = chat.stream_chat(q[0])
    text = "".join(streamed.response_gen)
    r1 = chat.last_reuse_report
    answer = await chat.achat(q[1])
    r2 = chat.last_reuse_report
    astreamed = await chat.astream_chat(q[2])
    atext = "".join([d async for d in astreamed.async_response_gen()])
    r3 = chat.last_reuse_report
    assert r1 and r2 and r3 and r1.cached_tokens < r2.cached_tokens <= r3.cached_tokens
    # Each turn reuses every full block of the previous turn's prompt (a further block only
    # when that turn's reply completes one: block alignment, not a guarantee).
    block = llm.engine.block_size
    assert r2.cached_tokens >= r1.prompt_tokens // block * block
    assert r3.cached_tokens >= r2.prompt_tokens // block * block
    history = chat.chat_history
    assert [m.content for m in history[1::2]] == [text.strip(), str(answer), atext.strip()]
    with pytest.raises(ValueError, match="cannot replace its history"):
        chat.chat("again", chat_history=[])
    chat.reset()
    assert chat.chat_history == []
    chat.chat(q[0])
    assert chat.last_reuse_report is not None and chat.last_reuse_report.turn == 1


def test_chat_sessions_in_two_salts_share_nothing(
    llm: CraftVLLM, squad_index: SquadIndex, craft_engine: Any
) -> None:
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    salt = f"li-tenant-{uuid.uuid4().hex[:8]}"
    questions = squad_index.questions[7:9]
    salted = CraftChatEngine(retriever, llm, cache_salt=salt, conversation_id="li-salted")
    salted.chat(questions[0])
    salted.chat(questions[1])
    r2 = salted.last_reuse_report
    assert r2 is not None and r2.salted and r2.turn == 2 and r2.cached_tokens > 0
    # The session's salt has its own planner; the LLM's (unsalted) planner saw nothing.
    assert llm.planner_for(salt).stats.commits == 2 and llm.planner.stats.commits == 0
    # The same turn in the unsalted namespace finds nothing of the salted session's KV.
    plain = CraftChatEngine(retriever, llm, conversation_id="li-plain")
    plain.chat(questions[0])
    first = plain.last_reuse_report
    assert first is not None and not first.salted and first.cached_tokens == 0
    # A conversation is its salt's: the same id unsalted is another tenant's (a first turn),
    # and resetting that one leaves the salted session's turns alone.
    answer = llm.complete_chunks([], questions[1], conversation_id="li-salted")
    other = answer.additional_kwargs[REUSE_KEY]
    assert other.turn == 1 and not other.salted
    llm.engine.end_conversation("li-salted")
    assert llm.engine.turn_count("li-salted", cache_salt=salt) == 2
    salted.reset()
    assert llm.engine.turn_count("li-salted", cache_salt=salt) == 0
