"""CraftChatEngine's streaming response reads its writer thread's queue without spinning
(issue 15 item 3): LlamaIndex's own ``response_gen`` busy-polls with ``time.sleep(0)``, which
took a core and the GIL from the in-process engine during prefill. Unit test on a slow stream
(the real-engine stream_chat paths are in test_llamaindex_engine_paths.py)."""

from __future__ import annotations

import time
from collections.abc import Generator
from threading import Thread

import llama_index.core.chat_engine.types as li_types
import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.chat_engine.types import StreamingAgentChatResponse
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.llms.craft_vllm.chat_engine import _BlockingStreamResponse


def _slow_stream(delay: float) -> Generator[ChatResponse, None, None]:
    time.sleep(delay)  # the prefill: nothing to read yet
    text = ""
    for piece in ("Paris", " is", " the capital."):
        text += piece
        yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                           delta=piece)


def _read(cls: type[StreamingAgentChatResponse]) -> tuple[str, float, ChatMemoryBuffer]:
    memory = ChatMemoryBuffer.from_defaults()
    response = cls(chat_stream=_slow_stream(0.4))
    thread = Thread(target=response.write_response_to_history, args=(memory,))
    response.write_response_to_history_thread = thread
    thread.start()
    cpu = time.thread_time()
    text = "".join(response.response_gen)
    return text, time.thread_time() - cpu, memory


def test_reader_waits_without_burning_cpu_and_memory_gets_the_reply() -> None:
    text, cpu_s, memory = _read(_BlockingStreamResponse)
    assert text == "Paris is the capital."
    assert cpu_s < 0.1  # blocked on the queue, not polling
    messages = memory.get_all()
    assert messages[-1].role == MessageRole.ASSISTANT
    assert messages[-1].content == "Paris is the capital."


def test_llamaindex_own_reader_spins_which_is_why_it_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The premise (counted, not timed: a loaded machine starves a spinning thread too): if
    LlamaIndex stops polling with sleep(0), the override can go."""
    calls: list[float] = []
    real_sleep = time.sleep

    def counting_sleep(seconds: float) -> None:
        calls.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(li_types.time, "sleep", counting_sleep)
    text, _, _ = _read(StreamingAgentChatResponse)
    assert text == "Paris is the capital."
    assert calls.count(0) > 10  # polled while the stream was silent
    calls.clear()
    text, _, _ = _read(_BlockingStreamResponse)
    assert text == "Paris is the capital."
    assert calls.count(0) == 0
