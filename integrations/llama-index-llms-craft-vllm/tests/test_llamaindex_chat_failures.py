"""A failed turn of CraftChatEngine must not hang its conversation: every failure path (the
engine refuses the prompt, the engine fails while serving, a stream cut short) aborts the turn's
plan, and the next turn on the same conversation is served. Real in-process engine."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

from craft_rag import CraftPlanner

pytestmark = [pytest.mark.engine]

MODES = ("chat", "achat", "stream_chat", "astream_chat")
PASSAGE = "The Globe Theatre in London was built in 1599 by Shakespeare's playing company."
# Far over the test engine's max_model_len (2,048 tokens) on its own.
HUGE = " ".join(f"Filler sentence number {i} says nothing at all." for i in range(700))


class ScriptedRetriever(BaseRetriever):
    """Returns ``answers[i]`` (texts) on the i-th call, the last one from then on."""

    def __init__(self, answers: Sequence[Sequence[str]]) -> None:
        super().__init__()
        self.answers = [list(a) for a in answers]
        self.calls = 0

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        texts = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return [
            NodeWithScore(node=TextNode(id_=f"n-{hash(t) & 0xFFFF}", text=t), score=1.0)
            for t in texts
        ]


@pytest.fixture
def llm(craft_engine: Any) -> Iterator[CraftVLLM]:
    craft_engine.reset_prefix_cache()
    craft_engine.set_planner(CraftPlanner())
    yield CraftVLLM(craft_engine, max_tokens=4)


async def turn(chat: CraftChatEngine, mode: str, message: str) -> str:
    if mode == "chat":
        return chat.chat(message).response
    if mode == "achat":
        return (await chat.achat(message)).response
    if mode == "stream_chat":
        return "".join(chat.stream_chat(message).response_gen)
    response = await chat.astream_chat(message)
    return "".join([d async for d in response.async_response_gen()])


def in_flight(llm: CraftVLLM, chat: CraftChatEngine) -> bool:
    return llm.planner_for(chat.cache_salt).in_flight(chat.conversation_id)


def make_chat(llm: CraftVLLM, mode: str, first: Sequence[str]) -> CraftChatEngine:
    retriever = ScriptedRetriever([first, [PASSAGE]])
    conv = f"li-fail-{mode}-{uuid.uuid4().hex[:8]}"
    return CraftChatEngine(retriever, llm, condense=False, conversation_id=conv)


@pytest.mark.parametrize("mode", MODES)
async def test_a_retrieval_too_long_for_the_model_fails_and_the_next_turn_is_served(
    llm: CraftVLLM, mode: str
) -> None:
    chat = make_chat(llm, mode, [HUGE])
    with pytest.raises(ValueError, match="max_model_len"):
        await turn(chat, mode, "What does the filler say?")
    assert not in_flight(llm, chat)
    await turn(chat, mode, "When was the Globe built?")
    assert chat.last_reuse_report is not None and chat.last_reuse_report.turn == 1
    assert not in_flight(llm, chat)


@pytest.mark.parametrize("mode", MODES)
async def test_an_engine_failure_while_serving_leaves_no_plan_in_flight(
    llm: CraftVLLM, craft_engine: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    chat = make_chat(llm, mode, [PASSAGE])
    driver = craft_engine._driver
    original = driver.submit
    calls = {"n": 0}

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine failure (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(driver, "submit", failing_once)
    with pytest.raises(RuntimeError, match="injected"):
        await turn(chat, mode, "When was the Globe built?")
    assert not in_flight(llm, chat)
    await turn(chat, mode, "When was the Globe built?")
    assert chat.last_reuse_report is not None and chat.last_reuse_report.turn == 1
