"""CraftVLLM against the real in-process engine (the shared ``craft_engine`` fixture)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from craft_llm_support import assert_whole_prefix_reused
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.llms.craft_vllm import REUSE_KEY, CraftVLLM
from llama_index.postprocessor.craft import CraftCommitEvent
from llama_index.postprocessor.craft.testing import EventRecorder

from craft_rag import CraftPlanner, make_chunk
from craft_rag.engine.results import GenerationResult, ReuseReport

pytestmark = pytest.mark.engine

MAX_TOKENS = 4
LONG_SYSTEM = "You are a terse assistant. Answer in one word. " * 6
"""Long enough (> 2 KV blocks of 32 tokens) that a repeated prompt has full blocks to reuse."""


@pytest.fixture
def llm(craft_engine: Any) -> Iterator[CraftVLLM]:
    # A fresh planner per test is the test's decision, made on the engine: CraftVLLM itself
    # never replaces the engine's planner (that would forget its conversations).
    craft_engine.reset_prefix_cache()
    craft_engine.set_planner(CraftPlanner())
    yield CraftVLLM(craft_engine, max_tokens=MAX_TOKENS)


def _salt(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _report(response: Any) -> ReuseReport:
    report = response.additional_kwargs[REUSE_KEY]
    assert isinstance(report, ReuseReport)
    assert isinstance(response.raw, GenerationResult) and response.raw.report is report
    return report


def test_metadata_comes_from_the_engine(llm: CraftVLLM, craft_engine: Any) -> None:
    meta = llm.metadata
    assert meta.context_window == craft_engine.max_model_len
    assert meta.num_output == MAX_TOKENS
    assert meta.is_chat_model
    assert CraftVLLM.class_name() == "CraftVLLM"
    assert llm.planner is craft_engine.planner  # the engine's own, not a wrapper


def test_complete_reports_reuse_and_the_second_call_hits_the_cache(llm: CraftVLLM) -> None:
    prompt = "List three colours of the rainbow. " * 8
    first = llm.complete(prompt)
    second = llm.complete(prompt)
    r1, r2 = _report(first), _report(second)
    assert first.text == second.text  # greedy
    assert 0 < r1.output_tokens <= MAX_TOKENS
    assert r2.prompt_tokens == r1.prompt_tokens
    assert r2.cached_tokens > r1.cached_tokens
    assert r2.cached_tokens >= r2.prompt_tokens - llm.engine.block_size


def test_stream_complete_yields_deltas_as_generated(llm: CraftVLLM) -> None:
    pieces = list(llm.stream_complete("Count: one, two, three,", max_tokens=6))
    deltas = [p.delta for p in pieces if p.delta]
    assert len(deltas) >= 2  # really streamed, not one blob
    final = pieces[-1]
    assert final.delta == "" and final.text == "".join(deltas)
    assert _report(final).output_tokens == 6 or final.raw.finish_reason == "stop"


def test_chat_and_stream_chat_agree(llm: CraftVLLM) -> None:
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content=LONG_SYSTEM),
        ChatMessage(role=MessageRole.USER, content="What is the capital of France?"),
    ]
    full = llm.chat(messages)
    streamed = list(llm.stream_chat(messages))
    assert full.message.role == MessageRole.ASSISTANT
    assert streamed[-1].message.content == full.message.content
    assert _report(streamed[-1]).cached_tokens > 0  # the same chat prompt again


async def test_async_forms_stream_for_real(llm: CraftVLLM) -> None:
    prompt = LONG_SYSTEM + "Name a fruit that is yellow."
    done = await llm.acomplete(prompt)
    deltas = [r.delta async for r in await llm.astream_complete(prompt) if r.delta]
    assert "".join(deltas) == done.text
    messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
    chat = await llm.achat(messages)
    chat_pieces = [r async for r in await llm.astream_chat(messages)]
    assert chat_pieces[-1].message.content == chat.message.content
    assert _report(chat_pieces[-1]).cached_tokens > 0


def test_complete_chunks_reports_the_served_order(llm: CraftVLLM, events: EventRecorder) -> None:
    chunks = [make_chunk(f"Fact {i}: the number {i} is lucky.", id=f"c{i}") for i in range(3)]
    first = llm.complete_chunks(chunks, "Which number is lucky?")
    again = llm.complete_chunks(list(reversed(chunks)), "Which number is lucky?")
    r1, r2 = _report(first), _report(again)
    assert r2.chunk_order == r1.chunk_order  # CRAFT gave the chunk set its cached order back
    assert r2.cached_tokens > r1.cached_tokens
    assert_whole_prefix_reused(llm.engine, chunks, r2)
    assert llm.planner.stats.plans == 2 and llm.planner.stats.commits == 2
    # Each served plan's commit is reported once, with the engine's report.
    commits = events.of(CraftCommitEvent)
    assert [c.source for c in commits] == ["engine", "engine"]
    assert [c.reuse for c in commits] == [r1, r2]
    assert [c.plan.plan_id for c in commits] == [r1.plan_id, r2.plan_id]
    assert all(c.result is None for c in commits)


async def test_every_chunk_form_serves_and_commits_a_given_plan(
    llm: CraftVLLM, events: EventRecorder
) -> None:
    chunks = [make_chunk(f"Note {i}: blue is colour {i}.", id=f"b{i}") for i in range(2)]
    served = []
    for form in ("sync", "stream", "async", "astream"):
        plan = llm.planner.plan(chunks)
        if form == "sync":
            final = llm.complete_chunks(plan.ordered, "Which colour?", plan=plan)
        elif form == "stream":
            final = list(llm.stream_complete_chunks(plan.ordered, "Which colour?", plan=plan))[-1]
        elif form == "async":
            final = await llm.acomplete_chunks(plan.ordered, "Which colour?", plan=plan)
        else:
            pieces = llm.astream_complete_chunks(plan.ordered, "Which colour?", plan=plan)
            final = [r async for r in pieces][-1]
        served.append((plan, _report(final)))
    assert all(report.plan_id == plan.plan_id for plan, report in served)
    assert llm.planner.stats.plans == 4 and llm.planner.stats.commits == 4  # planned once each
    assert [c.plan for c in events.of(CraftCommitEvent)] == [plan for plan, _ in served]
    # A plan is served once: the engine refuses a committed one before anything runs.
    with pytest.raises(RuntimeError, match="not waiting for a commit"):
        llm.complete_chunks(chunks, "Which colour?", plan=served[0][0])
    with pytest.raises(ValueError, match="question"):
        llm.complete_chunks(chunks, " ")


def test_chat_reuses_the_earlier_messages_token_exactly(llm: CraftVLLM, craft_engine: Any) -> None:
    system = ChatMessage(role=MessageRole.SYSTEM, content=LONG_SYSTEM)
    ask = ChatMessage(role=MessageRole.USER, content="Name a red fruit.")
    first = llm.chat([system, ask])
    turns = [("system", LONG_SYSTEM), ("user", "Name a red fruit.")]
    assert first.raw.prompt_token_ids == craft_engine.message_token_ids(turns)
    follow_up = [system, ask, first.message, ChatMessage(role=MessageRole.USER, content="Why?")]
    second = llm.chat(follow_up)
    r1, r2 = _report(first), _report(second)
    block = craft_engine.block_size
    # Every full block of the first prompt is reused by the longer chat.
    assert r2.cached_tokens >= r1.prompt_tokens // block * block > 0
    head = r1.prompt_tokens // block * block
    assert second.raw.prompt_token_ids[:head] == first.raw.prompt_token_ids[:head]
    assert r1.plan_id is None and r1.chunk_order == ()  # plain chat: nothing planned


def test_two_salts_share_nothing(llm: CraftVLLM, craft_engine: Any) -> None:
    salt_a, salt_b = _salt("tenant-a"), _salt("tenant-b")
    a = CraftVLLM(craft_engine, cache_salt=salt_a, max_tokens=MAX_TOKENS)
    b = CraftVLLM(craft_engine, cache_salt=salt_b, max_tokens=MAX_TOKENS)
    assert a.planner is craft_engine.planner_for(salt_a)
    assert len({id(a.planner), id(b.planner), id(llm.planner)}) == 3
    prompt = LONG_SYSTEM + "Name a green vegetable."
    a.complete(prompt)
    warm = _report(a.complete(prompt))
    other = _report(b.complete(prompt))
    assert warm.salted and other.salted
    assert warm.cached_tokens > 0 and other.cached_tokens == 0
    # A per-call salt overrides the field; the unsalted namespace shares nothing either.
    assert _report(llm.complete(prompt)).cached_tokens == 0
    assert _report(llm.complete(prompt, cache_salt=salt_a)).cached_tokens == warm.cached_tokens
    # Chunk requests: each salt's own planner plans and commits; no reuse across salts.
    chunks = [make_chunk(f"Tenant fact {i}: {LONG_SYSTEM}", id=f"t{i}") for i in range(2)]
    a.complete_chunks(chunks, "Which fact?")
    again = _report(a.complete_chunks(chunks, "Which fact?"))
    cold = _report(b.complete_chunks(chunks, "Which fact?"))
    assert_whole_prefix_reused(craft_engine, chunks, again)
    assert cold.cached_tokens == 0 and cold.reused_chunks == 0
    assert (a.planner.stats.commits, b.planner.stats.commits) == (2, 1)
    assert llm.planner.stats.commits == 0


def test_bad_input_raises_clear_errors(llm: CraftVLLM) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        llm.complete("")
    with pytest.raises(ValueError, match="unknown keyword"):
        llm.complete("hi", beam_width=3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.complete("word " * 3000)
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([])
    image = ChatMessage(
        role=MessageRole.USER, blocks=[TextBlock(text="see"), ImageBlock(url="https://e.com/x.png")]
    )
    with pytest.raises(ValueError, match="text blocks only"):
        llm.chat([image])
    with pytest.raises(ValueError, match="engine= is a running engine"):
        CraftVLLM(llm.engine, engine_settings=llm.engine.settings)
    with pytest.raises(ValueError, match="CraftEngine"):
        CraftVLLM(engine="not an engine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set by CraftVLLM\.reorderer"):
        llm.reorderer(commit_mode="postprocess")
    with pytest.raises(ValueError, match="set_planner"):
        CraftVLLM(llm.engine, planner=CraftPlanner())
    with pytest.raises(ValueError, match="cache_salt"):
        CraftVLLM(llm.engine, cache_salt="a/b")
    with pytest.raises(ValueError, match="cache_salt"):
        llm.complete("hi", cache_salt="")


def test_a_second_llm_leaves_the_engine_and_its_conversations_alone(
    llm: CraftVLLM, craft_engine: Any
) -> None:
    chunks = [make_chunk(f"Harbour fact {i}: {LONG_SYSTEM}", id=f"h{i}") for i in range(2)]
    first = _report(llm.complete_chunks(chunks[:1], "First?", conversation_id="li-keep"))
    other = CraftVLLM(craft_engine)  # used to replace the engine's planner and wipe histories
    assert other.planner is llm.planner
    second = _report(llm.complete_chunks(chunks, "Second?", conversation_id="li-keep"))
    assert (first.turn, second.turn) == (1, 2)
    assert second.removed_duplicates == ("h0",) and second.chunk_order == ("h1",)
    block = craft_engine.block_size
    assert second.cached_tokens >= first.prompt_tokens // block * block
    other.close()  # a shared engine is not stopped
    assert llm.complete("Say hi.").text is not None
