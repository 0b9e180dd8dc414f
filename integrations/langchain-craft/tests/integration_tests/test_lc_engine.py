"""LangChain paths against the REAL engine (the repository's shared ``craft_engine`` fixture).

Every test here is marked ``engine``; run them alone with
``pytest -m engine integrations/langchain-craft``. The engine is shared with other suites, so
each test uses fresh conversation ids and texts, and never assumes an empty cache unless it
resets it. Replies are kept to a few tokens: the point is the prompt side (reuse, TTFT).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftConversation, CraftRAGPrompt, CraftVLLM
from langchain_craft.conversation import InMemoryHistory as History

from craft_rag import make_chunk
from craft_rag.metrics import chunks_inside_cache

pytestmark = pytest.mark.engine

TOPICS = ["rivers", "volcanoes", "glaciers", "deserts", "forests", "islands", "canyons"]


def passages(tag: str, n: int = 4) -> list[Document]:
    """``n`` distinct ~90-token passages, unique to ``tag`` so no other test shares them."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = " ".join(
            f"Fact {j} about {topic} number {i} from collection {tag}: they shape the land."
            for j in range(6)
        )
        out.append(Document(page_content=text, id=f"{tag}-{i}", metadata={"topic": topic}))
    return out


def craft(msg: Any) -> dict[str, Any]:
    return msg.response_metadata["craft"]  # type: ignore[no-any-return]


def inside_cache(engine: Any, docs: Sequence[Document], report: dict[str, Any]) -> int:
    """The served chunks lying entirely inside ``report``'s cached prefix (issue 11 item 9,
    :func:`craft_rag.metrics.chunks_inside_cache`), over the spans the engine's assembler gives
    ``docs`` in the served order: what ``reused_chunks`` must be."""
    chunks = {d.id: make_chunk(d.page_content, id=d.id) for d in docs}
    served = [chunks[k] for k in report["chunk_order"]]
    spans = engine.assembler.single_turn(served, "?").chunk_spans
    return chunks_inside_cache(spans, report["cached_tokens"])


def test_lcel_chain_aligns_shared_chunks(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    docs = passages(tag, 3)
    retrieved = iter([docs, docs[::-1]])
    chain = (
        {"context": RunnableLambda(lambda _: next(retrieved)), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | ChatCraftVLLM(engine=craft_engine, max_tokens=2)
    )
    first = chain.invoke("Which facts are about rivers?")
    second = chain.invoke("Which facts are about glaciers?")
    assert craft(second)["chunk_order"] == craft(first)["chunk_order"]
    # Every chunk but (at most) the last, whose tail shares a block with the new question.
    assert craft(second)["reused_chunks"] == inside_cache(craft_engine, docs, craft(second)) >= 2
    # Everything up to the end of the last chunk's last full block was cached.
    assert craft(second)["cached_tokens"] >= craft(second)["prompt_tokens"] - 64


def test_rising_cached_tokens_across_turns(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    docs = passages(tag, 5)
    turns = [docs[:2], [docs[1], docs[2]], [docs[0], docs[3], docs[4]]]
    results = iter(turns)
    store: dict[str, History] = {}
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=4),
        retriever=RunnableLambda(lambda _: next(results)),
        get_session_history=lambda sid: store.setdefault(sid, History()),
    )
    config: Any = {"configurable": {"session_id": f"lc-{tag}"}}
    reports = [craft(conv.invoke(q, config)) for q in ("First?", "Second?", "Third?")]
    cached = [r["cached_tokens"] for r in reports]
    assert cached[0] < cached[1] < cached[2], cached
    assert reports[1]["removed_duplicates"] == [f"{tag}-1"]
    assert reports[2]["removed_duplicates"] == [f"{tag}-0"]
    # Append-only: each turn reuses (nearly) all of the previous turn's prompt.
    for prev, cur in itertools.pairwise(reports):
        assert cur["cached_tokens"] >= prev["prompt_tokens"] - craft_engine.block_size
    assert len(store[f"lc-{tag}"].messages) == 6
    assert conv.end_session(f"lc-{tag}")


def test_sessions_with_different_salts_share_nothing(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    docs = passages(tag, 3)
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=2),
        retriever=RunnableLambda(lambda _: docs),
    )

    def ask(session: str, salt: str) -> dict[str, Any]:
        config: Any = {"configurable": {"session_id": f"{session}-{tag}", "cache_salt": salt}}
        return craft(conv.invoke("q", config))

    a = ask("a", f"tenant-a-{tag}")
    b = ask("b", f"tenant-b-{tag}")  # the very same prompt under another salt
    assert a["salted"] and b["salted"]
    assert a["cached_tokens"] == 0 and b["cached_tokens"] == 0
    # Within one salt, another session reuses the shared prompt prefix.
    a2 = ask("a2", f"tenant-a-{tag}")
    assert a2["cached_tokens"] >= a2["prompt_tokens"] - 2 * craft_engine.block_size
    for session, tenant in (("a", "a"), ("b", "b"), ("a2", "a")):
        assert not conv.end_session(f"{session}-{tag}")  # no unsalted session of that id
        salted: Any = {"configurable": {"cache_salt": f"tenant-{tenant}-{tag}"}}
        assert conv.end_session(f"{session}-{tag}", config=salted)


