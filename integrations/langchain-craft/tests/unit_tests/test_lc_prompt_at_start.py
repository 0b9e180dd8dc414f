"""The exact prompt reaches LangChain's instrumentation before generation (issue 25): the run's
metadata, so ``on_chat_model_start``/``on_llm_start`` and tracers, carry ``craft_prompt``,
equal to what the engine was sent and to ``response_metadata["craft_prompt"]``; a call
LangChain answers without the model aborts the started request (nothing committed); nested
calls never serve each other's request. Real ``CraftEngine`` over the fake forward pass (its
hashing tokenizer cannot decode, so ``text`` is ``None`` here; the engine suite checks the text
on the real model)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from uuid import UUID

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.outputs import LLMResult
from langchain_core.rate_limiters import InMemoryRateLimiter
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftRAGPrompt, CraftVLLM

from craft_rag import CraftPlanner
from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_fake_engine

Fake = tuple[CraftEngine, FakeBackend]
MODES = ("invoke", "stream", "ainvoke", "astream")


def docs(tag: str) -> list[Document]:
    return [Document(page_content=f"{tag}{i} " * 24, id=f"{tag}{i}") for i in range(2)]


def commits(engine: CraftEngine) -> int:
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    return planner.stats.commits


class Recorder(BaseCallbackHandler):
    """Per run: the metadata and invocation params at start (and how many requests the
    backend had been sent by then), the prompt in the response at the end, errors."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.starts: dict[UUID, dict[str, Any]] = {}
        self.ends: dict[UUID, dict[str, Any]] = {}
        self.errors: list[BaseException] = []

    def _start(self, run_id: UUID, kwargs: dict[str, Any]) -> None:
        self.starts[run_id] = {
            "metadata": dict(kwargs.get("metadata") or {}),
            "params": dict(kwargs.get("invocation_params") or {}),
            "sent": list(self.backend.added),
        }

    def on_chat_model_start(
        self, serialized: Any, messages: list[list[BaseMessage]], *, run_id: UUID, **kw: Any
    ) -> None:
        self._start(run_id, kw)

    def on_llm_start(
        self, serialized: Any, prompts: list[str], *, run_id: UUID, **kw: Any
    ) -> None:
        self._start(run_id, kw)

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kw: Any) -> None:
        generation: Any = response.generations[0][0]
        message = getattr(generation, "message", None)
        info = message.response_metadata if message is not None else generation.generation_info
        self.ends[run_id] = info["craft_prompt"]

    def on_llm_error(self, error: BaseException, **kw: Any) -> None:
        self.errors.append(error)

    def only(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The one run's start record and its response prompt."""
        assert len(self.starts) == 1, self.starts
        (run_id, start), = self.starts.items()
        return start, self.ends[run_id]


def call(model: Runnable[Any, Any], mode: str, input: Any, config: Any, **kw: Any) -> Any:
    """``model`` called through one of LangChain's four entry points; the last output."""
    if mode == "invoke":
        return model.invoke(input, config, **kw)
    if mode == "stream":
        return list(model.stream(input, config, **kw))[-1]
    if mode == "ainvoke":
        return asyncio.run(model.ainvoke(input, config, **kw))

    async def run() -> list[Any]:
        return [c async for c in model.astream(input, config, **kw)]

    return asyncio.run(run())[-1]


def text(output: Any) -> str:
    return output if isinstance(output, str) else str(output.content)


def chat(engine: CraftEngine, **kw: Any) -> ChatCraftVLLM:
    return ChatCraftVLLM(engine=engine, max_tokens=3, **kw)


def llm(engine: CraftEngine, **kw: Any) -> CraftVLLM:
    return CraftVLLM(engine=engine, max_tokens=3, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
@pytest.mark.parametrize("rag", [True, False], ids=["rag", "plain"])
def test_the_prompt_is_in_the_start_callback_and_run_metadata(
    fake: Fake, make: Callable[..., Any], mode: str, rag: bool
) -> None:
    engine, backend = fake
    recorder = Recorder(backend)
    extra = {"documents": docs("d"), "conversation_id": f"c-{mode}"} if rag else {}
    config = {"callbacks": [recorder], "metadata": {"user": "u1"}}
    call(make(engine), mode, "Which one?", config, **extra)
    start, end = recorder.only()
    assert len(backend.added) == 1  # one request, submitted once
    sent = list(backend.added[0][1])
    assert start["sent"] == backend.added  # submitted before the start callback fired
    assert start["metadata"]["craft_prompt"] == {"text": None, "token_ids": sent} == end
    assert start["metadata"]["user"] == "u1"  # the caller's metadata is kept
    assert "craft_prompt" not in start["params"]  # not in LangChain's cache key
    assert commits(engine) == (0 if make is chat and not rag else 1)  # a plain chat plans nothing


@pytest.mark.parametrize("mode", MODES)
def test_a_craft_rag_prompt_chain_shows_its_prompt_at_start(fake: Fake, mode: str) -> None:
    engine, backend = fake
    recorder = Recorder(backend)
    chain = (
        {"context": RunnableLambda(lambda _: docs("r")), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | chat(engine)
    )
    call(chain, mode, "Which?", {"callbacks": [recorder]})
    start, end = recorder.only()  # the chain's other steps are no model runs
    assert start["metadata"]["craft_prompt"]["token_ids"] == list(backend.added[0][1])
    assert start["metadata"]["craft_prompt"] == end and commits(engine) == 1


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
def test_an_llm_cache_hit_aborts_the_started_request(
    make: Callable[..., Any], mode: str
) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.01))
    try:
        model = make(engine, cache=InMemoryCache())
        ask = {"documents": docs("k"), "conversation_id": "k"}
        first = call(model, mode, "Which?", None, **ask)
        assert engine.turn_count("k") == 1 and commits(engine) == 1
        again = call(model, mode, "Which?", None, **ask)  # LangChain answers from its cache
        assert text(again) == text(first)
        assert len(backend.added) == 2 and backend.aborted == [backend.added[1][0]]
        assert engine.turn_count("k") == 1 and commits(engine) == 1  # nothing committed
        model.cache = False  # the conversation was left as it was: the next turn is its second
        call(model, mode, "Which?", None, **ask)
        assert engine.turn_count("k") == 2 and commits(engine) == 2
    finally:
        engine.close()


def test_a_failing_start_callback_aborts_the_started_request() -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.01))

    class Failing(BaseCallbackHandler):
        raise_error = True

        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            msg = "tracer down"
            raise RuntimeError(msg)

    try:
        with pytest.raises(RuntimeError, match="tracer down"):
            chat(engine).invoke(
                "Which?", {"callbacks": [Failing()]}, documents=docs("f"), conversation_id="f"
            )
        assert backend.aborted == [backend.added[0][0]]
        assert engine.turn_count("f") == 0 and commits(engine) == 0
    finally:
        engine.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("same_model", [False, True], ids=["other", "same"])
