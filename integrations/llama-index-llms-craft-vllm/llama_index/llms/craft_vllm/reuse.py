"""The engine's reuse reports on the ``Response`` of any synthesizer, not only instrumentation.

On the README's one-line path (``index.as_query_engine(node_postprocessors=[...],
llm=CraftVLLM())``) LlamaIndex's own synthesizer calls ``llm.chat``/``llm.complete`` and keeps
only the text. To make the reports visible there, a :class:`ReuseMetadataHandler` on the root
instrumentation dispatcher opens a :class:`ReuseCollector` when a synthesis starts
(``SynthesizeStartEvent``); every ``CraftVLLM`` request made while it is open adds its
:class:`~craft_rag.engine.results.ReuseReport` to it (the request captures the open collectors
when it is made, so a stream consumed after the synthesis returned still reports); at
``SynthesizeEndEvent`` the collector is attached to ``response.metadata``:

* ``metadata["craft_reuse"]``: the report of the last engine request (the only one for the
  default compact mode when everything fits one prompt);
* ``metadata["craft_reuse_reports"]``: every engine request's report, in order (refine and
  tree modes make several).

For a streaming response both keys appear once the stream is consumed: LlamaIndex's streaming
synthesizers call the LLM lazily, when the stream is first read, so the handler wraps the
response's generator to reopen the collector around each step. :func:`collect_reuse`
opens a collector by hand around any code (chat engines, agents).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Generator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index_instrumentation import get_dispatcher
from llama_index_instrumentation.event_handlers import BaseEventHandler
from pydantic import PrivateAttr

from craft_rag.engine import ReuseReport

REUSE_METADATA_KEY = "craft_reuse"
"""Response metadata key of a turn's :class:`ReuseReport` (the chat engine's responses also
carry it under ``reuse_report``)."""
REUSE_REPORTS_KEY = "craft_reuse_reports"

_OPEN: ContextVar[tuple[ReuseCollector, ...]] = ContextVar("craft_reuse_collectors", default=())


@dataclass(slots=True)
class ReuseCollector:
    """Reports of the engine requests made while it was open. Once attached to a metadata
    dict, each later report updates the dict too (a stream finishing after the response was
    returned). Owner: the handler or :func:`collect_reuse` that opened it."""

    reports: list[ReuseReport] = field(default_factory=list)
    metadata: dict[str, Any] | None = None

    @property
    def last(self) -> ReuseReport | None:
        return self.reports[-1] if self.reports else None

    def add(self, report: ReuseReport) -> None:
        self.reports.append(report)
        if self.metadata is not None:
            self._publish(self.metadata)

    def attach(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata
        if self.reports:
            self._publish(metadata)

    def _publish(self, metadata: dict[str, Any]) -> None:
        metadata[REUSE_REPORTS_KEY] = list(self.reports)
        metadata[REUSE_METADATA_KEY] = self.reports[-1]


def open_collectors() -> tuple[ReuseCollector, ...]:
    """The collectors open in the current context (captured by each engine request)."""
    return _OPEN.get()


@contextmanager
def collect_reuse() -> Iterator[ReuseCollector]:
    """Collect the reports of every ``CraftVLLM`` request made inside the block."""
    collector = ReuseCollector()
    token = _OPEN.set((*_OPEN.get(), collector))
    try:
        yield collector
    finally:
        _OPEN.reset(token)


class ReuseMetadataHandler(BaseEventHandler):
    """Opens a collector per synthesis and attaches it to the response's metadata."""

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _by_span: dict[str, ReuseCollector] = PrivateAttr(default_factory=dict)

    @classmethod
    def class_name(cls) -> str:
        return "CraftReuseMetadataHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        key = str(event.span_id)
        if isinstance(event, SynthesizeStartEvent):
            collector = ReuseCollector()
            with self._lock:
                self._by_span[key] = collector
            _OPEN.set((*_OPEN.get(), collector))
        elif isinstance(event, SynthesizeEndEvent):
            with self._lock:
                found = self._by_span.pop(key, None)
            if found is None:
                return
            _OPEN.set(tuple(c for c in _OPEN.get() if c is not found))
            response: Any = event.response
            if getattr(response, "metadata", None) is None:
                try:
                    response.metadata = {}
                except (AttributeError, TypeError, ValueError):
                    return
            if isinstance(response.metadata, dict):
                found.attach(response.metadata)
            gen = getattr(response, "response_gen", None)
            if isinstance(gen, Generator):
                response.response_gen = _reopened(gen, found)
            elif isinstance(gen, AsyncGenerator):
                response.response_gen = _areopened(gen, found)


def _reopened(gen: Generator[Any, None, None], collector: ReuseCollector) -> Iterator[Any]:
    """``gen``'s items, with ``collector`` open while each is produced (a lazily made engine
    request captures it)."""
    while True:
        token = _OPEN.set((*_OPEN.get(), collector))
        try:
            item = next(gen)
        except StopIteration:
            return
        finally:
            _OPEN.reset(token)
        yield item


async def _areopened(
    gen: AsyncGenerator[Any, None], collector: ReuseCollector
) -> AsyncGenerator[Any, None]:
    """Async :func:`_reopened`."""
    while True:
        token = _OPEN.set((*_OPEN.get(), collector))
        try:
            item = await gen.__anext__()
        except StopAsyncIteration:
            return
        finally:
            _OPEN.reset(token)
        yield item


def install_reuse_metadata() -> ReuseMetadataHandler:
    """Add the handler to LlamaIndex's root dispatcher once (idempotent); returns it."""
    root = get_dispatcher()
    for handler in root.event_handlers:
        if isinstance(handler, ReuseMetadataHandler):
            return handler
    handler = ReuseMetadataHandler()
    root.add_event_handler(handler)
    return handler
