"""Test helpers for llama-index-postprocessor-craft: node factories and an event recorder
(uniquely named, not ``conftest``, so a root run imports the right one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index_instrumentation.base import BaseEvent


def make_node(i: int | str, text: str | None = None, score: float = 1.0) -> NodeWithScore:
    name = str(i)
    return NodeWithScore(node=TextNode(id_=f"n{name}", text=text or f"text {name}"), score=score)


def make_nodes(ids: Sequence[int | str]) -> list[NodeWithScore]:
    return [make_node(i) for i in ids]


def node_ids(nodes: Sequence[NodeWithScore]) -> list[str]:
    return [n.node.node_id for n in nodes]


class EventRecorder(BaseEventHandler):
    """Collects every instrumentation event while installed on the root dispatcher."""

    events: list[BaseEvent]

    @classmethod
    def class_name(cls) -> str:
        return "EventRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)

    def of(self, cls: type[BaseEvent]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]
