"""The replay trace format: one RAG request per JSON line.

``{"id": str, "query": str, "chunks": [{"id": str, "text": str, "score": float}, ...]}`` with the
chunks in retriever order, and optional ``"conversation_id"`` (str), ``"turn"`` (int >= 1) and
``"answer"`` (str: the reference reply of that turn, used to render multi-turn history).
Readers raise :class:`TraceFormatError` naming the line; nothing is skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.types import ConversationId


class TraceFormatError(ValueError):
    """A trace line that does not follow the format; ``line`` is 1-based."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"trace line {line}: {reason}")
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``chunks`` keep the retriever's order."""

    id: str
    query: str
    chunks: tuple[Chunk, ...]
    conversation_id: ConversationId | None = None
    turn: int | None = None
    answer: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "query": self.query,
            "chunks": [
                {"id": c.key, "text": c.text, "score": c.score}
                | ({"num_tokens": c.num_tokens} if c.num_tokens is not None else {})
                for c in self.chunks
            ],
        }
        if self.conversation_id is not None:
            out["conversation_id"] = self.conversation_id
        if self.turn is not None:
            out["turn"] = self.turn
        if self.answer is not None:
            out["answer"] = self.answer
        return out


def parse_request(obj: Any, line: int) -> TraceRequest:
    """Validate one decoded JSON object; raise :class:`TraceFormatError` naming the problem."""
    if not isinstance(obj, dict):
        raise TraceFormatError(line, f"expected a JSON object, got {type(obj).__name__}")
    for field in ("id", "query"):
        if not isinstance(obj.get(field), str):
            raise TraceFormatError(line, f"field {field!r} must be a string")
    raw_chunks = obj.get("chunks")
    if not isinstance(raw_chunks, list):
        raise TraceFormatError(line, "field 'chunks' must be a list")
    chunks: list[Chunk] = []
    for i, raw in enumerate(raw_chunks):
        if not isinstance(raw, dict):
            raise TraceFormatError(line, f"chunks[{i}] must be an object")
        try:
            chunks.append(
                make_chunk(
                    raw.get("text"),
                    id=raw.get("id"),
                    score=raw.get("score"),
                    num_tokens=raw.get("num_tokens"),
                )
            )
        except ValueError as e:
            raise TraceFormatError(line, f"chunks[{i}]: {e}") from e
    conversation_id = obj.get("conversation_id")
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise TraceFormatError(line, "field 'conversation_id' must be a string")
    turn = obj.get("turn")
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 1):
        raise TraceFormatError(line, "field 'turn' must be an int >= 1")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise TraceFormatError(line, "field 'answer' must be a string")
    return TraceRequest(
        id=obj["id"],
        query=obj["query"],
        chunks=tuple(chunks),
        conversation_id=ConversationId(conversation_id) if conversation_id is not None else None,
        turn=turn,
        answer=answer,
    )


def iter_trace(lines: Iterable[str]) -> Iterator[TraceRequest]:
    """Parse trace lines lazily; blank lines are allowed, anything else must be a request."""
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(number, f"invalid JSON ({e.msg})") from e
        yield parse_request(obj, number)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a whole trace file. Raises ``FileNotFoundError`` or :class:`TraceFormatError`."""
    with open(path, encoding="utf-8") as handle:
        return list(iter_trace(handle))


def write_trace(requests: Sequence[TraceRequest], out: str | Path | IO[str]) -> None:
    """Write requests as JSON lines (UTF-8, one object a line)."""
    if isinstance(out, (str, Path)):
        with open(out, "w", encoding="utf-8") as handle:
            write_trace(requests, handle)
        return
    for request in requests:
        out.write(json.dumps(request.to_json(), ensure_ascii=False) + "\n")
