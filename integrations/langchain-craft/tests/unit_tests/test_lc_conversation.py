"""CraftConversation over the real CraftEngine with a fake forward pass (fast)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from langchain_craft import ChatCraftVLLM, CraftConversation
from langchain_craft.conversation import InMemoryHistory as ListHistory

from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_fake_engine


def docs(*ids: str) -> list[Document]:
    return [Document(page_content=f"{i} " * 24, id=i) for i in ids]


def make_conversation(
    engine: CraftEngine, retrieved: Sequence[list[Document]], store: dict[str, Any]
) -> CraftConversation:
    results = iter(retrieved)
    return CraftConversation(
        llm=ChatCraftVLLM(engine=engine, max_tokens=2),
        retriever=RunnableLambda(lambda _: next(results)),
        get_session_history=lambda sid: store.setdefault(sid, ListHistory()),
    )


def craft(msg: Any) -> dict[str, Any]:
    return msg.response_metadata["craft"]  # type: ignore[no-any-return]


def test_turns_are_append_only_and_deduplicated(fake: tuple[CraftEngine, FakeBackend]) -> None:
    store: dict[str, Any] = {}
    conv = make_conversation(fake[0], [docs("a", "b"), docs("c", "b", "a"), docs("a")], store)
    config: Any = {"configurable": {"session_id": "s1"}}
    replies = [conv.invoke(q, config) for q in ("q1", "q2", "q3")]
    reports = [craft(r) for r in replies]
    assert [r["turn"] for r in reports] == [1, 2, 3]
    assert [r["chunk_order"] for r in reports] == [["a", "b"], ["c"], []]
    assert reports[1]["removed_duplicates"] == ["b", "a"]
    cached = [r["cached_tokens"] for r in reports]
    assert cached[0] < cached[1] < cached[2]  # rising reuse across turns
    # Each turn's prompt starts with the previous prompt (append-only).
    prompts = [added[1] for added in fake[1].added]
    assert prompts[1][: len(prompts[0])] == prompts[0]
    assert [m.type for m in store["s1"].messages] == ["human", "ai"] * 3
    assert store["s1"].messages[2].content == "q2"


def test_sessions_are_separate(fake: tuple[CraftEngine, FakeBackend]) -> None:
    store: dict[str, Any] = {}
    conv = make_conversation(fake[0], [docs("a"), docs("a")], store)
    conv.invoke("q", {"configurable": {"session_id": "s1"}})
    other = conv.invoke("q", {"configurable": {"thread_id": "s2"}})
    assert craft(other)["turn"] == 1 and craft(other)["chunk_order"] == ["a"]
    assert set(store) == {"s1", "s2"}


def test_documents_in_the_input_and_no_history(fake: tuple[CraftEngine, FakeBackend]) -> None:
    conv = CraftConversation(llm=ChatCraftVLLM(engine=fake[0], max_tokens=2))
    config: Any = {"configurable": {"conversation_id": "c"}}
    conv.invoke({"question": "q1", "documents": docs("a")}, config)
    msg = conv.invoke({"question": "q2", "documents": docs("a", "b")}, config)
    assert craft(msg)["chunk_order"] == ["b"] and craft(msg)["removed_duplicates"] == ["a"]


def test_stream_records_the_turn_when_complete(fake: tuple[CraftEngine, FakeBackend]) -> None:
    store: dict[str, Any] = {}
    conv = make_conversation(fake[0], [docs("a"), docs("a", "b")], store)
    config: Any = {"configurable": {"session_id": "s"}}
    chunks = list(conv.stream("q1", config))
    assert "".join(c.text for c in chunks) == "t101 t102 "
    assert [m.type for m in store["s"].messages] == ["human", "ai"]
    assert isinstance(store["s"].messages[1], AIMessage)
    assert store["s"].messages[1].response_metadata["craft"]["turn"] == 1


async def test_async_invoke_and_stream(fake: tuple[CraftEngine, FakeBackend]) -> None:
    store: dict[str, Any] = {}
    conv = make_conversation(fake[0], [docs("a"), docs("a", "b")], store)
    config: Any = {"configurable": {"session_id": "s"}}
    first = await conv.ainvoke("q1", config)
    chunks = [c async for c in conv.astream("q2", config)]
    assert craft(first)["turn"] == 1
    assert chunks[-1].response_metadata["craft"]["chunk_order"] == ["b"]
    assert len(store["s"].messages) == 4


def test_resumes_a_session_the_engine_forgot(fake: tuple[CraftEngine, FakeBackend]) -> None:
    store: dict[str, Any] = {}
    conv = make_conversation(fake[0], [docs("a"), docs("a")], store)
    config: Any = {"configurable": {"session_id": "s"}}
    conv.invoke("first question", config)
    fake[0].end_conversation("s")  # e.g. the process restarted; the history survived
    msg = conv.invoke("second question", config)
    assert craft(msg)["turn"] == 1 and craft(msg)["chunk_order"] == ["a"]
    last_prompt = fake[1].added[-1][1]
    assert len(last_prompt) > len(fake[1].added[0][1])  # carries the earlier turn as text
    assert [m.content for m in store["s"].messages][2] == "second question"
    assert conv.end_session("s", clear_history=True) is True
    assert store["s"].messages == []


def test_base_chat_message_history_works(fake: tuple[CraftEngine, FakeBackend]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated since langchain-core 1.6.4
        from langchain_core.chat_history import InMemoryChatMessageHistory

        history = InMemoryChatMessageHistory()
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=fake[0], max_tokens=2),
        retriever=RunnableLambda(lambda _: docs("a")),
        get_session_history=lambda _: history,
    )
    conv.invoke("q", {"configurable": {"session_id": "s"}})
    assert [m.type for m in history.messages] == ["human", "ai"]


@pytest.mark.parametrize(
    ("input", "config", "match"),
    [
        ("q", {}, "needs a session id"),
        ({"documents": []}, {"configurable": {"session_id": "s"}}, "needs a 'question'"),
        ("  ", {"configurable": {"session_id": "s"}}, "non-empty string"),
        (3, {"configurable": {"session_id": "s"}}, "question str or dict"),
    ],
)
def test_bad_input_is_a_clear_error(
    fake: tuple[CraftEngine, FakeBackend], input: Any, config: Any, match: str
) -> None:
    conv = make_conversation(fake[0], [docs("a")], {})
    with pytest.raises(ValueError, match=match):
        conv.invoke(input, config)
    assert fake[1].added == []


def test_empty_retrieval_still_answers(fake: tuple[CraftEngine, FakeBackend]) -> None:
    conv = make_conversation(fake[0], [[]], {})
    msg = conv.invoke("q", {"configurable": {"session_id": "s"}})
    assert craft(msg)["chunk_order"] == [] and msg.content


def test_a_session_keeps_its_salt_and_salts_share_nothing(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine, backend = fake
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=engine, max_tokens=2),
        retriever=RunnableLambda(lambda _: docs("a", "b")),
        cache_salt="tenant-a",
    )
    a1 = conv.invoke("q", {"configurable": {"session_id": "a1"}})
    a2 = conv.invoke("q", {"configurable": {"session_id": "a2"}})
    b1 = conv.invoke("q", {"configurable": {"session_id": "b1", "cache_salt": "tenant-b"}})
    assert craft(a1)["cached_tokens"] == 0 and craft(a2)["cached_tokens"] > 0
    assert craft(b1)["cached_tokens"] == 0  # same prompt, another salt
    assert backend.salts == ["tenant-a", "tenant-a", "tenant-b"]
    # A session is its salt's: the same id under another salt is another tenant's session.
    other = conv.invoke("q2", {"configurable": {"session_id": "a1", "cache_salt": "tenant-b"}})
    assert craft(other)["turn"] == 1 and craft(other)["salted"]
    mine = conv.invoke("q2", {"configurable": {"session_id": "a1"}})
    assert craft(mine)["turn"] == 2
    assert conv.end_session("a1", config={"configurable": {"cache_salt": "tenant-b"}})
    assert conv.invoke("q3", {"configurable": {"session_id": "a1"}}).response_metadata[
        "craft"
    ]["turn"] == 3


def test_tenants_sharing_a_session_id_share_nothing(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    """Two tenants (salts) both use session "support-1": each has its own engine conversation
    and, with a (session_id, cache_salt) history factory, its own message history; ending one
    (with clear_history) leaves the other's engine turns and history alone."""
    engine, backend = fake
    store: dict[tuple[str, str | None], ListHistory] = {}
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=engine, max_tokens=2),
        retriever=RunnableLambda(lambda _: docs("a", "b")),
        get_session_history=lambda sid, salt: store.setdefault((sid, salt), ListHistory()),
        condense=False,
    )
    a = {"configurable": {"session_id": "support-1", "cache_salt": "tenant-a-secret"}}
    b = {"configurable": {"session_id": "support-1", "cache_salt": "tenant-b-secret"}}
    assert craft(conv.invoke("secret question of A", a))["turn"] == 1  # type: ignore[arg-type]
    first_b = conv.invoke("hello from B", b)  # type: ignore[arg-type]
    assert craft(first_b)["turn"] == 1
    # B's prompt holds nothing of A's conversation (no transcript of A's history either).
    b_prompt = backend.added[-1][1]
    a_words = tuple(engine.tokenizer.encode("secret question of A"))
    assert not any(
        b_prompt[i : i + len(a_words)] == a_words for i in range(len(b_prompt) - len(a_words))
    )
    assert conv.end_session("support-1", clear_history=True, config=b)  # type: ignore[arg-type]
    assert store[("support-1", "tenant-b-secret")].messages == []
    assert len(store[("support-1", "tenant-a-secret")].messages) == 2
    assert craft(conv.invoke("q2", a))["turn"] == 2  # type: ignore[arg-type]


def test_an_evicted_session_starts_over_with_its_chunks() -> None:
    """The engine keeps one conversation's prompt (max_conversations=1): when another session
    evicts s1, s1's next turn is a fresh first turn, its documents all in the prompt."""
    engine, _ = make_fake_engine(max_conversations=1)
    try:
        store: dict[str, Any] = {}
        conv = make_conversation(engine, [docs("a"), docs("b"), docs("a", "c")], store)
        conv.invoke("q1", {"configurable": {"session_id": "s1"}})
        conv.invoke("q", {"configurable": {"session_id": "s2"}})
        msg = conv.invoke("q2", {"configurable": {"session_id": "s1"}})
        assert craft(msg)["turn"] == 1 and craft(msg)["removed_duplicates"] == []
        assert sorted(craft(msg)["chunk_order"]) == ["a", "c"]
    finally:
        engine.close()
