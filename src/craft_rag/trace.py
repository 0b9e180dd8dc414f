"""The replay trace format: one RAG request per JSON line.

``{"id": str, "query": str, "chunks": [{"id": str, "text": str, "score": float}, ...]}`` with the
chunks in retriever order, and optional ``"conversation_id"`` (str), ``"turn"`` (int >= 1) and
``"answer"`` (str: the reference reply of that turn, used to render multi-turn history).
Readers raise :class:`TraceFormatError` naming the line; nothing is skipped silently.

Files are read as a stream (:func:`iter_trace_file`): one line in memory at a time, each at most
:data:`MAX_LINE_BYTES` (16 MiB) of UTF-8; a longer line, bytes that are not UTF-8 (a binary
file) or a path that is not a regular file is refused with an error naming it. Writers go
through :func:`craft_rag.files.atomic_writer` (a private temp file renamed into place).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.files import atomic_writer
from craft_rag.types import ConversationId

MAX_LINE_BYTES = 16 * 1024 * 1024
"""Longest trace line accepted (bytes, newline excluded): far above any real request (a
top-20 request of 1,000-token chunks is ~100 KB), small enough that a corrupt or hostile file
cannot make a reader hold gigabytes for one line."""


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
        optional = (("conversation_id", self.conversation_id), ("turn", self.turn),
                    ("answer", self.answer))
        return out | {k: v for k, v in optional if v is not None}  # unset: left out of the line


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


def iter_trace(
    lines: Iterable[str], *, max_line_chars: int = MAX_LINE_BYTES
) -> Iterator[TraceRequest]:
    """Parse trace lines lazily; blank lines are allowed, anything else must be a request.
    A line longer than ``max_line_chars`` characters is refused (:class:`TraceFormatError`)."""
    for number, text in enumerate(lines, start=1):
        if len(text[:-1] if text.endswith("\n") else text) > max_line_chars:
            raise TraceFormatError(number, _too_long(max_line_chars, "characters"))
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(number, f"invalid JSON ({e.msg})") from e
        except RecursionError as e:
            raise TraceFormatError(number, "JSON nested too deeply") from e
        yield parse_request(obj, number)


def _too_long(limit: int, unit: str) -> str:
    return (
        f"line longer than {limit:,} {unit} (craft_rag.trace.MAX_LINE_BYTES); is this a trace "
        "file? one request per line"
    )


def _open_regular(path: str | Path) -> IO[bytes]:
    """Open ``path`` for reading, refusing anything but a regular file before any read (a
    folder, a fifo with no writer or a device would fail late, block or never end)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            msg = f"trace {path} is {kind}; pass a trace file (JSON lines)"
            raise IsADirectoryError(msg) if stat.S_ISDIR(mode) else ValueError(msg)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_lines(handle: IO[bytes], max_line_bytes: int) -> Iterator[str]:
    """Decoded lines of a binary handle, one at a time; raises :class:`TraceFormatError` on a
    line over ``max_line_bytes`` (read no further than the cap) or one that is not UTF-8."""
    number = 0
    while True:
        raw = handle.readline(max_line_bytes + 2)
        if not raw:
            return
        number += 1
        body = raw[:-1] if raw.endswith(b"\n") else raw
        if len(body) > max_line_bytes:
            raise TraceFormatError(number, _too_long(max_line_bytes, "bytes"))
        if number == 1 and body.startswith(b"\xef\xbb\xbf"):
            body = body[3:]  # a UTF-8 byte order mark some editors write
        try:
            yield body.decode("utf-8")
        except UnicodeDecodeError as e:
            msg = f"not UTF-8 text (byte {e.start} of the line); a trace is UTF-8 JSON lines"
            raise TraceFormatError(number, msg) from e


def iter_trace_file(
    path: str | Path, *, max_line_bytes: int = MAX_LINE_BYTES
) -> Generator[TraceRequest, None, None]:
    """Stream the requests of a trace file: one line in memory at a time. Raises
    ``FileNotFoundError`` / ``PermissionError`` / ``IsADirectoryError`` (at the first ``next``),
    ``ValueError`` for a path that is not a regular file, and :class:`TraceFormatError` naming
    the line. The file stays open until the iterator is exhausted or closed."""
    with _open_regular(path) as handle:
        yield from iter_trace(_file_lines(handle, max_line_bytes), max_line_chars=max_line_bytes)


def read_trace(
    path: str | Path, *, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES
) -> list[TraceRequest]:
    """Read a trace file into a list, streaming it (no copy of the file's text is held); with
    ``limit``, only the first ``limit`` requests (the rest is not read). Raises as
    :func:`iter_trace_file`. Memory: the parsed requests only."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        msg = f"limit must be an int >= 0 or None, got {limit!r}"
        raise ValueError(msg)
    out: list[TraceRequest] = []
    if limit == 0:
        return out
    requests = iter_trace_file(path, max_line_bytes=max_line_bytes)
    try:
        for request in requests:
            out.append(request)
            if limit is not None and len(out) >= limit:
                break
    finally:
        requests.close()
    return out


def count_trace(path: str | Path, *, max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """How many requests a trace file holds, validating every line on the way (streamed: O(1)
    memory beyond one line). Raises as :func:`iter_trace_file`."""
    return sum(1 for _ in iter_trace_file(path, max_line_bytes=max_line_bytes))


def write_trace(requests: Iterable[TraceRequest], out: str | Path | IO[str]) -> None:
    """Write requests as JSON lines (UTF-8, one object a line), streaming them. A path is
    written through :func:`craft_rag.files.atomic_writer`: a private (0600) temp file renamed
    into place when every line is written, so a failure leaves the old file untouched."""
    if isinstance(out, (str, Path)):
        with atomic_writer(out) as handle:
            write_trace(requests, cast("IO[str]", handle))
        return
    for request in requests:
        out.write(json.dumps(request.to_json(), ensure_ascii=False) + "\n")
