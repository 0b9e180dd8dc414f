"""Issue 11 items 3, 10, 12, 13 and issue 15 item 1 for the LangChain adapter (no engine).

* one-shot iterables are read once, before any planner state changes;
* no document the caller passed is dropped, except conversation dedup and exact duplicates;
* one rule for conversation ids (``0`` is the conversation ``"0"`` everywhere);
* a reorder step that only sees a session id reorders and never drops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_craft import CraftDocuments, CraftReorder, CraftRetriever
from langchain_craft._documents import validate_conversation_id
from langchain_craft.prompt import build_context

from craft_rag import CraftPlanner


def docs(*names: str) -> list[Document]:
    return [Document(page_content=f"passage {n}", id=n) for n in names]


def state(planner: CraftPlanner) -> str:
    return json.dumps(planner.to_json(), sort_keys=True)


# ---- item 3: one-shot iterables -------------------------------------------------------------


def test_invoke_with_a_generator_plans_once_and_returns_every_document() -> None:
    step = CraftReorder()
    out = step.invoke(d for d in docs("a", "b", "c"))  # type: ignore[arg-type]
    assert sorted(d.id or "" for d in out) == ["a", "b", "c"]
    assert isinstance(out, CraftDocuments) and out.committed


def test_transform_documents_with_a_generator() -> None:
    out = CraftReorder().transform_documents(d for d in docs("a", "b"))  # type: ignore[arg-type]
    assert len(out) == 2


def test_a_bad_item_late_in_a_generator_changes_nothing() -> None:
    step = CraftReorder()
    before = state(step.planner)

    def items() -> Iterator[Any]:
        yield from docs("a", "b")
        yield "not a document"

    with pytest.raises(ValueError, match=r"documents\[2\] is a str"):
        step.invoke(items())  # type: ignore[arg-type]
    assert state(step.planner) == before


@pytest.mark.parametrize("bad", ["text", Document(page_content="x"), {"a": 1}, 3])
def test_non_sequences_are_refused_before_planning(bad: Any) -> None:
    step = CraftReorder()
    with pytest.raises(ValueError, match="sequence of Documents"):
        step.invoke(bad)


# ---- item 10: nothing dropped ------------------------------------------------------------------


def test_metadata_only_documents_all_pass_through_in_order() -> None:
    items = [Document(page_content="", metadata={"n": n}) for n in range(3)]
    out = CraftReorder().invoke(items)
    assert out == items and [d.metadata["n"] for d in out] == [0, 1, 2]
    assert isinstance(out, CraftDocuments)
    assert out.passthrough == tuple(items) and out.plan is None


def test_documents_without_text_follow_the_planned_ones() -> None:
    blank = Document(page_content="  ", metadata={"kind": "image"})
    items = [blank, *docs("a", "b")]
    out = CraftReorder().invoke(items)
    assert len(out) == 3 and out[-1] is blank
    assert isinstance(out, CraftDocuments) and out.passthrough == (blank,)


def test_equal_text_without_ids_but_different_metadata_is_kept() -> None:
    items = [Document(page_content="same", metadata={"src": s}) for s in ("x", "y", "z")]
    out = CraftReorder().invoke(items)
    assert sorted(d.metadata["src"] for d in out) == ["x", "y", "z"]
    assert isinstance(out, CraftDocuments) and out.repeated_in_request == ()


def test_exact_duplicates_are_reported_not_lost() -> None:
    a = Document(page_content="same", metadata={"src": "x"})
    out = CraftReorder().invoke([a, Document(page_content="same", metadata={"src": "x"})])
    assert isinstance(out, CraftDocuments)
    assert len(out) == 1 and len(out.repeated_in_request) == 1
    with_ids = CraftReorder().invoke([*docs("a"), *docs("a")])
    assert isinstance(with_ids, CraftDocuments)
    assert len(with_ids) == 1 and len(with_ids.repeated_in_request) == 1


def test_prompt_context_skips_documents_without_text() -> None:
    context = build_context([Document(page_content=""), *docs("a")], "q?")
    assert [c.text for c in context.chunks] == ["passage a"]


# ---- item 12: lone surrogates -------------------------------------------------------------------


def test_lone_surrogates_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"documents\[1\].page_content holds a lone surrogate"):
        CraftReorder().invoke([*docs("a"), Document(page_content="bad \ud800")])
    with pytest.raises(ValueError, match="question holds a lone surrogate"):
        build_context(docs("a"), "why \udfff?")


# ---- item 13 / issue 15 item 1: conversation ids ------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("0", "0"), ("c-7", "c-7"), (None, None)])
def test_one_rule_for_conversation_ids(value: Any, expected: str | None) -> None:
    assert validate_conversation_id(value) == expected
    step = CraftReorder(keeps_earlier_chunks=True)
    via_kwarg = step.transform_documents(docs("a"), conversation_id=value)
    via_config = CraftReorder(keeps_earlier_chunks=True).invoke(
        docs("a"), {"configurable": {"thread_id": value}}
    )
    for out in (via_kwarg, via_config):
        assert isinstance(out, CraftDocuments) and out.plan is not None
        assert out.plan.conversation_id == expected


@pytest.mark.parametrize(("thread_id", "expected"), [(0, "0"), (UUID(int=7), str(UUID(int=7)))])
def test_framework_thread_ids_become_their_string(thread_id: Any, expected: str) -> None:
    out = CraftReorder(keeps_earlier_chunks=True).invoke(
        docs("a"), {"configurable": {"thread_id": thread_id}}
    )
    assert isinstance(out, CraftDocuments) and out.plan is not None
    assert out.plan.conversation_id == expected


@pytest.mark.parametrize("bad", [0, 7, True, "", 1.5, b"x", ["c"]])
def test_bad_conversation_ids_are_value_errors(bad: Any) -> None:
    """``0`` is never "no conversation": as an argument it is refused (pass "0")."""
    with pytest.raises(ValueError, match="conversation_id"):
        validate_conversation_id(bad)
    with pytest.raises(ValueError, match="conversation_id"):
        CraftReorder(conversation_id=bad)
    with pytest.raises(ValueError, match="conversation_id"):
        CraftReorder().transform_documents(docs("a"), conversation_id=bad)


def test_keeps_earlier_chunks_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="keeps_earlier_chunks must be True or False"):
        CraftReorder(keeps_earlier_chunks="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["session_id", "thread_id", "conversation_id"])
def test_a_session_id_alone_never_drops_documents(key: str) -> None:
    """The RunnableWithMessageHistory / LangGraph trap: the history holds only questions and
    answers, so a passage sent in turn 1 must be sent again in turn 3."""
    step = CraftReorder()
    config: Any = {"configurable": {key: "user-1"}}
    for turn in (docs("a", "b"), docs("b", "c"), docs("a", "b")):
        out = step.invoke(turn, config)
        assert sorted(d.id or "" for d in out) == sorted(d.id or "" for d in turn)
        assert isinstance(out, CraftDocuments) and out.removed_duplicates == ()
        assert out.plan is not None and out.plan.conversation_id is None


def test_the_explicit_flag_turns_dedup_on() -> None:
    step = CraftReorder(keeps_earlier_chunks=True)
    config: Any = {"configurable": {"session_id": "user-1"}}
    step.invoke(docs("a", "b"), config)
    out = step.invoke(docs("a", "c"), config)
    assert [d.id for d in out] == ["c"]


class Fixed(BaseRetriever):
    def _get_relevant_documents(self, query: str, **kwargs: Any) -> list[Document]:
        return docs("a", "b", "c")


def test_retriever_with_a_session_id_never_drops() -> None:
    retriever = CraftRetriever(retriever=Fixed())
    config: Any = {"configurable": {"session_id": "s"}}
    first = retriever.invoke("q", config)
    second = retriever.invoke("q", config)
    assert len(first) == len(second) == 3


def test_model_paths_name_the_field_for_lone_surrogates() -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_craft import ChatCraftVLLM, CraftVLLM

    from craft_rag.testing import make_fake_engine

    engine, _ = make_fake_engine()
    try:
        chat = ChatCraftVLLM(engine=engine, max_tokens=2)
        with pytest.raises(ValueError, match=r"messages\[1\] content holds a lone surrogate"):
            chat.invoke([AIMessage("fine"), HumanMessage("bad \ud800")])
        with pytest.raises(ValueError, match="question holds a lone surrogate"):
            chat.invoke([HumanMessage("bad \ud800")], documents=docs("a"))
        with pytest.raises(ValueError, match=r"documents\[0\].page_content"):
            chat.invoke([HumanMessage("q")], documents=[Document(page_content="\udfff")])
        with pytest.raises(ValueError, match="prompt holds a lone surrogate"):
            CraftVLLM(engine=engine, max_tokens=2).invoke("bad \ud800")
        with pytest.raises(ValueError, match="conversation_id"):
            chat.invoke([HumanMessage("q")], documents=docs("a"), conversation_id=True)
    finally:
        engine.close()
