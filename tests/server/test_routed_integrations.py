"""``server=[url, url]`` on the integrations (LlamaIndex ``CraftVLLM`` and ``CraftChatEngine``,
LangChain ``ChatCraftVLLM`` and ``CraftConversation``) over two in-process fakes of vLLM's HTTP
API (fast; fakes for unit tests only: the real two-server check is
test_routed_integrations_real.py). The integrations stay thin: the list goes to
``CraftEngine(server=[...], routing=...)``, whose routed engine plans every chunk request."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import CHATML, FORMAT, FakeServer, chunks, running

from craft_rag.engine.backends.server.backend import ServerSettings
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.model_args import servers_with, sort_constructor_arguments
from craft_rag.engine.routed_engine import RoutedEngine
from craft_rag.tokenizer import HashingTokenizer


@pytest.fixture
def urls() -> Iterator[list[str]]:
    cms = [running(FakeServer()), running(FakeServer())]
    try:
        yield [cm.__enter__() for cm in cms]
    finally:
        for cm in cms:
            cm.__exit__(None, None, None)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


def make_routed(urls: list[str] | tuple[Any, ...], model_dir: Path, **kw: Any) -> CraftEngine:
    """``CraftEngine(server=[...])`` with the fakes' tokenizer and formats (what a real model
    folder would give)."""
    settings = [
        ServerSettings(u, kv_events=False, backoff=0.01, retries=0) if isinstance(u, str) else u
        for u in urls
    ]
    return CraftEngine(
        EngineSettings(model=model_dir),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        server=settings,
        **kw,
    )


@pytest.fixture
def routed(urls: list[str], model_dir: Path) -> Iterator[CraftEngine]:
    engine = make_routed(urls, model_dir)
    try:
        yield engine
    finally:
        engine.close()


# ---- the argument sorting both LLM classes share ----------------------------------------------


def test_a_server_list_becomes_one_settings_per_replica() -> None:
    got = servers_with(["http://a:1/v1", "http://b:2"], api_key="k", timeout=7)
    assert isinstance(got, tuple) and [s.url for s in got] == ["http://a:1/v1", "http://b:2"]
    assert all(s.api_key == "k" and s.read_timeout == 7 for s in got)
    # The URL aliases take a list too, and the same list twice is one list.
    args = sort_constructor_arguments({"base_url": ["http://a:1", "http://b:2"]}, None)
    assert isinstance(args.server, tuple) and len(args.server) == 2
    same = sort_constructor_arguments(
        {"api_base": ["http://a:1", "http://b:2"]}, ["http://a:1", "http://b:2"]
    )
    assert same.server == args.server
    assert servers_with("http://a:1") == servers_with("http://a:1", None)  # one: unchanged


@pytest.mark.parametrize(
    ("server", "base_url", "fix"),
    [
        ([], None, "server=[url, url, ...] or one URL"),
        (["http://a:1", 3], None, "item 1 must be an http(s) URL"),
        (["http://a:1", "http://b:2"], "http://a:1", "give the list once"),
        (["http://a:1", "http://b:2"], ["http://a:1"], "give the list once"),
    ],
)
def test_a_bad_server_list_is_refused_naming_the_fix(server: Any, base_url: Any, fix: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fix)):
        servers_with(server, base_url)


def test_different_url_aliases_are_refused_without_credentials() -> None:
    with pytest.raises(ValueError, match="give the server URL once") as err:
        sort_constructor_arguments(
            {"base_url": ["http://u:secret@a:1", "http://b:2"], "api_base": "http://a:1"}
        )
    assert "secret" not in str(err.value)


# ---- LlamaIndex ----------------------------------------------------------------------------------


def test_craftvllm_passes_the_list_and_routing_to_the_engine(
    urls: list[str], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("llama_index.core")
    import llama_index.llms.craft_vllm.base as base

    seen: dict[str, Any] = {}

    def started(settings: EngineSettings, **kw: Any) -> CraftEngine:
        seen.update(kw)
        return make_routed(kw["server"], model_dir, routing=kw["routing"])

    monkeypatch.setattr(base, "CraftEngine", started)
    llm = base.CraftVLLM(api_base=urls, routing="round_robin", api_key="k", max_tokens=2)
    try:
        assert [s.url for s in seen["server"]] == urls
        assert all(s.api_key == "k" for s in seen["server"])
        assert seen["routing"] == "round_robin" and llm.routed
        assert isinstance(llm.engine, RoutedEngine)
        assert llm.engine.router.policy.name == "round_robin"
    finally:
        llm.close()


def test_craftvllm_refuses_routing_with_one_server_or_a_given_engine(
    routed: CraftEngine,
) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.llms.craft_vllm import CraftVLLM

    with pytest.raises(ValueError, match=r"pass server=\[url, url, \.\.\.\]"):
        CraftVLLM(server="http://127.0.0.1:9", routing="craft_joint")
    with pytest.raises(ValueError, match="pass routing= without engine="):
        CraftVLLM(routed, routing="round_robin")


def test_craftvllm_chunks_are_routed_planned_and_committed_by_the_engine(
    routed: CraftEngine,
) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.llms.craft_vllm import CraftVLLM

    assert isinstance(routed, RoutedEngine)
    llm = CraftVLLM(routed, max_tokens=2)
    assert llm.routed
    docs = chunks(4, "li")
    first = llm.complete_chunks(docs, "what?").additional_kwargs["craft_reuse"]
    home = first.replica
    assert home in routed.replicas and first.cached_tokens == 0
    again = llm.complete_chunks(docs[::-1], "and?").additional_kwargs["craft_reuse"]
    assert (again.replica, again.chunk_order) == (home, first.chunk_order)
    assert again.cached_tokens > 0
    # Streaming goes the same way.
    last = list(llm.stream_complete_chunks(docs, "streamed?"))[-1]
    assert last.additional_kwargs["craft_reuse"].replica == home
    # Plans cannot come from outside: the message names what to do instead.
    with pytest.raises(ValueError, match="without plan="):
        llm.reorderer()
    with pytest.raises(ValueError, match="without plan="):
        _ = llm.planner


def test_chat_engine_turns_stay_on_their_replica(routed: CraftEngine) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

    assert isinstance(routed, RoutedEngine)
    nodes = [TextNode(id_=c.key, text=c.text) for c in chunks(3, "ce")]
    turns = iter([nodes[:2], [nodes[1], nodes[2]]])

    class Turns(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=n, score=1.0) for n in next(turns)]

    chat = CraftChatEngine(Turns(), CraftVLLM(routed, max_tokens=2), conversation_id="ce1")
    one = chat.chat("First?").metadata["craft_reuse"]
    two = chat.chat("Second?").metadata["craft_reuse"]
    assert one.replica is not None and two.replica == one.replica
    assert (one.turn, two.turn, two.rehomed) == (1, 2, False)
    assert len(two.removed_duplicates) == 1  # the node both turns retrieved, sent once
    assert two.cached_tokens > 0 and chat.last_reorder is None
    assert routed.turn_count("ce1") == 2
    chat.reset()
    assert routed.turn_count("ce1") == 0


# ---- LangChain -----------------------------------------------------------------------------------


def test_chat_model_takes_the_list_and_passes_it_through(
    urls: list[str], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("langchain_core")
    from langchain_craft import ChatCraftVLLM

    import craft_rag.engine

    with pytest.raises(ValueError, match=r"pass server=\[url, url, \.\.\.\]"):
        ChatCraftVLLM(base_url=urls[0], routing="craft_joint")
    secret = [u.replace("http://", "http://user:s3cret-pass@") for u in urls]
    model = ChatCraftVLLM(base_url=secret, routing="round_robin", max_tokens=2)
    assert isinstance(model.server, tuple) and len(model.server) == 2
    dumped = json.dumps(model.model_dump(), default=str)
    assert "s3cret-pass" not in dumped and dumped.count("user:***@") == 2  # redacted
    seen: dict[str, Any] = {}

    def started(settings: EngineSettings, **kw: Any) -> CraftEngine:
        seen.update(kw)
        return make_routed(urls, model_dir, routing=kw["routing"])

    monkeypatch.setattr(craft_rag.engine, "CraftEngine", started)
    try:
        assert model.routed()
        assert [s.url for s in seen["server"]] == secret
        assert seen["routing"] == "round_robin"
    finally:
        model.close()


def test_chat_model_and_conversation_over_a_routed_engine(routed: CraftEngine) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.messages import BaseMessage
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_craft import ChatCraftVLLM, CraftConversation, CraftRAGPrompt

    assert isinstance(routed, RoutedEngine)
    docs = [Document(page_content=c.text, id=c.key) for c in chunks(4, "lc")]
    model = ChatCraftVLLM(engine=routed, max_tokens=2)
    with pytest.raises(ValueError, match="leave reorder_step"):
        model.reorder_step()
    retrieved = iter([docs[:3], docs[:3][::-1]])
    chain = (
        {"context": RunnableLambda(lambda _: next(retrieved)), "question": RunnablePassthrough()}
        | CraftRAGPrompt()
        | model
    )
    first = chain.invoke("Rivers?").response_metadata["craft"]
    second = chain.invoke("Glaciers?").response_metadata["craft"]
    assert first["replica"] in routed.replicas
    assert second["replica"] == first["replica"]
    assert second["chunk_order"] == first["chunk_order"] and second["cached_tokens"] > 0

    class History:
        def __init__(self) -> None:
            self.messages: list[BaseMessage] = []

        def add_messages(self, messages: Any) -> None:
            self.messages.extend(messages)

        def clear(self) -> None:
            self.messages = []

    turns = iter([docs[:2], [docs[1], docs[3]]])
    store: dict[str, History] = {}
    conv = CraftConversation(
        llm=model,
        retriever=RunnableLambda(lambda _: next(turns)),
        get_session_history=lambda sid: store.setdefault(sid, History()),
        condense=False,
    )
    config: Any = {"configurable": {"session_id": "lc-s1"}}
    one = conv.invoke("First?", config).response_metadata["craft"]
    two = conv.invoke("Second?", config).response_metadata["craft"]
    assert two["replica"] == one["replica"] and two["turn"] == 2
    assert two["removed_duplicates"] == ["lc1"]
    assert routed.turn_count("lc-s1") == 2
