"""The replay trace format: one request per JSON line; errors name the line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from craft_rag.chunk import content_key, make_chunk
from craft_rag.trace import (
    TraceFormatError,
    TraceRequest,
    iter_trace,
    parse_request,
    read_trace,
    write_trace,
)
from craft_rag.types import ConversationId


def line(**fields: object) -> str:
    base: dict[str, object] = {"id": "r", "query": "q", "chunks": []}
    base.update(fields)
    return json.dumps(base)


GOOD = line(id="r1", query="What?", chunks=[{"id": "d1:0", "text": "alpha", "score": 0.9}])


def test_parse_a_request_keeps_retriever_order() -> None:
    obj = {
        "id": "r1",
        "query": "Where?",
        "chunks": [
            {"id": "d2:0", "text": "beta", "score": 0.5},
            {"id": "d1:0", "text": "alpha", "score": 0.9, "num_tokens": 4},
            {"text": "no id"},
        ],
        "conversation_id": "c1",
        "turn": 2,
        "answer": "There.",
    }
    request = parse_request(obj, 1)
    assert [c.key for c in request.chunks] == ["d2:0", "d1:0", content_key("no id")]
    assert request.chunks[1].num_tokens == 4 and request.chunks[0].score == 0.5
    assert (request.conversation_id, request.turn, request.answer) == ("c1", 2, "There.")


def test_optional_fields_default_to_none() -> None:
    request = parse_request(json.loads(GOOD), 1)
    assert request.conversation_id is None and request.turn is None and request.answer is None


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    requests = [
        TraceRequest("r1", "Qué pasó?", (make_chunk("東京 🗼", id="文書:0", score=1.0),)),
        TraceRequest(
            "r2",
            "q2",
            (make_chunk("t", id="a", num_tokens=3), make_chunk("u")),
            conversation_id=ConversationId("c"), turn=1, answer="ans",
        ),
        TraceRequest("r3", "empty", ()),
    ]
    path = tmp_path / "trace.jsonl"
    write_trace(requests, path)
    text = path.read_text(encoding="utf-8")
    assert "東京" in text  # UTF-8, not \u escapes
    assert len(text.splitlines()) == 3
    assert read_trace(path) == requests


def test_write_to_a_stream() -> None:
    out = io.StringIO()
    write_trace([TraceRequest("r", "q", ())], out)
    assert json.loads(out.getvalue()) == {"id": "r", "query": "q", "chunks": []}


def test_to_json_writes_set_optional_fields_only_in_order() -> None:
    full = TraceRequest("r", "q", (), conversation_id=ConversationId("c"), turn=2, answer="")
    assert list(full.to_json().items()) == [
        ("id", "r"), ("query", "q"), ("chunks", []), ("conversation_id", "c"), ("turn", 2),
        ("answer", ""),
    ]
    assert list(TraceRequest("r", "q", (), turn=1).to_json()) == ["id", "query", "chunks", "turn"]


def test_blank_lines_are_allowed_and_counted() -> None:
    requests = list(iter_trace(["", GOOD, "   ", GOOD + "\n"]))
    assert len(requests) == 2


def test_read_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        read_trace("/nonexistent/trace.jsonl")


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got str"),
        (json.dumps({"query": "q", "chunks": []}), "'id' must be a string"),
        (line(id=7), "'id' must be a string"),
        (line(query=None), "'query' must be a string"),
        (json.dumps({"id": "r", "query": "q"}), "'chunks' must be a list"),
        (line(chunks={"id": "x"}), "'chunks' must be a list"),
        (line(chunks=["x"]), "chunks[0] must be an object"),
        (line(chunks=[{"id": "a", "text": "t"}, {"score": 1.0}]), "chunks[1]: chunk needs an 'id'"),
        (line(chunks=[{"id": 5, "text": "t"}]), "chunks[0]: chunk 'id': must be a string"),
        (line(chunks=[{"id": "a", "text": 5}]), "chunks[0]: chunk 'text': must be a string"),
        (line(chunks=[{"id": "a", "num_tokens": -2}]), "'num_tokens'"),
        (line(chunks=[{"id": "a", "score": "high"}]), "'score'"),
        (line(conversation_id=3), "'conversation_id' must be a string"),
        (line(turn=0), "'turn' must be an int >= 1"),
        (line(turn=True), "'turn' must be an int >= 1"),
        (line(turn="2"), "'turn' must be an int >= 1"),
        (line(answer=["a"]), "'answer' must be a string"),
    ],
)
def test_malformed_lines_name_the_line_and_reason(bad: str, reason: str) -> None:
    lines = [GOOD, "", GOOD, bad, GOOD]
    with pytest.raises(TraceFormatError) as info:
        list(iter_trace(lines))
    assert info.value.line == 4
    assert reason in info.value.reason
    assert str(info.value).startswith("trace line 4: ")
    assert isinstance(info.value, ValueError)


def test_read_trace_reports_the_file_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([GOOD, GOOD, "", '{"id": "r", "query": "q", "chunks": 1}']) + "\n")
    with pytest.raises(TraceFormatError, match="trace line 4: field 'chunks'"):
        read_trace(path)


def test_errors_are_raised_lazily_after_good_lines() -> None:
    it = iter_trace([GOOD, "nope"])
    assert next(it).id == "r1"
    with pytest.raises(TraceFormatError, match="line 2"):
        next(it)


# ---- streaming, caps and atomic writes (issue 11 items 4 and 15) ---------------------------------


def test_write_trace_is_atomic_and_private(tmp_path: Path) -> None:
    import os
    import stat

    path = tmp_path / "t.jsonl"
    path.write_text("old\n", encoding="utf-8")

    def failing() -> object:
        yield parse_request(json.loads(GOOD), 1)
        raise RuntimeError("retriever died")

    with pytest.raises(RuntimeError, match="retriever died"):
        write_trace(failing(), path)  # type: ignore[arg-type]
    assert path.read_text(encoding="utf-8") == "old\n"  # untouched, no temp file left
    assert os.listdir(tmp_path) == ["t.jsonl"]
    write_trace([parse_request(json.loads(GOOD), 1)], path)
    assert [r.id for r in read_trace(path)] == ["r1"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_read_trace_accepts_a_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.encode() + b"\r\n")
    assert [r.id for r in read_trace(path)] == ["r1", "r1"]


def test_read_trace_limit_stops_reading(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\nnot json\n", encoding="utf-8")
    assert len(read_trace(path, limit=2)) == 2  # line 3 is never parsed
    with pytest.raises(TraceFormatError, match="trace line 3"):
        read_trace(path)
    with pytest.raises(ValueError, match="limit"):
        read_trace(path, limit=True)


def test_line_caps_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="trace line 2: line longer than 10 characters"):
        list(iter_trace([GOOD[:0] + "\n", "x" * 11 + "\n"], max_line_chars=10))
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n" + b"y" * 11)  # no newline at the end
    with pytest.raises(TraceFormatError, match="trace line 2: line longer than 10 bytes"):
        read_trace(path, max_line_bytes=10)
    path.write_bytes(b"\n" + b" " * 10 + b"\n")  # exactly at the cap: accepted (blank)
    assert read_trace(path, max_line_bytes=10) == []


def test_read_trace_refuses_folders_and_fifos(tmp_path: Path) -> None:
    import os

    with pytest.raises(IsADirectoryError, match="folder"):
        read_trace(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_trace(fifo)  # returns at once: never waits for a writer
