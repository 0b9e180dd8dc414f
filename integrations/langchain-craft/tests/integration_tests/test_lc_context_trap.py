"""Issue 15 item 1 (silent context loss) and issue 11 item 1 (injection) on the REAL engine.

The trap: ``RunnableWithMessageHistory`` (or a LangGraph thread) around
``retriever | CraftReorder | prompt | ChatCraftVLLM``. The wrapper's ``session_id`` /
``thread_id`` used to make ``CraftReorder`` drop every passage sent in an earlier turn, while
the history holds only questions and answers: turn 3, repeating turn 1's question, got an
empty context. Here the prompt the engine actually sent (decoded ``prompt_token_ids``) must
contain every retrieved passage on every turn.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda, RunnablePassthrough
from langchain_craft import ChatCraftVLLM, CraftRAGPrompt, CraftReorder

from craft_rag.testing import control_id_count, forged_control_text
from craft_rag.tokenizer import HFTokenizer

pytestmark = pytest.mark.engine


class SpyHandle:
    """A request handle whose iteration records the finished request's prompt ids; the rest
    (``prompt_token_ids``, ``abort``...) is the real handle's."""

    def __init__(self, handle: Any, prompts: list[tuple[int, ...]]) -> None:
        self._handle = handle
        self._prompts = prompts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __iter__(self) -> Iterator[Any]:
        for piece in self._handle:
            if piece.result is not None:
                self._prompts.append(piece.result.prompt_token_ids)
            yield piece


class SpyEngine:
    """The real engine, recording the exact prompt ids of every finished request."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prompts: list[tuple[int, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: Any) -> SpyHandle:
        """The models' one engine call (``engine.submit``); they iterate the handle."""
        return SpyHandle(self._engine.submit(request), self.prompts)

    def decode(self, ids: tuple[int, ...]) -> str:
        tok = self._engine.assembler.tokenizer
        assert isinstance(tok, HFTokenizer)
        return str(tok._tok.decode(list(ids), skip_special_tokens=False))


class TopicRetriever(BaseRetriever):
    """A keyword retriever over a fixed corpus: each question's topic -> its two passages."""

    corpus: dict[str, list[Document]]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [d for topic, docs in self.corpus.items() if topic in query for d in docs]


def corpus(tag: str) -> dict[str, list[Document]]:
    def doc(topic: str, i: int) -> Document:
        text = f"Passage {i} on {topic} ({tag}): the {topic} of the region are old and wide."
        return Document(page_content=text, id=f"{tag}-{topic}-{i}")

    return {topic: [doc(topic, i) for i in range(2)] for topic in ("rivers", "castles")}


QUESTIONS = ["Tell me about rivers.", "And the castles?", "Tell me about rivers."]

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer from these passages:\n{context}"),
        MessagesPlaceholder("history"),
        ("human", "{question}"),
    ]
)


def join(docs: list[Document]) -> str:
    return "\n".join(d.page_content for d in docs)


def assert_every_passage_sent(spy: SpyEngine, retriever: TopicRetriever) -> None:
    assert len(spy.prompts) == len(QUESTIONS)
    for question, ids in zip(QUESTIONS, spy.prompts, strict=True):
        text = spy.decode(ids)
        wanted = retriever.invoke(question)
        assert wanted, "the retriever found nothing"
        for doc in wanted:
            assert doc.page_content in text, f"turn {question!r} lost {doc.id}"


@pytest.mark.parametrize("step", ["default", "reorder_step"])
def test_runnable_with_message_history_never_loses_passages(craft_engine: Any, step: str) -> None:
    from langchain_core.runnables.history import RunnableWithMessageHistory

    spy = SpyEngine(craft_engine)
    llm = ChatCraftVLLM(engine=spy, max_tokens=2)
    reorder = CraftReorder() if step == "default" else llm.reorder_step()
    retriever = TopicRetriever(corpus=corpus(uuid.uuid4().hex[:8]))
    chain = (
        RunnablePassthrough.assign(
            context=itemgetter("question") | retriever | reorder | RunnableLambda(join)
        )
        | PROMPT
        | llm
    )
    histories: dict[str, InMemoryChatMessageHistory] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapped = RunnableWithMessageHistory(
            chain,
            lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
            input_messages_key="question",
            history_messages_key="history",
        )
    config: Any = {"configurable": {"session_id": f"s-{uuid.uuid4().hex}"}}
    for question in QUESTIONS:
        wrapped.invoke({"question": question}, config)
    assert_every_passage_sent(spy, retriever)
    assert len(next(iter(histories.values())).messages) == 2 * len(QUESTIONS)


def test_langgraph_thread_never_loses_passages(craft_engine: Any) -> None:
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    spy = SpyEngine(craft_engine)
    llm = ChatCraftVLLM(engine=spy, max_tokens=2)
    reorder = CraftReorder()
    retriever = TopicRetriever(corpus=corpus(uuid.uuid4().hex[:8]))

    def answer(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        question = state["messages"][-1].text
        docs = reorder.invoke(retriever.invoke(question), config)
        prompt = PROMPT.invoke(
            {"context": join(docs), "history": state["messages"][:-1], "question": question}
        )
        return {"messages": [llm.invoke(prompt, config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    app = graph.compile(checkpointer=MemorySaver())
    config: Any = {"configurable": {"thread_id": uuid.uuid4()}}
    for question in QUESTIONS:
        app.invoke({"messages": [HumanMessage(question)]}, config)
    assert_every_passage_sent(spy, retriever)


def test_append_only_engine_conversation_still_deduplicates(craft_engine: Any) -> None:
    """CraftRAGPrompt | ChatCraftVLLM with a session id is the engine's append-only
    conversation: turn 3 re-sends nothing, and its prompt still holds turn 1's passages."""
    spy = SpyEngine(craft_engine)
    llm = ChatCraftVLLM(engine=spy, max_tokens=2)
    retriever = TopicRetriever(corpus=corpus(uuid.uuid4().hex[:8]))
    chain = {"context": retriever, "question": RunnablePassthrough()} | CraftRAGPrompt() | llm
    conv = f"c-{uuid.uuid4().hex}"
    replies = [chain.invoke(q, {"configurable": {"session_id": conv}}) for q in QUESTIONS]
    assert replies[2].response_metadata["craft"]["removed_duplicates"]
    assert_every_passage_sent(spy, retriever)
    craft_engine.end_conversation(conv)


def test_poisoned_passages_and_messages_add_no_control_ids(craft_engine: Any) -> None:
    tok = craft_engine.assembler.tokenizer
    assert isinstance(tok, HFTokenizer)
    evil = forged_control_text(tok)

    def run(text: str) -> list[int]:
        spy = SpyEngine(craft_engine)
        llm = ChatCraftVLLM(engine=spy, max_tokens=1)
        tag = uuid.uuid4().hex[:8]
        docs = [Document(page_content=f"{text} {tag} {i}", id=f"{tag}-{i}") for i in range(2)]
        rag = CraftRAGPrompt().invoke({"context": docs, "question": text})
        llm.invoke(rag)
        llm.invoke(PROMPT.invoke({"context": text, "history": [], "question": text}))
        return [control_id_count(tok, ids) for ids in spy.prompts]

    assert run(evil) == run("Calm words.")
