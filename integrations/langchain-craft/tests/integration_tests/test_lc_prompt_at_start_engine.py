"""The prompt at the start of the run, on the REAL engine (shared ``craft_engine``; issue 25):
``on_chat_model_start``/``on_llm_start`` get ``metadata["craft_prompt"]`` whose ids are the ids
vLLM was sent (the response's ``craft_prompt`` and ``usage``) and whose text decodes them with
the model's own tokenizer; an LLM-cache hit aborts the started request. Replies are 1 token.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from uuid import UUID

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.outputs import LLMResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftRAGPrompt, CraftVLLM

pytestmark = pytest.mark.engine

MODES = ("invoke", "stream", "ainvoke", "astream")


class Recorder(BaseCallbackHandler):
    """The start metadata's prompt and the response's prompt and usage, per run."""

    def __init__(self) -> None:
        self.started: dict[UUID, Any] = {}
        self.ended: dict[UUID, tuple[dict[str, Any], int]] = {}

    def on_chat_model_start(self, serialized: Any, messages: Any, **kw: Any) -> None:
        self.started[kw["run_id"]] = (kw.get("metadata") or {}).get("craft_prompt")

    def on_llm_start(self, serialized: Any, prompts: Any, **kw: Any) -> None:
        self.started[kw["run_id"]] = (kw.get("metadata") or {}).get("craft_prompt")

    def on_llm_end(self, response: LLMResult, **kw: Any) -> None:
        generation: Any = response.generations[0][0]
        message = getattr(generation, "message", None)
        if message is not None:
            usage = message.usage_metadata["input_tokens"]
            self.ended[kw["run_id"]] = (message.response_metadata["craft_prompt"], usage)
        else:
            info = generation.generation_info
            self.ended[kw["run_id"]] = (info["craft_prompt"], info["usage"]["input_tokens"])

    def only(self) -> tuple[dict[str, Any], dict[str, Any], int]:
        ((run_id, start),) = self.started.items()
        return start, *self.ended[run_id]


def call(runnable: Runnable[Any, Any], mode: str, input: Any, config: Any, **kw: Any) -> Any:
    if mode == "invoke":
        return runnable.invoke(input, config, **kw)
    if mode == "stream":
        return list(runnable.stream(input, config, **kw))[-1]
    if mode == "ainvoke":
        return asyncio.run(runnable.ainvoke(input, config, **kw))

    async def run() -> list[Any]:
        return [c async for c in runnable.astream(input, config, **kw)]

    return asyncio.run(run())[-1]


def passages(tag: str) -> list[Document]:
    return [
        Document(page_content=f"Passage {i} of set {tag}: the river runs north.", id=f"{tag}-{i}")
        for i in range(2)
    ]


def check(recorder: Recorder, engine: Any, *texts: str) -> None:
    start, end, input_tokens = recorder.only()
    assert start is not None and start == end
    assert len(start["token_ids"]) == input_tokens
    assert start["text"] == engine.tokenizer.decode(start["token_ids"])
    for text in texts:
        assert text in start["text"]


@pytest.mark.parametrize("mode", MODES)
def test_chat_rag_chain_and_plain_chat_show_the_prompt_at_start(
    craft_engine: Any, mode: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    model = ChatCraftVLLM(engine=craft_engine, max_tokens=1)
    chain = (
        {"context": RunnableLambda(lambda _: passages(tag)), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | model
    )
    recorder = Recorder()
    call(chain, mode, f"Where does river {tag} run?", {"callbacks": [recorder]})
    check(recorder, craft_engine, f"set {tag}", f"river {tag}", "<|im_start|>")
    recorder = Recorder()
    call(model, mode, f"Say hello to {tag}.", {"callbacks": [recorder]})
    check(recorder, craft_engine, f"hello to {tag}", "<|im_start|>")


@pytest.mark.parametrize("mode", MODES)
def test_completion_llm_shows_the_prompt_at_start(craft_engine: Any, mode: str) -> None:
    tag = uuid.uuid4().hex[:8]
    recorder = Recorder()
    llm = CraftVLLM(engine=craft_engine, max_tokens=1)
    config = {"callbacks": [recorder]}
    call(llm, mode, f"Where does river {tag} run?", config, documents=passages(tag))
    check(recorder, craft_engine, f"set {tag}", f"river {tag}")


def test_an_llm_cache_hit_aborts_the_started_turn(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    model = ChatCraftVLLM(engine=craft_engine, max_tokens=1, cache=InMemoryCache())
    ask: dict[str, Any] = {"documents": passages(tag), "conversation_id": f"cache-{tag}"}
    first = model.invoke("Where does it run?", **ask)
    assert craft_engine.turn_count(f"cache-{tag}") == 1
    recorder = Recorder()
    again = model.invoke("Where does it run?", {"callbacks": [recorder]}, **ask)
    assert again.content == first.content  # LangChain's cache answered, with turn 1's prompt
    shown, cached, _ = recorder.only()  # at start: the prompt that would have been sent
    assert cached == first.response_metadata["craft_prompt"]
    assert len(shown["token_ids"]) > len(cached["token_ids"])  # turn 2's, after turn 1's
    assert craft_engine.turn_count(f"cache-{tag}") == 1  # aborted: nothing committed
    model.cache = False
    assert model.invoke("Where does it run?", **ask).response_metadata["craft"]["turn"] == 2
    craft_engine.end_conversation(f"cache-{tag}")
