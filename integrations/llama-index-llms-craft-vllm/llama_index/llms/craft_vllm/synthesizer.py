"""Prompt fidelity for query engines: a synthesizer that hands chunks to the engine intact.

LlamaIndex's default response modes repack retrieved text (``CompactAndRefine`` joins and
re-splits it to fill the context window, ``TreeSummarize`` summarises it), so two requests
sharing chunks no longer share token-identical prefixes and CRAFT's order is lost.
:class:`CraftSynthesizer` passes each node as one chunk, in the order the pipeline produced
(CRAFT's), to :meth:`CraftVLLM.complete_chunks`, which renders them token-exactly.

Wiring (what :func:`craft_query_engine` builds)::

    llm = CraftVLLM(engine)
    engine = RetrieverQueryEngine(
        retriever,
        response_synthesizer=CraftSynthesizer(llm),
        node_postprocessors=[*your_filters, llm.reorderer()],   # CRAFT last
    )

``llm.reorderer()`` plans with the engine's planner and parks the plan; ``complete_chunks``
claims it and the engine serves exactly that plan (``plan=``) and commits it with what vLLM
reused. With no reorderer, ``complete_chunks`` plans the nodes with the same planner.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import NodeWithScore
from llama_index.core.types import RESPONSE_TEXT_TYPE
from llama_index.llms.craft_vllm.base import REUSE_KEY, CraftVLLM
from llama_index.llms.craft_vllm.calls import LEGACY_REUSE_KEY
from llama_index.postprocessor.craft import KeySource, default_key_source, split_nodes
from llama_index_instrumentation import get_dispatcher

from craft_rag import Chunk, Plan, make_chunk, validate_conversation_id

dispatcher = get_dispatcher(__name__)

SKIPPED_KEY = "craft_skipped_nodes"
"""Response metadata key: ids of source nodes that could not be sent as text chunks."""


class CraftSynthesizer(BaseSynthesizer):
    """Sends the nodes as chunks, unchanged and in order, to a :class:`CraftVLLM`.

    Non-text and empty nodes cannot be rendered as chunks: they stay in ``source_nodes`` and
    their ids are listed under ``metadata["craft_skipped_nodes"]``. The engine's reuse report is
    ``metadata["craft_reuse"]`` (``"reuse_report"``: deprecated alias; for streaming
    responses, once the stream is consumed).
    ``sampling`` (``max_tokens``, ``temperature``...) go to every engine call. ``key_source``
    ``None``: the reorderer's default (content hashes when the planner shares a store).
    """

    def __init__(
        self,
        llm: CraftVLLM,
        *,
        streaming: bool = False,
        key_source: KeySource | None = None,
        conversation_id: str | None = None,
        callback_manager: CallbackManager | None = None,
        **sampling: Any,
    ) -> None:
        if not isinstance(llm, CraftVLLM):
            msg = (
                f"CraftSynthesizer needs a CraftVLLM (it passes chunks to the engine), got "
                f"{type(llm).__name__}; use a default response mode for other LLMs"
            )
            raise ValueError(msg)
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._craft_llm = llm
        # None: content hashes when the planner is shared across workers (as the reorderer's).
        self._key_source: KeySource = key_source or default_key_source(llm.planner)
        self._conversation_id = validate_conversation_id(conversation_id)
        self._sampling = dict(sampling)
        llm._options(dict(sampling))  # validate the names now, not on the first query

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        """No prompt templates: the engine renders chunks token-exactly itself."""

    # ---- core: nodes -> chunks -> engine -> response; sync and async differ in one call ----

    def _job(
        self,
        question: str,
        chunks: Sequence[Chunk],
        sources: list[NodeWithScore],
        metadata: dict[str, Any],
        response_kwargs: dict[str, Any],
    ) -> _Job:
        kwargs = {"conversation_id": self._conversation_id, **self._sampling, **response_kwargs}
        return _Job(list(chunks), question, kwargs, sources, metadata)

    def _start(
        self,
        query: QueryTextType,
        nodes: Sequence[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None,
        response_kwargs: dict[str, Any],
        streaming_async: bool,
    ) -> _Job | RESPONSE_TYPE:
        """What :meth:`synthesize` and :meth:`asynthesize` do before the engine call, once:
        emit ``SynthesizeStartEvent``, then the job for ``nodes``, or, when there are none, the
        finished empty response (its ``SynthesizeEndEvent`` emitted; no engine call), unless a
        reorderer parked a plan for this conversation turn (every node sent before): then
        the job serves that plan with no chunks."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        question = query if isinstance(query, str) else query.query_str
        if not nodes:
            parked = self._parked_turn(response_kwargs)
            if parked is None:
                return self._empty(query, streaming_async)
            # Every node was sent in an earlier turn: the turn still goes to the engine (its
            # conversation's prompt carries them), serving the plan the reorderer parked.
            job = self._job(question, [], [], {}, {**response_kwargs, "plan": parked})
            job.give_up = functools.partial(self._craft_llm.planner.abort, parked)
            return job
        nodes = list(nodes)  # read once: a generator feeds both the chunks and source_nodes
        split = split_nodes(nodes, self._key_source)
        sources = list(nodes) + list(additional_source_nodes or [])
        metadata: dict[str, Any] = self._get_metadata_for_response([n.node for n in sources]) or {}
        if split.passthrough:
            metadata[SKIPPED_KEY] = [n.node.node_id for n in split.passthrough]
        return self._job(question, split.chunks, sources, metadata, response_kwargs)

    def _parked_turn(self, response_kwargs: dict[str, Any]) -> Plan | None:
        """The plan a reorderer parked for a conversation turn whose nodes were all sent in
        earlier turns (no chunks left), now reserved for this call; None when there is none
        (no conversation, or nothing was planned: LlamaIndex's empty response). Without this
        the plan would stay in flight and block the conversation's next turn. O(1)."""
        kwargs = {"conversation_id": self._conversation_id, **response_kwargs}
        conv = validate_conversation_id(kwargs["conversation_id"])
        if conv is None or "plan" in kwargs:
            return None
        return self._craft_llm.planner.reserve(conv, [])

    def _respond(self, job: _Job) -> RESPONSE_TYPE:
        llm = self._craft_llm
        with job.giving_up_on_failure():
            if self._streaming:
                stream = llm.stream_complete_chunks(job.chunks, job.question, **job.kwargs)
                return job.streaming(StreamingResponse, self._stream_text(stream, job))
            return job.response(llm.complete_chunks(job.chunks, job.question, **job.kwargs))

    async def _arespond(self, job: _Job) -> RESPONSE_TYPE:
        llm = self._craft_llm
        with job.giving_up_on_failure():
            if self._streaming:
                stream = llm.astream_complete_chunks(job.chunks, job.question, **job.kwargs)
                return job.streaming(AsyncStreamingResponse, self._astream_text(stream, job))
            done = await llm.acomplete_chunks(job.chunks, job.question, **job.kwargs)
            return job.response(done)

    @staticmethod
    def _reuse(response: CompletionResponse, metadata: dict[str, Any]) -> str:
        """The delta of one streamed response; the last one's report goes into ``metadata``."""
        if REUSE_KEY in response.additional_kwargs:
            metadata[REUSE_KEY] = response.additional_kwargs[REUSE_KEY]
            metadata[LEGACY_REUSE_KEY] = response.additional_kwargs[REUSE_KEY]  # deprecated
        return response.delta or ""

    def _stream_text(
        self, responses: Generator[CompletionResponse, None, None], job: _Job
    ) -> Generator[str, None, None]:
        with job.giving_up_on_failure():
            for r in responses:
                if delta := self._reuse(r, job.metadata):
                    yield delta

    async def _astream_text(
        self, responses: AsyncGenerator[CompletionResponse, None], job: _Job
    ) -> AsyncGenerator[str, None]:
        with job.giving_up_on_failure():
            async for r in responses:
                if delta := self._reuse(r, job.metadata):
                    yield delta

    def _empty(self, query: QueryTextType, streaming_async: bool) -> RESPONSE_TYPE:
        response: RESPONSE_TYPE
        if self._streaming:
            gen: Any = (
                self._empty_response_agenerator()
                if streaming_async
                else self._empty_response_generator()
            )
            response = (
                AsyncStreamingResponse(response_gen=gen)
                if streaming_async
                else StreamingResponse(response_gen=gen)
            )
        else:
            response = Response(self._empty_response)
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @contextmanager
    def _traced(
        self, query: QueryTextType, job: _Job
    ) -> Iterator[Callable[[RESPONSE_TYPE], RESPONSE_TYPE]]:
        """The callback-manager span around the engine call; yields ``done(response)``, which
        ends the span and emits ``SynthesizeEndEvent``."""
        payload: dict[str, Any] = {EventPayload.QUERY_STR: job.question}
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload=payload) as event:

            def done(response: RESPONSE_TYPE) -> RESPONSE_TYPE:
                event.on_end(payload={EventPayload.RESPONSE: response})
                dispatcher.event(SynthesizeEndEvent(query=query, response=response))
                return response

            yield done

    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        job = self._start(query, nodes, additional_source_nodes, response_kwargs, False)
        if not isinstance(job, _Job):
            return job
        with self._traced(query, job) as done:
            return done(self._respond(job))

    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        job = self._start(query, nodes, additional_source_nodes, response_kwargs, True)
        if not isinstance(job, _Job):
            return job
        with self._traced(query, job) as done:
            return done(await self._arespond(job))

    # ---- the text-chunk interface BaseSynthesizer requires ----

    def _text_job(
        self, query_str: str, text_chunks: Sequence[str], response_kwargs: dict[str, Any]
    ) -> _Job:
        """Bare text chunks (no node ids): each is one chunk keyed by its content hash."""
        return self._job(query_str, [make_chunk(t) for t in text_chunks], [], {}, response_kwargs)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        return _text(self._respond(self._text_job(query_str, text_chunks, response_kwargs)))

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        return _text(await self._arespond(self._text_job(query_str, text_chunks, response_kwargs)))


