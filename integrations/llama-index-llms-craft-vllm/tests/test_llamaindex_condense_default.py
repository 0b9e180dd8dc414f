"""CraftChatEngine: condense is auto by default (off on the embedded model, with the reason in
``metadata["craft_condense"]``), on for other models, forced by ``condense=True``. Real
CraftEngine (planners, renderer) over a fake forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

from craft_rag.engine import EngineSettings
from craft_rag.engine.condense import Condensed
from craft_rag.testing import FakeBackend, make_fake_engine


class Spy(BaseRetriever):
    def __init__(self) -> None:
        super().__init__()
        self.queries: list[str] = []

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        self.queries.append(query_bundle.query_str)
        n = len(self.queries)
        return [NodeWithScore(node=TextNode(id_=f"n{n}", text=f"passage {n} " * 16), score=1.0)]


@pytest.fixture(params=[None, "org/some-7b-instruct"], ids=["embedded", "served-7b"])
def fake(request: pytest.FixtureRequest) -> Iterator[tuple[CraftVLLM, FakeBackend, bool]]:
    """(LLM, backend, whether the model is the embedded one)."""
    engine, backend = make_fake_engine(settings=EngineSettings(model=request.param))
    yield CraftVLLM(engine, max_tokens=2), backend, request.param is None
    engine.close()


def two_turns(llm: CraftVLLM, **kwargs: Any) -> tuple[Any, Spy]:
    spy = Spy()
    chat = CraftChatEngine(spy, llm, **kwargs)
    chat.chat("Who wrote Hamlet?")
    return chat.chat("Who was his mother?"), spy


@pytest.mark.parametrize("entry", ["chat", "stream_chat"])
def test_auto_condenses_unless_the_model_is_embedded(
    fake: tuple[CraftVLLM, FakeBackend, bool], entry: str
) -> None:
    llm, backend, embedded = fake
    spy = Spy()
    chat = CraftChatEngine(spy, llm)
    chat.chat("Who wrote Hamlet?")
    if entry == "chat":
        second = chat.chat("Who was his mother?")
    else:
        second = chat.stream_chat("Who was his mother?")
        second.print_response_stream()
    condensed = second.metadata["craft_condense"]
    assert isinstance(condensed, Condensed) and condensed is chat.last_condense
    if embedded:
        assert condensed.method == "off" and condensed.report is None
        assert condensed.reason is not None and "embedded" in condensed.reason
        assert spy.queries == ["Who wrote Hamlet?", "Who was his mother?"]
        assert len(backend.added) == 2  # no condense request
    else:
        assert condensed.method in ("llm", "history", "none") and condensed.reason is None
        assert condensed.report is not None and len(backend.added) == 3


def test_an_explicit_choice_wins(fake: tuple[CraftVLLM, FakeBackend, bool]) -> None:
    llm, backend, _ = fake
    forced, _ = two_turns(llm, condense=True)
    assert forced.metadata["craft_condense"].method != "off" and len(backend.added) == 3
    off, spy = two_turns(llm, condense=False)
    assert off.metadata["craft_condense"].reason == "condense=False"
    assert spy.queries[1] == "Who was his mother?"
    with pytest.raises(ValueError, match="condense must be True, False or None"):
        CraftChatEngine(Spy(), llm, condense="yes")  # type: ignore[arg-type]
