"""Multi-turn RAG chat as a LangGraph graph with a checkpointer; CRAFT keeps reuse across turns.

``RunnableWithMessageHistory`` is deprecated in favour of LangGraph persistence. Here the graph's
checkpointer (``InMemorySaver``; any saver works) holds each thread's messages, and one node
answers with :class:`langchain_craft.CraftConversation`: the ``thread_id`` is the conversation
id, so the engine keeps that thread's prompt append-only (earlier turns' KV reused, passages
already sent not sent again) and condenses follow-ups before retrieval. The node reads the
thread's messages from the graph state (``get_session_history``), so a thread the engine no
longer knows (process restart with a persistent saver) starts again with its earlier turns as
text. Retrieval: FAISS over SQuAD paragraphs embedded with the packaged MiniLM
(:func:`langchain_craft.craft_minilm_embeddings`).

Needs: pip install langgraph langchain-huggingface -e benchmarks/craft-rag-bench (the data
loaders; scripts/bootstrap.sh installs all three). Run:
python examples/langgraph_chat.py [--passages N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_craft import ChatCraftVLLM, CraftConversation, craft_minilm_embeddings
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from craft_rag.engine.engine import CraftEngine
from craft_rag_bench.datasets import load_squad

QUESTIONS = (
    "Which NFL team represented the AFC at Super Bowl 50?",
    "Who did they beat?",
    "Where was the game played?",
)


class StateHistory:
    """The thread's messages from the graph state, read-only: the checkpointer owns them (the
    graph appends the reply itself), so ``add_messages`` does nothing."""

    def __init__(self, messages: Sequence[BaseMessage]) -> None:
        self.messages = list(messages)

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """The graph's reducer appends the reply; nothing to do here."""

    def clear(self) -> None:
        self.messages = []


def build_graph(engine: CraftEngine, passages: int, max_tokens: int) -> Any:
    """The compiled graph: START -> answer, with an in-memory checkpointer."""
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document

    squad = load_squad()
    docs = [Document(page_content=p.content, id=p.id) for p in squad.passages[:passages]]
    store = FAISS.from_documents(docs, craft_minilm_embeddings())
    retriever = store.as_retriever(search_kwargs={"k": 3})
    llm = ChatCraftVLLM(engine=engine, max_tokens=max_tokens)

    def answer(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        *earlier, question = state["messages"]
        chat = CraftConversation(
            llm=llm, retriever=retriever, get_session_history=lambda _: StateHistory(earlier)
        )
        return {"messages": [chat.invoke(question.text, config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    return graph.compile(checkpointer=InMemorySaver())


def main(
    engine: CraftEngine | None = None,
    *,
    passages: int = 200,
    max_tokens: int = 48,
    questions: Sequence[str] = QUESTIONS,
) -> list[dict[str, Any]]:
    """Run the questions as one thread; print and return each turn's reuse report."""
    own = engine is None
    engine = engine or CraftEngine()
    try:
        app = build_graph(engine, passages, max_tokens)
        config: RunnableConfig = {"configurable": {"thread_id": f"graph-{uuid.uuid4().hex[:8]}"}}
        reports = []
        for question in questions:
            state = app.invoke({"messages": [HumanMessage(content=question)]}, config)
            reply = state["messages"][-1]
            report = reply.response_metadata["craft"]
            condensed = reply.response_metadata.get("craft_condense", {})
            print(
                f"turn {report['turn']}: {question!r} -> {reply.text.strip()[:60]!r} | "
                f"retrieved with {condensed.get('question', question)!r} | "
                f"cached {report['cached_tokens']}/{report['prompt_tokens']} tokens, "
                f"TTFT {report['ttft_ms']:.0f} ms, not re-sent {report['removed_duplicates']}"
            )
            reports.append(report)
        saved = app.get_state(config).values["messages"]
        print(f"checkpointer holds {len(saved)} messages for the thread")
        return reports
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    main(passages=args.passages, max_tokens=args.max_tokens)