@dataclass(slots=True)
class _Job:
    """One synthesis: the engine request's arguments and what goes back to the caller.
    ``metadata`` is shared with the response (a stream adds the report when it ends)."""

    chunks: list[Chunk]
    question: str
    kwargs: dict[str, Any]
    sources: list[NodeWithScore]
    metadata: dict[str, Any]
    give_up: Callable[[], object] | None = None
    """Aborts the plan this synthesis reserved itself (``kwargs["plan"]``) when the request
    fails or its stream is closed early (a committed plan is left alone); the engine hands a
    ``plan=`` back to its holder, so without it the conversation keeps a plan in flight."""

    @contextmanager
    def giving_up_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if self.give_up is not None:
                self.give_up()
            raise

    def response(self, done: CompletionResponse) -> Response:
        self.metadata[REUSE_KEY] = done.additional_kwargs[REUSE_KEY]
        return Response(done.text, source_nodes=self.sources, metadata=self.metadata)

    def streaming(
        self,
        cls: type[StreamingResponse] | type[AsyncStreamingResponse],
        gen: Any,
    ) -> StreamingResponse | AsyncStreamingResponse:
        return cls(response_gen=gen, source_nodes=self.sources, metadata=self.metadata)


def _text(response: RESPONSE_TYPE) -> RESPONSE_TEXT_TYPE:
    if isinstance(response, StreamingResponse | AsyncStreamingResponse):
        return response.response_gen
    return response.response or ""


