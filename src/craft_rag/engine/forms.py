"""The public call forms of :class:`~craft_rag.engine.engine.CraftEngine`, each one statement
over :meth:`submit`.

``generate``/``stream``/``astream`` (a RAG turn), their ``_tokens`` and ``_messages`` forms and
``generate_batch`` build a request (:mod:`craft_rag.engine.results`) and read its
:class:`~craft_rag.engine.requests.RequestHandle` one way: ``result()``, a stream that submits
when first advanced (:func:`~craft_rag.engine.requests.stream_of`), or its async form. They all
take the same keyword arguments, :class:`CallOptions`; ``max_tokens``/``read_prefix_cache``
override ``sampling`` through :meth:`SamplingRequest.with_overrides`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

from craft_rag.engine.requests import RequestHandle, astream_of, stream_of, submit_batch
from craft_rag.engine.results import (
    EngineRequest,
    GenerationResult,
    MessagesRequest,
    RagRequest,
    SamplingRequest,
    StreamChunk,
    TokensRequest,
)

if TYPE_CHECKING:
    from craft_rag.chunk import Chunk
    from craft_rag.engine.messages import ChatTurn
    from craft_rag.planner import Plan

__all__ = ["CallOptions", "RequestForms"]


class CallOptions(TypedDict, total=False):
    """The keyword arguments of every public form (all optional): ``sampling`` (default
    :class:`SamplingRequest`), ``max_tokens``/``read_prefix_cache`` overriding its fields (``None``:
    keep), ``cache_salt`` (the request's prefix-cache namespace; ``None``: shared)."""

    sampling: SamplingRequest | None
    max_tokens: int | None
    read_prefix_cache: bool | None
    cache_salt: str | None


class RequestForms:
    """Mixin: the public call forms over :meth:`submit` (which the engine implements)."""

    def submit(self, request: EngineRequest) -> RequestHandle:
        raise NotImplementedError

    # ---- RAG turns ----------------------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        plan: Plan | str | None = None,
        **options: Unpack[CallOptions],
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (any order; empty is fine). Blocks until done.

        ``max_tokens``/``read_prefix_cache`` override the same fields of ``sampling``.
        ``cache_salt`` puts the request in its own prefix-cache namespace (vLLM reuses KV only
        between requests with the same salt) with its own planner; every turn of a conversation
        must use the salt of its first turn. ``plan`` is a plan made earlier by
        ``planner_for(cache_salt).plan(chunks, conversation_id)``: its order is served and that
        plan is committed (no second planning); pass ``plan.ordered`` as ``chunks``.

        ``ValueError`` for an empty question, a prompt that cannot fit, a bad salt, a salt
        other than the conversation's, or a plan that does not fit the request;
        ``RuntimeError`` for a plan that cannot be committed (already committed, made by
        another planner or salt, stale, or being served); :class:`EngineFailure` if the engine
        fails (nothing is committed; a ``plan`` can be served again). Cost: one prefill of the
        uncached tokens plus ``max_tokens`` decode steps.
        """
        return self.submit(_rag(chunks, question, conversation_id, plan, options)).result()

    def generate_batch(
        self,
        requests: Sequence[RagRequest],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
    ) -> list[GenerationResult]:
        """Serve several requests concurrently (vLLM batches them); results in input order.

        Requests are planned in order before any runs, so one request's commit cannot help a
        later one in the same batch. A conversation may appear at most once per batch
        (``ValueError``). If any request fails, the others still finish and are committed, and
        the first error is raised. Each request may carry its own ``cache_salt``, ``plan`` and
        ``sampling`` (``sampling``/``max_tokens``/``read_prefix_cache`` here replace it).
        """
        return submit_batch(
            self.submit,
            requests,
            sampling,
            max_tokens=max_tokens,
            read_prefix_cache=read_prefix_cache,
        )

    def stream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        plan: Plan | str | None = None,
        **options: Unpack[CallOptions],
    ) -> Iterator[StreamChunk]:
        """Yield the reply as it is generated; the last chunk carries the full result. The
        request starts when the iterator is first advanced; closing it early aborts the
        request (nothing committed). Arguments as for :meth:`generate`."""
        return stream_of(
            lambda: self.submit(_rag(chunks, question, conversation_id, plan, options))
        )

    def astream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        plan: Plan | str | None = None,
        **options: Unpack[CallOptions],
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream` (an async generator): the engine steps on its own thread,
        deltas wake the event loop, so it never blocks on a forward pass. Cancelling or closing
        the consumer aborts the request (nothing committed)."""
        return astream_of(
            lambda: self.submit(_rag(chunks, question, conversation_id, plan, options))
        )

    # ---- prompts without chunks ---------------------------------------------------------------

    def generate_tokens(
        self, token_ids: Sequence[int], **options: Unpack[CallOptions]
    ) -> GenerationResult:
        """Generate from a ready prompt of token ids (no template, no planning, no commit);
        vLLM's prefix cache applies as usual (per ``cache_salt``). The report has no chunks.
        ``ValueError`` for an empty prompt or one that cannot fit; :class:`EngineFailure` if
        the engine fails. Cost: as :meth:`generate`."""
        return self.submit(TokensRequest(token_ids, *_salt_sampling(options))).result()

    def stream_tokens(
        self, token_ids: Sequence[int], **options: Unpack[CallOptions]
    ) -> Iterator[StreamChunk]:
        """Streaming :meth:`generate_tokens` (closing early aborts the request)."""
        return stream_of(lambda: self.submit(TokensRequest(token_ids, *_salt_sampling(options))))

    def astream_tokens(
        self, token_ids: Sequence[int], **options: Unpack[CallOptions]
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream_tokens`."""
        return astream_of(lambda: self.submit(TokensRequest(token_ids, *_salt_sampling(options))))

    def generate_messages(
        self, messages: Sequence[ChatTurn], **options: Unpack[CallOptions]
    ) -> GenerationResult:
        """Answer a plain chat: ``messages`` are ``(role, text)`` pairs rendered with the
        model's chat template and the generation prompt, one tokenized segment per message
        (:meth:`message_token_ids`), so a chat re-sent with more messages reuses the earlier
        messages' KV. Stateless (no conversation, no planning, no commit). Errors as for
        :meth:`generate_tokens`, plus ``ValueError`` for malformed messages."""
        return self.submit(MessagesRequest(messages, *_salt_sampling(options))).result()

    def stream_messages(
        self, messages: Sequence[ChatTurn], **options: Unpack[CallOptions]
    ) -> Iterator[StreamChunk]:
        """Streaming :meth:`generate_messages`."""
        return stream_of(lambda: self.submit(MessagesRequest(messages, *_salt_sampling(options))))

    def astream_messages(
        self, messages: Sequence[ChatTurn], **options: Unpack[CallOptions]
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream_messages`."""
        return astream_of(lambda: self.submit(MessagesRequest(messages, *_salt_sampling(options))))


_OPTIONS = frozenset(CallOptions.__annotations__)


def _salt_sampling(options: CallOptions) -> tuple[str | None, SamplingRequest]:
    """``(cache_salt, sampling)`` of a call's options. ``TypeError`` for an unknown keyword
    (as Python's own for a named parameter)."""
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        msg = f"unexpected keyword arguments {unknown}; the engine's calls take {sorted(_OPTIONS)}"
        raise TypeError(msg)
    base = options.get("sampling") or SamplingRequest()
    sampling = base.with_overrides(
        max_tokens=options.get("max_tokens"), read_prefix_cache=options.get("read_prefix_cache")
    )
    return options.get("cache_salt"), sampling


def _rag(
    chunks: Sequence[Chunk],
    question: str,
    conversation_id: str | None,
    plan: Plan | str | None,
    options: CallOptions,
) -> RagRequest:
    salt, sampling = _salt_sampling(options)
    return RagRequest(chunks, question, conversation_id, salt, plan, sampling)
