"""ChatCraftVLLM and CraftVLLM over the real CraftEngine with a fake forward pass (fast)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftDocuments, CraftRAGPrompt, CraftReorder, CraftVLLM

from craft_rag import CraftPlanner
from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_fake_engine

REPLY = "t101 t102 t103 t104 "


def docs(*ids: str) -> list[Document]:
    return [Document(page_content=f"{i} " * 24, id=i, metadata={"src": i}) for i in ids]


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[Any] = []

    def on_llm_new_token(self, token: str | list[str | dict[str, Any]], **kwargs: Any) -> None:
        self.tokens.append(token)


class AsyncTokenCounter(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[Any] = []

    async def on_llm_new_token(
        self, token: str | list[str | dict[str, Any]], **kwargs: Any
    ) -> None:
        self.tokens.append(token)


def test_invoke_reports_usage_and_reuse(fake: tuple[CraftEngine, FakeBackend]) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=4)
    msg = model.invoke("Hello")
    assert isinstance(msg, AIMessage) and msg.content == REPLY
    assert msg.usage_metadata is not None
    assert msg.usage_metadata["output_tokens"] == 4
    assert msg.usage_metadata["input_token_details"] == {"cache_read": 0}
    craft = msg.response_metadata["craft"]
    assert craft["prompt_tokens"] == msg.usage_metadata["input_tokens"]
    assert craft["ttft_ms"] >= 0 and craft["chunk_order"] == []
    assert msg.response_metadata["model_name"] == "SmolLM2-135M-Instruct"
    assert msg.response_metadata["finish_reason"] == "length"
    again = model.invoke("Hello")
    assert again.usage_metadata is not None
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0


def test_callbacks_fire_per_token_on_invoke_and_stream(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=4)
    counter = TokenCounter()
    model.invoke("Hi", {"callbacks": [counter]})
    assert counter.tokens == ["t101 ", "t102 ", "t103 ", "t104 "]
    counter.tokens.clear()
    list(model.stream("Hi", {"callbacks": [counter]}))
    # LangChain's stream() fires the callback itself, plus once for the closing empty chunk.
    assert [t for t in counter.tokens if t] == ["t101 ", "t102 ", "t103 ", "t104 "]


def test_stream_yields_tokens_then_a_last_chunk_with_usage(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    chunks = list(ChatCraftVLLM(engine=fake[0], max_tokens=3).stream("Hi"))
    assert [c.content for c in chunks[:-1]] == ["t101 ", "t102 ", "t103 "]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata is not None
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert isinstance(full, AIMessageChunk)
    assert full.text == "t101 t102 t103 " and full.response_metadata["craft"]["output_tokens"] == 3


async def test_async_paths_match_sync(fake: tuple[CraftEngine, FakeBackend]) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=4)
    counter = AsyncTokenCounter()
    msg = await model.ainvoke("Hello", {"callbacks": [counter]})
    assert msg.content == REPLY and len(counter.tokens) == 4
    chunks = [c async for c in model.astream("Hello")]
    assert "".join(c.text for c in chunks) == REPLY
    assert chunks[-1].response_metadata["craft"]["cached_tokens"] > 0


def test_rag_chain_is_token_exact_and_aligns_shared_chunks(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine, backend = fake
    retrieved = iter([docs("a", "b", "c"), docs("c", "b", "a")])
    chain = (
        {"context": RunnableLambda(lambda _: next(retrieved)), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=engine, max_tokens=2)
    )
    first = chain.invoke("What is a?")
    second = chain.invoke("What is c?")
    order = first.response_metadata["craft"]["chunk_order"]
    assert second.response_metadata["craft"]["chunk_order"] == order  # CRAFT kept the prefix
    craft = second.response_metadata["craft"]
    # Reused = every token inside the cached prefix: the 3rd chunk's tail shares a block with
    # the (different) question, so it counts only when it ends exactly on a cached block.
    assert craft["predicted_chunks"] == 3
    inside = craft["predicted_tokens"] <= craft["cached_tokens"]
    assert craft["reused_chunks"] == (3 if inside else 2)
    # The engine got token-exact segments: both prompts share the chunk-prefix token ids.
    (_, ids1, _), (_, ids2, _) = backend.added
    prefix = engine.assembler.head_ids + tuple(
        t for d in docs(*order) for t in engine.assembler.chunk_ids(_chunk(d))
    )
    assert ids1[: len(prefix)] == ids2[: len(prefix)] == prefix


def _chunk(doc: Document) -> Any:
    from craft_rag import make_chunk

    return make_chunk(doc.page_content, id=doc.id)


def test_documents_kwarg_and_conversation_dedup(fake: tuple[CraftEngine, FakeBackend]) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=2)
    one = model.invoke("q1", documents=docs("a", "b"), conversation_id="c1")
    two = model.invoke("q2", documents=docs("b", "c", "a"), conversation_id="c1")
    assert one.response_metadata["craft"]["turn"] == 1
    craft = two.response_metadata["craft"]
    assert craft["turn"] == 2 and craft["chunk_order"] == ["c"]
    assert craft["removed_duplicates"] == ["b", "a"]
    assert craft["cached_tokens"] >= one.response_metadata["craft"]["prompt_tokens"] // 16 * 16


def test_reorder_step_previews_the_plan_the_engine_serves_and_commits(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    model = ChatCraftVLLM(engine=engine, max_tokens=2)
    preview = model.reorder_step()
    seen: list[CraftDocuments] = []

    def keep(documents: list[Document]) -> list[Document]:
        assert isinstance(documents, CraftDocuments)
        seen.append(documents)
        return documents

    chain = (
        {"context": preview | RunnableLambda(keep), "question": RunnableLambda(lambda _: "q")}
        | CraftRAGPrompt()
        | model
    )
    chain.invoke(docs("a", "b"))
    msg = chain.invoke(docs("x", "b", "a"))
    plan = seen[-1].plan
    assert plan is not None
    craft = msg.response_metadata["craft"]
    # The engine served the previewed plan itself: same order, same plan id, no second plan.
    assert craft["chunk_order"] == [d.id for d in seen[-1]] == list(plan.keys)
    assert craft["plan_id"] == plan.plan_id
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    assert planner.stats.plans == planner.stats.commits == 2
    assert not planner.is_pending(plan)


def test_reorder_step_uses_the_planner_of_the_models_salt(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    model = ChatCraftVLLM(engine=engine, max_tokens=2, cache_salt="tenant-a")
    preview = model.reorder_step()
    assert preview.planner is engine.planner_for("tenant-a")
    assert preview.planner is not engine.planner
    chain = (
        {"context": preview, "question": RunnableLambda(lambda _: "q")} | CraftRAGPrompt() | model
    )
    msg = chain.invoke(docs("a", "b"))
    assert msg.response_metadata["craft"]["salted"] is True
    assert preview.planner.stats.commits == 1
    assert engine.planner.stats.commits == 0  # type: ignore[attr-defined]


def test_a_preview_from_another_planner_is_only_an_order(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    foreign = CraftReorder(commit=False)  # its own planner, not the engine's
    chain = (
        {"context": foreign, "question": RunnableLambda(lambda _: "q")}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=engine, max_tokens=2)
    )
    msg = chain.invoke(docs("a", "b"))
    assert msg.response_metadata["craft"]["chunk_order"] == ["a", "b"]
    assert engine.planner.stats.plans == 1  # type: ignore[attr-defined]  # the engine planned
    assert foreign.planner.stats.commits == 0


def test_committed_documents_on_the_engine_planner_are_refused(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    reorder = CraftReorder(planner=engine.planner)  # type: ignore[arg-type]
    chain = (
        {"context": reorder, "question": RunnableLambda(lambda _: "q")}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=engine, max_tokens=2)
    )
    with pytest.raises(ValueError, match="commit=False"):
        chain.invoke(docs("a"))
    # A committed step on a *different* planner is fine: the engine plans on its own.
    other = (
        {"context": CraftReorder(), "question": RunnableLambda(lambda _: "q")}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=engine, max_tokens=2)
    )
    assert other.invoke(docs("a")).response_metadata["craft"]["chunk_order"] == ["a"]


def test_plain_chats_use_the_chat_template_and_reuse_earlier_messages(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine, backend = fake
    model = ChatCraftVLLM(engine=engine, max_tokens=2)
    system = "Be nice and answer in one short sentence about the weather. " * 2
    first_chat = [SystemMessage(system), HumanMessage("hello there, what is the weather today?")]
    first = model.invoke(first_chat)
    chat = [("system", system), ("user", "hello there, what is the weather today?")]
    assert backend.added[0][1] == engine.message_token_ids(chat)  # no RAG instructions
    longer = [*first_chat, AIMessage(first.text), HumanMessage("and tomorrow?")]
    second = model.invoke(longer, conversation_id="ignored")
    longer_chat = [*chat, ("assistant", first.text), ("user", "and tomorrow?")]
    assert backend.added[1][1] == engine.message_token_ids(longer_chat)
    craft = second.response_metadata["craft"]
    # Every full block of the first chat's messages is reused; nothing is planned.
    assert craft["cached_tokens"] >= (len(engine.message_token_ids(chat)) - 8) // 16 * 16 > 0
    assert craft["plan_id"] is None and craft["chunk_order"] == [] and craft["turn"] == 1
    assert engine.planner.stats.plans == 0  # type: ignore[attr-defined]
    assert engine.conversations.turn_count("ignored") == 0


async def test_plain_chats_async_and_custom_roles(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine, backend = fake
    model = ChatCraftVLLM(engine=engine, max_tokens=2)
    chunks = [c async for c in model.astream([ChatMessage(role="critic", content="Hmm.")])]
    assert "".join(c.text for c in chunks) == "t101 t102 "
    assert backend.added[0][1] == engine.message_token_ids([("critic", "Hmm.")])


def test_stop_and_sampling_reach_the_engine(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine, backend = fake
    ChatCraftVLLM(engine=engine, max_tokens=2, stop=["x"], temperature=0.5).invoke("hi")
    ChatCraftVLLM(engine=engine, max_tokens=2).invoke("hi", stop=["y"], max_tokens=3, seed=7)
    first, second = backend.added[0][2], backend.added[1][2]
    assert first.stop == ("x",) and first.temperature == 0.5
    assert second.stop == ("y",) and second.max_tokens == 3 and second.seed == 7


def test_no_cache_baseline(fake: tuple[CraftEngine, FakeBackend]) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=2)
    model.invoke("same prompt")
    msg = model.invoke("same prompt", read_prefix_cache=False)
    assert msg.response_metadata["craft"]["cached_tokens"] == 0
    assert msg.response_metadata["craft"]["read_prefix_cache"] is False


def test_bad_input_is_a_clear_error(fake: tuple[CraftEngine, FakeBackend]) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=2)
    with pytest.raises(ValueError, match="unsupported call arguments"):
        model.invoke("hi", frobnicate=1.0)  # frequency_penalty is a vLLM name: mapped
    with pytest.raises(ValueError, match="serves 'SmolLM2-135M-Instruct', not 'gpt-4'"):
        model.invoke("hi", model="gpt-4")
    with pytest.raises(ValueError, match="text only"):
        model.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])
    with pytest.raises(ValueError, match="no text"):
        model.invoke([HumanMessage("  ")])
    with pytest.raises(ValueError, match=r"documents\[0\] is a str"):
        model.invoke("hi", documents=["not a document"])
    assert fake[1].added == []  # nothing reached the engine


def test_cache_salts_isolate_the_prefix_cache(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine, backend = fake
    tenant_a = ChatCraftVLLM(engine=engine, max_tokens=2, cache_salt="tenant-a")
    first = tenant_a.invoke("q", documents=docs("a", "b"))
    same = tenant_a.invoke("q", documents=docs("a", "b"))
    other = tenant_a.invoke("q", documents=docs("a", "b"), cache_salt="tenant-b")
    bare = ChatCraftVLLM(engine=engine, max_tokens=2).invoke("q", documents=docs("a", "b"))
    cached = [m.response_metadata["craft"]["cached_tokens"] for m in (first, same, other, bare)]
    assert cached[0] == 0 and cached[1] > 0
    assert cached[2] == 0 and cached[3] == 0  # same token ids, another salt (or none)
    assert backend.salts == ["tenant-a", "tenant-a", "tenant-b", None]
    assert [m.response_metadata["craft"]["salted"] for m in (first, other, bare)] == [
        True,
        True,
        False,
    ]
    # Each salt has its own planner: tenant-b's first request was planned from scratch.
    assert other.response_metadata["craft"]["predicted_tokens"] in (None, 0)
    assert engine.planner_for("tenant-a").stats.commits == 2  # type: ignore[attr-defined]
    # Plain chats are salted too.
    chat = tenant_a.invoke([HumanMessage("hello " * 20)])
    assert chat.response_metadata["craft"]["salted"] is True and backend.salts[-1] == "tenant-a"


def test_bad_cache_salts_are_refused_before_the_engine(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    model = ChatCraftVLLM(engine=fake[0], max_tokens=2)
    for bad in ("", "a/b", "x" * 200):
        with pytest.raises(ValueError, match="cache_salt"):
            model.invoke("hi", cache_salt=bad)
    assert fake[1].added == []


def test_engine_failure_propagates_and_commits_nothing() -> None:
    from craft_rag.engine.driver import EngineFailure

    engine, backend = make_fake_engine()
    try:
        backend.step = _crash  # type: ignore[method-assign]
        with pytest.raises(EngineFailure):
            ChatCraftVLLM(engine=engine, max_tokens=2).invoke("hi", documents=docs("a"))
        assert engine.planner.stats.commits == 0  # type: ignore[attr-defined]
    finally:
        engine.close()


def _crash() -> list[Any]:
    raise RuntimeError("simulated engine crash")


# ---- CraftVLLM ------------------------------------------------------------------------------


def test_llm_invoke_stream_and_generation_info(fake: tuple[CraftEngine, FakeBackend]) -> None:
    llm = CraftVLLM(engine=fake[0], max_tokens=4)
    counter = TokenCounter()
    assert llm.invoke("Hello", {"callbacks": [counter]}) == REPLY
    assert len(counter.tokens) == 4
    assert "".join(llm.stream("Hello")) == REPLY
    result = llm.generate(["a question", "another question"], documents=docs("a", "b"))
    info = result.generations[0][0].generation_info
    assert info is not None and info["craft"]["chunk_order"] == ["a", "b"]
    assert info["usage"]["output_tokens"] == 4
    assert result.generations[1][0].generation_info["craft"]["reused_chunks"] == 2  # type: ignore[index]
    assert result.llm_output is not None
    assert result.llm_output["token_usage"]["completion_tokens"] == 8


async def test_llm_async(fake: tuple[CraftEngine, FakeBackend]) -> None:
    llm = CraftVLLM(engine=fake[0], max_tokens=4)
    assert await llm.ainvoke("Hello") == REPLY
    assert "".join([c async for c in llm.astream("Hello")]) == REPLY
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        await llm.ainvoke(" ")


def test_models_do_not_start_an_engine_until_used() -> None:
    model = ChatCraftVLLM(max_tokens=2)
    assert model._owned_engine is None
    assert model._get_ls_params()["ls_model_name"] == "SmolLM2-135M-Instruct"
    model.close()  # nothing to close
