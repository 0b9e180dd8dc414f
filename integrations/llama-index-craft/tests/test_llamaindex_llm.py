"""CraftVLLM against the real in-process engine (the shared ``craft_engine`` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.llms.craft_vllm import REUSE_KEY, CraftVLLM, HandoffPlanner

from craft_rag import CraftPlanner, make_chunk
from craft_rag.engine.results import GenerationResult, ReuseReport

pytestmark = pytest.mark.engine

MAX_TOKENS = 4
LONG_SYSTEM = "You are a terse assistant. Answer in one word. " * 6
"""Long enough (> 2 KV blocks of 32 tokens) that a repeated prompt has full blocks to reuse."""


@pytest.fixture
def llm(craft_engine: Any) -> Iterator[CraftVLLM]:
    craft_engine.reset_prefix_cache()
    yield CraftVLLM(craft_engine, planner=CraftPlanner(), max_tokens=MAX_TOKENS)


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
    assert isinstance(craft_engine.planner, HandoffPlanner)
    assert llm.planner is craft_engine.planner.planner


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


def test_complete_chunks_reports_the_served_order(llm: CraftVLLM) -> None:
    chunks = [make_chunk(f"Fact {i}: the number {i} is lucky.", id=f"c{i}") for i in range(3)]
    first = llm.complete_chunks(chunks, "Which number is lucky?")
    again = llm.complete_chunks(list(reversed(chunks)), "Which number is lucky?")
    r1, r2 = _report(first), _report(again)
    assert r2.chunk_order == r1.chunk_order  # CRAFT gave the chunk set its cached order back
    assert r2.reused_chunks == 3 and r2.cached_tokens > r1.cached_tokens
    assert llm.planner.stats.commits == 2


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
    with pytest.raises(ValueError, match="not both"):
        CraftVLLM(llm.engine, engine_settings=llm.engine.settings)
    with pytest.raises(ValueError, match="CraftEngine"):
        CraftVLLM(engine="not an engine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set by CraftVLLM\.reorderer"):
        llm.reorderer(commit_mode="postprocess")


def test_a_second_llm_on_the_engine_shares_the_adapter(llm: CraftVLLM, craft_engine: Any) -> None:
    other = CraftVLLM(craft_engine)
    assert other.handoff_planner is llm.handoff_planner
    other.close()  # a shared engine is not stopped
    assert llm.complete("Say hi.").text is not None