async def test_async_streaming_with_ttft(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    conv = CraftConversation(
        llm=ChatCraftVLLM(engine=craft_engine, max_tokens=4),
        retriever=RunnableLambda(lambda _: passages(tag, 2)),
    )
    config: Any = {"configurable": {"session_id": f"s-{tag}"}}
    chunks = [c async for c in conv.astream("Name one fact.", config)]
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(1 for c in chunks if c.text) >= 1
    report = chunks[-1].response_metadata["craft"]
    assert report["ttft_ms"] > 0 and report["output_tokens"] >= 1
    again = await conv.ainvoke("And another?", config)
    assert craft(again)["turn"] == 2
    assert craft(again)["cached_tokens"] >= report["prompt_tokens"] - craft_engine.block_size


def test_llm_with_documents(craft_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    llm = CraftVLLM(engine=craft_engine, max_tokens=3)
    result = llm.generate(["Which topic?", "Which number?"], documents=passages(tag, 2))
    infos = [g[0].generation_info for g in result.generations]
    assert all(i is not None for i in infos)
    second = infos[1]["craft"]  # type: ignore[index]
    # The shared documents are reused; only the last may miss (its tail shares a block with
    # the other question), so reused_chunks is what chunks_inside_cache says, at least 1.
    assert second["reused_chunks"] == inside_cache(craft_engine, passages(tag, 2), second) >= 1
    assert infos[1]["usage"]["input_token_details"]["cache_read"] > 0  # type: ignore[index]


def test_bad_input_against_the_engine(craft_engine: Any) -> None:
    model = ChatCraftVLLM(engine=craft_engine, max_tokens=2)
    empty = model.invoke("Say hi.", documents=[])
    assert craft(empty)["chunk_order"] == [] and empty.text
    broken = Document.model_construct(page_content=None, metadata={}, id="x")
    with pytest.raises(ValueError, match="no string page_content"):
        model.invoke("q", documents=[broken])
    tag = uuid.uuid4().hex[:8]
    same = [Document(page_content="one text", id=tag), Document(page_content="one text", id=tag)]
    msg = model.invoke("q", documents=same)
    assert craft(msg)["chunk_order"] == [tag]
    assert craft(msg)["repeated_in_request"] == [tag]  # rendered once, reported
    clash = [Document(page_content="one", id=tag), Document(page_content="two", id=tag)]
    with pytest.raises(ValueError, match="distinct ids"):
        model.invoke("q", documents=clash)
