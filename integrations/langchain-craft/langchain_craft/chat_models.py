"""``ChatCraftVLLM``: a LangChain chat model served by craft-rag's in-process vLLM engine.

What reaches the engine:

* a last ``HumanMessage`` carrying a :class:`~langchain_craft.prompt.CraftContext` (from
  :class:`~langchain_craft.CraftRAGPrompt` or :class:`~langchain_craft.CraftConversation`): its
  chunks and question, as separately tokenized segments; the engine plans them (order, dedup
  within the conversation), serves them, and commits the plan with what vLLM reused. With a
  conversation id the engine keeps the conversation's prompt append-only, so earlier messages
  of the list are not re-sent: the engine's history is the conversation;
* any other message list: the question is the last human message when it is the only
  non-system message, else a plain transcript of the messages (stateless; no chunks).

Every request streams from the engine (one path for invoke and stream, sync and async), so
``on_llm_new_token`` fires per token either way. The last chunk carries ``usage_metadata`` (with
``input_token_details.cache_read`` = vLLM's cached tokens) and ``response_metadata["craft"]``:
the engine's reuse report (prompt/cached/predicted tokens, TTFT, chunk order, dedup removals).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from craft_rag import CraftPlanner
from langchain_craft._engine import CraftEngineParams, EngineRequest, final_metadata, usage_metadata
from langchain_craft.prompt import build_context, craft_context
from langchain_craft.reorder import CraftReorder

_ROLES = {"human": "User", "ai": "Assistant", "system": "System", "tool": "Tool"}


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    blocks = message.content
    if any(isinstance(b, dict) and b.get("type") not in (None, "text") for b in blocks):
        msg = (
            f"messages[{index}] holds non-text content; ChatCraftVLLM serves text only "
            "(the embedded model has no image/audio input)"
        )
        raise ValueError(msg)
    return message.text


class ChatCraftVLLM(CraftEngineParams, BaseChatModel):
    """Chat model over a ``CraftEngine`` (in-process vLLM with prefix caching and CRAFT).

    Example::

        engine = CraftEngine()  # or let the model start the embedded default itself
        chain = {"context": retriever, "question": RunnablePassthrough()} | CraftRAGPrompt() \\
            | ChatCraftVLLM(engine=engine, max_tokens=64)
        msg = chain.invoke("Who wrote Hamlet?", {"configurable": {"session_id": "s1"}})
        msg.response_metadata["craft"]["cached_tokens"]

    Per-call ``invoke`` keyword arguments: ``max_tokens``, ``temperature``, ``top_p``,
    ``seed``, ``stop``, ``read_prefix_cache``, ``cache_salt``, ``conversation_id`` and
    ``documents`` (a RAG request without ``CraftRAGPrompt``). Not supported (standard tests
    skip them, see tests): tool calling, structured output, image/audio/PDF input.
    """

    streaming: bool = False
    """Accepted for compatibility; every call streams from the engine anyway."""

    @property
    def _llm_type(self) -> str:
        return "craft-vllm-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.served_model_name(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "craft_vllm"
        params["ls_model_name"] = kwargs.get("model") or self.served_model_name()
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _planner(self) -> object:
        return self.get_engine().planner

    def reorder_step(self, **kwargs: Any) -> CraftReorder:
        """A ``CraftReorder`` previewing this engine's order without committing
        (``commit=False`` on the engine's planner): put it in front of this model to see the
        order before generation; the engine commits its own plan with what vLLM reused."""
        planner = self.get_engine().planner
        if not isinstance(planner, CraftPlanner):
            msg = f"the engine's planner is a {type(planner).__name__}, not a CraftPlanner"
            raise TypeError(msg)
        return CraftReorder(planner=planner, commit=False, **kwargs)

    # ---- messages -> one engine request --------------------------------------------------------

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> EngineRequest:
        if not messages:
            msg = "ChatCraftVLLM needs at least one message"
            raise ValueError(msg)
        texts = [_text(m, i) for i, m in enumerate(messages)]
        conversation_id = kwargs.get("conversation_id")
        context = craft_context(messages[-1])
        documents = kwargs.get("documents")
        if context is None and documents is not None:
            if not isinstance(messages[-1], HumanMessage):
                msg = "documents= needs the last message to be the human question"
                raise ValueError(msg)
            context = build_context(documents, texts[-1], conversation_id=conversation_id)
        if context is not None:
            if context.committed_by is not None and context.committed_by is self._planner():
                msg = (
                    "these documents were already committed to the engine's planner by "
                    "CraftReorder(commit=True); in front of ChatCraftVLLM use "
                    "CraftReorder(planner=engine.planner, commit=False) (see "
                    "ChatCraftVLLM.reorder_step()) or no reorder step: the engine plans and "
                    "commits with what vLLM actually reused"
                )
                raise ValueError(msg)
            return self._engine_request(
                context.chunks,
                context.question,
                conversation_id or context.conversation_id,
                stop,
                kwargs,
            )
        dialogue = [(m, t) for m, t in zip(messages, texts, strict=True)]
        turns = [(m, t) for m, t in dialogue if not isinstance(m, SystemMessage)]
        if len(turns) == 1 and isinstance(turns[0][0], HumanMessage):
            system = [t for m, t in dialogue if isinstance(m, SystemMessage)]
            question = "\n\n".join([*system, turns[0][1]])
        else:
            lines = [f"{_ROLES.get(m.type, m.type.title())}: {t}" for m, t in dialogue]
            question = "\n".join(lines)
        if not question.strip():
            msg = "the messages hold no text to answer"
            raise ValueError(msg)
        return self._engine_request((), question, conversation_id, stop, kwargs)

    # ---- streaming is the one path -------------------------------------------------------------

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        engine = self.get_engine()
        for piece in engine.stream(request.chunks, request.question, **request.kwargs()):
            chunk = self._to_chunk(piece)
            if run_manager is not None and piece.text:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        engine = self.get_engine()
        async for piece in engine.astream(request.chunks, request.question, **request.kwargs()):
            chunk = self._to_chunk(piece)
            if run_manager is not None and piece.text:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    def _to_chunk(self, piece: Any) -> ChatGenerationChunk:
        if piece.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
        metadata = final_metadata(piece.result, self.served_model_name())
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=piece.text,
                usage_metadata=usage_metadata(piece.result),
                response_metadata=metadata,
                chunk_position="last",
            ),
            generation_info=metadata,
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        return _to_result(chunks)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
        return _to_result(chunks)


def _to_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    last = chunks[-1].message if chunks else None
    assert isinstance(last, AIMessageChunk) and last.chunk_position == "last", "stream ended early"
    text = "".join(c.message.text for c in chunks)
    message = AIMessage(
        content=text,
        usage_metadata=last.usage_metadata,
        response_metadata=dict(last.response_metadata),
    )
    return ChatResult(
        generations=[ChatGeneration(message=message, generation_info=chunks[-1].generation_info)]
    )
