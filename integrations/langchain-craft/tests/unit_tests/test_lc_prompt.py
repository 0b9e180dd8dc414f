"""CraftRAGPrompt: a prompt any chat model reads, with the structured context attached."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_craft import CraftContext, CraftRAGPrompt, CraftReorder, craft_context


def docs(*ids: str) -> list[Document]:
    return [Document(page_content=f"text of {i}", id=i) for i in ids]


def test_renders_text_and_attaches_the_context() -> None:
    value = CraftRAGPrompt().invoke(
        {"context": docs("a", "b"), "question": "why?"}, {"configurable": {"session_id": "s"}}
    )
    [message] = value.to_messages()
    assert message.content == (
        "Answer the question using the documents below. Be brief.\n\n"
        "Document: text of a\n\nDocument: text of b\n\nQuestion: why?"
    )
    context = craft_context(message)
    assert isinstance(context, CraftContext)
    assert [c.key for c in context.chunks] == ["a", "b"]
    assert context.conversation_id == "s" and context.plan is None


def test_works_with_any_chat_model() -> None:
    chain = (
        {"context": RunnableLambda(lambda _: docs("a")), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | FakeListChatModel(responses=["ok"])
    )
    assert chain.invoke("q").content == "ok"


def test_pending_plan_is_handed_on() -> None:
    planned = CraftReorder(commit=False).invoke(docs("b", "a"))
    value = CraftRAGPrompt().invoke({"context": planned, "question": "q"})
    context = craft_context(value.to_messages()[0])
    assert context is not None and context.plan is planned.plan  # type: ignore[attr-defined]
    assert context.committed_by is None


def test_duplicates_render_once() -> None:
    dup = [*docs("a"), Document(page_content="text of a", id="a")]
    value = CraftRAGPrompt().invoke({"context": dup, "question": "q"})
    assert value.to_messages()[0].text.count("text of a") == 1


@pytest.mark.parametrize(
    ("input", "match"),
    [
        ({"question": "q"}, "missing"),
        ({"context": [], "question": " "}, "non-empty"),
        ("just a string", "takes a dict"),
        ({"context": [{"page_content": "x"}], "question": "q"}, "not a langchain_core Document"),
    ],
)
def test_bad_input(input: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CraftRAGPrompt().invoke(input)