@pytest.mark.parametrize("nested_call", ["invoke", "generate"])
def test_a_call_nested_in_a_start_callback_serves_its_own_request(
    fake: Fake, mode: str, same_model: bool, nested_call: str
) -> None:
    """A start callback calls a model (another one, or this very one) before the outer call
    reaches ``_stream``: through ``invoke`` (which starts its own request first) or
    ``generate`` (which does not, so its ``_stream`` sees the outer call's request and must
    leave it). Each call serves its own request, the one its start showed."""
    engine, backend = fake
    recorder = Recorder(backend)
    outer = chat(engine)
    inner = outer if same_model else chat(engine)
    nested: list[Any] = []

    class Nesting(BaseCallbackHandler):
        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            if nested:
                return
            question = "Something else entirely?"
            nested.append(None)
            if nested_call == "invoke":
                nested[0] = inner.invoke(question, {"callbacks": [recorder]})
            else:
                result = inner.generate([[HumanMessage(question)]], callbacks=[recorder])
                generation: Any = result.generations[0][0]
                nested[0] = generation.message

    config = {"callbacks": [Nesting(), recorder]}
    out = call(outer, mode, "Which?", config, documents=docs("n"), conversation_id="n")
    assert len(recorder.starts) == 2 and len(backend.added) == 2
    outer_ids, inner_ids = (list(ids) for _, ids, _ in backend.added)  # outer submitted first
    assert out.response_metadata["craft_prompt"]["token_ids"] == outer_ids
    assert nested[0].response_metadata["craft_prompt"]["token_ids"] == inner_ids
    shown = [s["metadata"].get("craft_prompt") for s in recorder.starts.values()]
    assert sum(p is not None for p in shown) == (2 if nested_call == "invoke" else 1)
    for run_id, start in recorder.starts.items():
        assert start["metadata"].get("craft_prompt", recorder.ends[run_id]) == recorder.ends[run_id]
    assert outer_ids != inner_ids and commits(engine) == 1  # the outer RAG turn only


