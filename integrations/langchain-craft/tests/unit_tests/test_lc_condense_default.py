"""CraftConversation: condense is auto by default (off on the embedded model, with the reason in
``response_metadata["craft_condense"]``), and ``system_prompt``/``context_prompt`` are the
engine's prompt head. Real CraftEngine over a fake forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from langchain_craft import ChatCraftVLLM, CraftConversation

from craft_rag import DEFAULT_INSTRUCTIONS
from craft_rag.engine import EngineSettings
from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_fake_engine

CONFIG: Any = {"configurable": {"session_id": "s1"}}


@pytest.fixture
def served_big() -> Iterator[tuple[CraftEngine, FakeBackend]]:
    """An engine whose settings name a model that is not embedded (a larger served model)."""
    engine, backend = make_fake_engine(settings=EngineSettings(model="org/some-7b-instruct"))
    yield engine, backend
    engine.close()


def two_turns(engine: CraftEngine, **kwargs: Any) -> tuple[Any, list[str]]:
    queries: list[str] = []

    def retrieve(q: str) -> list[Document]:
        queries.append(q)
        return [Document(page_content=f"passage about {q} " * 8, id=str(len(queries)))]

    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=engine, max_tokens=2), retriever=RunnableLambda(retrieve), **kwargs
    )
    conv.invoke("Who wrote Hamlet?", CONFIG)
    return conv.invoke("Who was his mother?", CONFIG), queries


def test_embedded_model_retrieves_with_the_raw_follow_up_and_says_why(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    second, queries = two_turns(fake[0])
    condensed = second.response_metadata["craft_condense"]
    assert condensed["method"] == "off" and condensed["report"] is None
    assert "embedded" in condensed["reason"] and "condense=True" in condensed["reason"]
    assert queries == ["Who wrote Hamlet?", "Who was his mother?"]
    assert len(fake[1].added) == 2  # the two turns, no condense request


def test_condense_true_still_condenses_on_the_embedded_model(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    second, _ = two_turns(fake[0], condense=True)
    assert second.response_metadata["craft_condense"]["method"] != "off"
    assert len(fake[1].added) == 3  # turn 1, the condense request, turn 2


def test_auto_condenses_on_a_model_that_is_not_embedded(
    served_big: tuple[CraftEngine, FakeBackend],
) -> None:
    second, _ = two_turns(served_big[0])
    condensed = second.response_metadata["craft_condense"]
    assert condensed["method"] in ("llm", "history", "none") and condensed["reason"] is None
    assert condensed["report"] is not None and len(served_big[1].added) == 3


def test_condense_false_reports_off_by_the_caller(fake: tuple[CraftEngine, FakeBackend]) -> None:
    second, _ = two_turns(fake[0], condense=False)
    assert second.response_metadata["craft_condense"]["reason"] == "condense=False"
    with pytest.raises(ValueError, match="condense"):
        two_turns(fake[0], condense="yes")


def test_system_and_context_prompt_must_match_the_engine() -> None:
    engine, _ = make_fake_engine(system_prompt="You are terse.", instructions="Use these:")
    try:
        llm = ChatCraftVLLM(engine=engine)
        ok = CraftConversation(llm=llm, system_prompt="You are terse.", context_prompt="Use these:")
        assert ok.system_prompt == "You are terse."
        for bad in ({"system_prompt": "You are verbose."}, {"context_prompt": "Other:"}):
            with pytest.raises(ValueError, match=f"{next(iter(bad))}=.*differs.*ChatCraftVLLM"):
                CraftConversation(llm=llm, **bad)
    finally:
        engine.close()


def test_without_llm_the_model_is_started_with_the_prompt_head() -> None:
    conv = CraftConversation(system_prompt="S", context_prompt="C")
    assert (conv.llm.system_prompt, conv.llm.context_prompt) == ("S", "C")
    assert conv.llm.engine is None  # nothing started yet: the engine starts on first use
    # A given model that will start its own engine must carry the same head.
    with pytest.raises(ValueError, match="system_prompt"):
        CraftConversation(llm=ChatCraftVLLM(), system_prompt="S")
    with pytest.raises(ValueError, match="context_prompt"):
        CraftConversation(llm=ChatCraftVLLM(), context_prompt="C")
    assert CraftConversation(llm=ChatCraftVLLM(), context_prompt=DEFAULT_INSTRUCTIONS)
