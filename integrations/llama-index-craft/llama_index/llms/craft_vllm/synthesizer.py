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

``llm.reorderer()`` plans with the engine's planner and parks the plan; the engine serves that
plan and commits it with what vLLM reused. With no reorderer the engine plans the nodes itself.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
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
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE
from llama_index.llms.craft_vllm.base import REUSE_KEY, CraftVLLM
from llama_index.postprocessor.craft.nodes import KeySource, split_nodes
from llama_index_instrumentation import get_dispatcher

from craft_rag import Chunk, make_chunk

dispatcher = get_dispatcher(__name__)

SKIPPED_KEY = "craft_skipped_nodes"
"""Response metadata key: ids of source nodes that could not be sent as text chunks."""


class CraftSynthesizer(BaseSynthesizer):
    """Sends the nodes as chunks, unchanged and in order, to a :class:`CraftVLLM`.

    Non-text and empty nodes cannot be rendered as chunks: they stay in ``source_nodes`` and
    their ids are listed under ``metadata["craft_skipped_nodes"]``. The engine's reuse report is
    ``metadata["reuse_report"]`` (for streaming responses, once the stream is consumed).
    ``sampling`` (``max_tokens``, ``temperature``...) go to every engine call.
    """

    def __init__(
        self,
        llm: CraftVLLM,
        *,
        streaming: bool = False,
        key_source: KeySource = "node_id",
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
        self._key_source: KeySource = key_source
        self._conversation_id = conversation_id
        self._sampling = dict(sampling)
        llm._sampling(dict(sampling))  # validate the names now, not on the first query

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        """No prompt templates: the engine renders chunks token-exactly itself."""

    # ---- core: nodes -> chunks -> engine -> response ----

    def _chunks(self, nodes: Sequence[NodeWithScore]) -> tuple[list[Chunk], list[str]]:
        split = split_nodes(nodes, self._key_source)
        return list(split.chunks), [n.node.node_id for n in split.passthrough]

    def _metadata(self, nodes: Sequence[NodeWithScore], skipped: list[str]) -> dict[str, Any]:
        metadata: dict[str, Any] = self._get_metadata_for_response([n.node for n in nodes]) or {}
        if skipped:
            metadata[SKIPPED_KEY] = skipped
        return metadata

    def _stream_text(
        self, responses: Generator[CompletionResponse, None, None], metadata: dict[str, Any]
    ) -> Generator[str, None, None]:
        for r in responses:
            if REUSE_KEY in r.additional_kwargs:
                metadata[REUSE_KEY] = r.additional_kwargs[REUSE_KEY]
            if r.delta:
                yield r.delta

    async def _astream_text(
        self, responses: AsyncGenerator[CompletionResponse, None], metadata: dict[str, Any]
    ) -> AsyncGenerator[str, None]:
        async for r in responses:
            if REUSE_KEY in r.additional_kwargs:
                metadata[REUSE_KEY] = r.additional_kwargs[REUSE_KEY]
            if r.delta:
                yield r.delta

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

    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            return self._empty(query, streaming_async=False)
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        chunks, skipped = self._chunks(nodes)
        sources = list(nodes) + list(additional_source_nodes or [])
        metadata = self._metadata(sources, skipped)
        kwargs = {**self._sampling, **response_kwargs}
        llm, conv = self._craft_llm, self._conversation_id
        response: RESPONSE_TYPE
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
        ) as event:
            if self._streaming:
                stream = llm.stream_complete_chunks(
                    chunks, bundle.query_str, conversation_id=conv, **kwargs
                )
                response = StreamingResponse(
                    response_gen=self._stream_text(stream, metadata),
                    source_nodes=sources,
                    metadata=metadata,
                )
            else:
                done = llm.complete_chunks(chunks, bundle.query_str, conversation_id=conv, **kwargs)
                metadata[REUSE_KEY] = done.additional_kwargs[REUSE_KEY]
                response = Response(done.text, source_nodes=sources, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            return self._empty(query, streaming_async=True)
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        chunks, skipped = self._chunks(nodes)
        sources = list(nodes) + list(additional_source_nodes or [])
        metadata = self._metadata(sources, skipped)
        kwargs = {**self._sampling, **response_kwargs}
        llm, conv = self._craft_llm, self._conversation_id
        response: RESPONSE_TYPE
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
        ) as event:
            if self._streaming:
                stream = llm.astream_complete_chunks(
                    chunks, bundle.query_str, conversation_id=conv, **kwargs
                )
                response = AsyncStreamingResponse(
                    response_gen=self._astream_text(stream, metadata),
                    source_nodes=sources,
                    metadata=metadata,
                )
            else:
                done = await llm.acomplete_chunks(
                    chunks, bundle.query_str, conversation_id=conv, **kwargs
                )
                metadata[REUSE_KEY] = done.additional_kwargs[REUSE_KEY]
                response = Response(done.text, source_nodes=sources, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    # ---- the text-chunk interface BaseSynthesizer requires ----

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Bare text chunks (no node ids): each is one chunk keyed by its content hash."""
        chunks = [make_chunk(t) for t in text_chunks]
        kwargs = {**self._sampling, **response_kwargs}
        conv = self._conversation_id
        if self._streaming:
            stream = self._craft_llm.stream_complete_chunks(
                chunks, query_str, conversation_id=conv, **kwargs
            )
            return self._stream_text(stream, {})
        return self._craft_llm.complete_chunks(
            chunks, query_str, conversation_id=conv, **kwargs
        ).text

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        chunks = [make_chunk(t) for t in text_chunks]
        kwargs = {**self._sampling, **response_kwargs}
        conv = self._conversation_id
        if self._streaming:
            stream = self._craft_llm.astream_complete_chunks(
                chunks, query_str, conversation_id=conv, **kwargs
            )
            return self._astream_text(stream, {})
        done = await self._craft_llm.acomplete_chunks(
            chunks, query_str, conversation_id=conv, **kwargs
        )
        return done.text


def craft_query_engine(
    retriever: BaseRetriever,
    llm: CraftVLLM,
    *,
    node_postprocessors: Sequence[BaseNodePostprocessor] = (),
    streaming: bool = False,
    key_source: KeySource = "node_id",
    conversation_id: str | None = None,
    **sampling: Any,
) -> RetrieverQueryEngine:
    """A ``RetrieverQueryEngine`` with CRAFT end to end: ``node_postprocessors`` first, then
    ``llm.reorderer()`` (shared planner, plans served by the engine), then
    :class:`CraftSynthesizer` (chunks intact, in CRAFT order)."""
    reorderer = llm.reorderer(key_source=key_source, conversation_id=conversation_id)
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
