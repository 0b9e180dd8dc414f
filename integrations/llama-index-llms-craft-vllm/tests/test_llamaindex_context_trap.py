"""Issue 15 item 1 (silent context loss) and issue 11 item 1 (injection), LlamaIndex side, on
the real engine and a real faiss index.

The trap: a query engine with LlamaIndex's own synthesizer and a reorder postprocessor given a
conversation id. Its prompt holds this turn's nodes only, so a postprocessor that dropped the
nodes an earlier turn "sent" lost them (turn 3 repeating turn 1's question had no context).
Every turn's prompt as the engine received it must hold every node the query engine answered
from. ``craft_query_engine`` (the engine's append-only conversation) still deduplicates.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.llms.craft_vllm import CraftVLLM, craft_query_engine
from llama_index.postprocessor.craft import CraftReorderPostprocessor
from llama_index.postprocessor.craft.testing import SquadIndex

from craft_rag import CraftPlanner, make_chunk
from craft_rag.testing import control_id_count, forged_control_text
from craft_rag.tokenizer import HFTokenizer

pytestmark = [pytest.mark.engine, pytest.mark.retrieval]

TOP_K = 2


@pytest.fixture
def llm(craft_engine: Any) -> CraftVLLM:
    craft_engine.set_planner(CraftPlanner())
    return CraftVLLM(craft_engine, max_tokens=2)


def decode(craft_engine: Any, ids: tuple[int, ...]) -> str:
    tok = craft_engine.assembler.tokenizer
    assert isinstance(tok, HFTokenizer)
    return str(tok._tok.decode(list(ids), skip_special_tokens=False))


def questions(squad_index: SquadIndex) -> list[str]:
    q1, q2 = squad_index.questions[0], squad_index.questions[7]
    return [q1, q2, q1]


@pytest.mark.parametrize("wiring", ["postprocessor", "reorderer"])
def test_query_engine_with_a_conversation_id_never_loses_nodes(
    craft_engine: Any,
    llm: CraftVLLM,
    squad_index: SquadIndex,
    submitted: list[tuple[int, ...]],
    wiring: str,
) -> None:
    conv = f"user-{uuid.uuid4().hex}"
    pp = (
        CraftReorderPostprocessor(conversation_id=conv)
        if wiring == "postprocessor"
        else llm.reorderer(conversation_id=conv)
    )
    engine = squad_index.index.as_query_engine(
        llm=llm, node_postprocessors=[pp], similarity_top_k=TOP_K
    )
    for question in questions(squad_index):
        before = len(submitted)
        response = engine.query(question)
        assert len(response.source_nodes) == TOP_K  # nothing dropped
        sent = "".join(decode(craft_engine, ids) for ids in submitted[before:])
        for node in response.source_nodes:
            assert node.node.get_content() in sent, f"{question!r} lost {node.node.node_id}"


def test_craft_query_engine_conversation_keeps_earlier_nodes_in_the_prompt(
    craft_engine: Any, llm: CraftVLLM, squad_index: SquadIndex, submitted: list[tuple[int, ...]]
) -> None:
    conv = f"user-{uuid.uuid4().hex}"
    retriever = squad_index.index.as_retriever(similarity_top_k=TOP_K)
    engine = craft_query_engine(retriever, llm, conversation_id=conv)
    asked = questions(squad_index)
    first = engine.query(asked[0])
    engine.query(asked[1])
    third = engine.query(asked[2])
    text = decode(craft_engine, submitted[-1])
    assert first.source_nodes and not third.source_nodes  # all of turn 3's nodes were sent
    for node in first.source_nodes:
        # Turn 1's nodes are still in turn 3's prompt, once: the append-only conversation
        # keeps them and dedup did not send them again.
        assert text.count(node.node.get_content()) == 1
    craft_engine.end_conversation(conv)


def test_poisoned_chunks_messages_and_prompts_add_no_control_ids(
    craft_engine: Any, llm: CraftVLLM, submitted: list[tuple[int, ...]]
) -> None:
    tok = craft_engine.assembler.tokenizer
    assert isinstance(tok, HFTokenizer)
    evil = forged_control_text(tok)

    def run(text: str) -> list[int]:
        start = len(submitted)
        tag = uuid.uuid4().hex[:8]
        llm.complete_chunks([make_chunk(f"{text} {tag}", id=f"p-{tag}")], f"{text}?")
        llm.chat([ChatMessage(role=MessageRole.USER, content=text)])
        llm.complete(text, formatted=True)
        return [control_id_count(tok, ids) for ids in submitted[start:]]

    clean, poisoned = run("Calm words."), run(evil)
    assert len(clean) == 3 and clean[2] == 0  # a formatted prompt is all caller text
    assert poisoned == clean


def test_one_shot_iterables_are_read_once_on_the_engine_paths(
    llm: CraftVLLM, squad_index: SquadIndex, submitted: list[tuple[int, ...]]
) -> None:
    """Issue 11 item 3: a generator of nodes or chunks is neither lost nor half-used."""
    from llama_index.llms.craft_vllm import CraftSynthesizer

    nodes = squad_index.index.as_retriever(similarity_top_k=TOP_K).retrieve(
        squad_index.questions[3]
    )
    response = CraftSynthesizer(llm, max_tokens=1).synthesize(
        squad_index.questions[3],
        nodes=(n for n in nodes),  # type: ignore[arg-type]
    )
    assert len(response.source_nodes) == len(nodes) == TOP_K
    tag = uuid.uuid4().hex[:8]
    chunks = [make_chunk(f"Gen chunk {i} {tag}.", id=f"g-{tag}-{i}") for i in range(2)]
    before = len(submitted)
    llm.complete_chunks((c for c in chunks), "Which chunks?")  # type: ignore[arg-type]
    assert all(c.text in decode(llm.engine, submitted[before]) for c in chunks)
    with pytest.raises(ValueError, match=r"chunks\[1\] is a str"):
        llm.complete_chunks(iter([chunks[0], "not a chunk"]), "q?")  # type: ignore[arg-type]
