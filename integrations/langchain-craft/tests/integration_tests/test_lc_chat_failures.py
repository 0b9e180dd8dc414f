"""A failed turn of CraftConversation must not hang its session: the engine aborts the plan it
made on every failure path, so the next turn on the same session is served. Real in-process
engine; invoke, ainvoke, stream and astream."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_craft import ChatCraftVLLM, CraftConversation

from craft_rag import CraftPlanner

pytestmark = pytest.mark.engine

MODES = ("invoke", "ainvoke", "stream", "astream")
PASSAGE = Document(
    page_content="The Globe Theatre in London was built in 1599 by Shakespeare's company.",
    id="globe",
)
# Far over the test engine's max_model_len (2,048 tokens) on its own.
HUGE = Document(
    page_content=" ".join(f"Filler sentence number {i} says nothing at all." for i in range(700)),
    id="huge",
)


async def turn(conv: CraftConversation, mode: str, docs: list[Document], config: Any) -> str:
    question: Any = {"question": "When was the Globe built?", "documents": docs}
    if mode == "invoke":
        return conv.invoke(question, config).text
    if mode == "ainvoke":
        return (await conv.ainvoke(question, config)).text
    if mode == "stream":
        return "".join(c.text for c in conv.stream(question, config))
    return "".join([c.text async for c in conv.astream(question, config)])


def setup(engine: Any, mode: str) -> tuple[CraftConversation, Any, str]:
    engine.set_planner(CraftPlanner())
    conv = CraftConversation(llm=ChatCraftVLLM(engine=engine, max_tokens=4), condense=False)
    session = f"lc-fail-{mode}-{uuid.uuid4().hex[:8]}"
    return conv, {"configurable": {"session_id": session}}, session


@pytest.mark.parametrize("mode", MODES)
async def test_a_prompt_too_long_for_the_model_fails_and_the_next_turn_is_served(
    craft_engine: Any, mode: str
) -> None:
    conv, config, session = setup(craft_engine, mode)
    with pytest.raises(ValueError, match="max_model_len"):
        await turn(conv, mode, [HUGE], config)
    assert not craft_engine.planner.in_flight(session)
    await turn(conv, mode, [PASSAGE], config)
    assert craft_engine.turn_count(session) == 1
    assert conv.end_session(session)


@pytest.mark.parametrize("mode", MODES)
async def test_an_engine_failure_while_serving_leaves_no_plan_in_flight(
    craft_engine: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    conv, config, session = setup(craft_engine, mode)
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
        await turn(conv, mode, [PASSAGE], config)
    assert not craft_engine.planner.in_flight(session)
    await turn(conv, mode, [PASSAGE], config)
    assert craft_engine.turn_count(session) == 1
    assert conv.end_session(session)