def test_models_in_one_chain_each_serve_their_own_request(fake: Fake) -> None:
    engine, backend = fake
    recorder = Recorder(backend)
    first, second = chat(engine), llm(engine)
    chain = first | RunnableLambda(lambda m: f"Say more about {m.content}") | second
    chain.invoke("Hello", {"callbacks": [recorder]})
    assert len(recorder.starts) == 2 and len(backend.added) == 2
    shown = sorted(s["metadata"]["craft_prompt"]["token_ids"] for s in recorder.starts.values())
    assert shown == sorted(list(ids) for _, ids, _ in backend.added)
    for run_id, start in recorder.starts.items():
        assert start["metadata"]["craft_prompt"] == recorder.ends[run_id]


@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
def test_bad_input_fails_inside_the_run_as_before(fake: Fake, make: Callable[..., Any]) -> None:
    """A request that cannot be built raises the same error from within LangChain's run
    (start, then ``on_llm_error``); nothing is submitted."""
    engine, backend = fake
    recorder = Recorder(backend)
    with pytest.raises(ValueError, match="unsupported call arguments"):
        make(engine).invoke("Which?", {"callbacks": [recorder]}, beam_width=3)
    assert len(recorder.starts) == 1 and len(recorder.errors) == 1 and not backend.added
    (start,) = recorder.starts.values()
    assert "craft_prompt" not in start["metadata"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
def test_an_engine_failure_at_submission_is_raised_inside_the_run_once(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, make: Callable[..., Any], mode: str
) -> None:
    """Submitting fails (once): the call raises that error, from within LangChain's run
    (start, then ``on_llm_error``), and nothing is submitted again behind its back."""
    engine, backend = fake
    recorder = Recorder(backend)
    tries: list[int] = []
    original = backend.add_request

    def failing_once(*args: Any, **kwargs: Any) -> None:
        tries.append(1)
        if len(tries) == 1:
            msg = "engine failure (injected)"
            raise RuntimeError(msg)
        original(*args, **kwargs)

    monkeypatch.setattr(backend, "add_request", failing_once)
    ask = {"documents": docs("e"), "conversation_id": f"e-{mode}"}
    with pytest.raises(RuntimeError, match="injected"):
        call(make(engine), mode, "Which?", {"callbacks": [recorder]}, **ask)
    assert len(tries) == 1 and not backend.added and len(recorder.errors) == 1
    (start,) = recorder.starts.values()
    assert "craft_prompt" not in start["metadata"]
    assert engine.turn_count(f"e-{mode}") == 0 and commits(engine) == 0
    call(make(engine), mode, "Which?", None, **ask)  # the next call is served
    assert engine.turn_count(f"e-{mode}") == 1


def test_a_stream_falling_back_on_invoke_submits_once(fake: Fake) -> None:
    engine, backend = fake
    recorder = Recorder(backend)
    chunks = list(chat(engine, streaming=False).stream("Hi", {"callbacks": [recorder]}))
    assert len(chunks) == 1 and len(backend.added) == 1
    start, end = recorder.only()
    assert start["metadata"]["craft_prompt"] == end


def test_batch_shows_each_prompt_at_start(fake: Fake) -> None:
    engine, backend = fake
    recorder = Recorder(backend)
    chat(engine).batch(["One?", "Two?"], {"callbacks": [recorder]})
    shown = sorted(s["metadata"]["craft_prompt"]["token_ids"] for s in recorder.starts.values())
    assert shown == sorted(list(ids) for _, ids, _ in backend.added) and len(shown) == 2


def test_a_rate_limited_model_starts_after_the_limiter(fake: Fake) -> None:
    """With a ``rate_limiter`` the request must wait for it: the prompt is in the response only."""
    engine, backend = fake
    recorder = Recorder(backend)
    limiter = InMemoryRateLimiter(requests_per_second=100, check_every_n_seconds=0.01)
    chat(engine, rate_limiter=limiter).invoke([HumanMessage("Hi")], {"callbacks": [recorder]})
    start, end = recorder.only()
    assert "craft_prompt" not in start["metadata"] and not start["sent"]
    assert end["token_ids"] == list(backend.added[0][1])


@pytest.mark.parametrize("make", [chat, llm], ids=["chat", "llm"])
def test_astream_events_carry_the_prompt_on_the_start_event(
    fake: Fake, make: Callable[..., Any]
) -> None:
    engine, backend = fake

    async def run() -> list[Any]:
        return [e async for e in make(engine).astream_events("Hi", version="v2")]

    events = asyncio.run(run())
    (start,) = [e for e in events if e["event"] in ("on_chat_model_start", "on_llm_start")]
    assert start["metadata"]["craft_prompt"]["token_ids"] == list(backend.added[0][1])
    assert len(backend.added) == 1