def craft_query_engine(
    retriever: BaseRetriever,
    llm: CraftVLLM,
    *,
    node_postprocessors: Sequence[BaseNodePostprocessor] = (),
    streaming: bool = False,
    key_source: KeySource | None = None,
    conversation_id: str | None = None,
    **sampling: Any,
) -> RetrieverQueryEngine:
    """A ``RetrieverQueryEngine`` with CRAFT end to end: ``node_postprocessors`` first, then
    ``llm.reorderer()`` (the engine's planner for ``llm.cache_salt``, plans parked for the
    engine), then :class:`CraftSynthesizer` (chunks intact, in CRAFT order, the parked plan
    served with ``plan=``). ``sampling`` go to every engine call; the cache salt is the LLM's
    (``ValueError`` for another one: its planner did not make the parked plans).
    ``key_source`` ``None``: ``"content_hash"`` when that planner shares a store with other
    workers, else ``"node_id"`` (one choice for the reorderer and the synthesizer)."""
    if sampling.get("cache_salt", llm.cache_salt) != llm.cache_salt:
        msg = (
            "craft_query_engine serves plans made by the LLM's planner, so it uses the LLM's "
            "cache_salt; build the LLM with the salt instead: CraftVLLM(engine, cache_salt=...)"
        )
        raise ValueError(msg)
    key_source = key_source or default_key_source(llm.planner)
    # CraftSynthesizer serves the engine's append-only conversation: earlier chunks stay in it.
    # The reorderer fits each turn for the reply budget the synthesizer asks for.
    max_tokens = llm._options(dict(sampling))[0].max_tokens
    reorderer = llm.reorderer(
        key_source=key_source,
        conversation_id=conversation_id,
        keeps_earlier_chunks=True,
        max_tokens=max_tokens,
    )
    synthesizer = CraftSynthesizer(
        llm,
        streaming=streaming,
        key_source=key_source,
        conversation_id=conversation_id,
        **sampling,
    )
    return RetrieverQueryEngine(
        retriever,
        response_synthesizer=synthesizer,
        node_postprocessors=[*node_postprocessors, reorderer],
    )
