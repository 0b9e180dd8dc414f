"""Bad input against every ``craft-rag`` subcommand (issue 11 items 7, 8, 13, 14, 15).

Every case asserts the command-line contract for user errors: exit status 2, ONE line on
stderr naming the thing (and the fix), no traceback, and no output file created or changed.
Cases run in-process through :func:`craft_rag.cli.main` (usage errors raise ``SystemExit(2)``
as argparse does) and stop before any engine, model or embedding work; a few run the real
``craft-rag`` entry point in a subprocess to check the traceback-free stderr end to end.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.cli import main
from craft_rag.trace import MAX_LINE_BYTES, TraceFormatError, iter_trace_file, read_trace

GOOD_LINE = json.dumps(
    {"id": "r1", "query": "q?", "chunks": [{"id": "c1", "text": "alpha", "score": 1.0}]}
)


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its mode and bytes (fifos by name only)."""
    out: dict[str, tuple[int, bytes]] = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out[str(path.relative_to(folder))] = (st.st_mode, data)
    return out


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder with a good trace; the test runs inside it; its files must not change."""
    (tmp_path / "good.jsonl").write_text(GOOD_LINE + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    yield tmp_path
    after = snapshot(tmp_path)
    assert {k: after.get(k) for k in before} == before, "a refused command changed a file"
    created = {k for k in after if k not in before and not k.startswith("input-")}
    assert not created, f"files created by a refused command: {created}"


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code if isinstance(e.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def write_input(folder: Path, name: str, data: bytes) -> Path:
    path = folder / f"input-{name}"
    path.write_bytes(data)
    return path


# ---- replay: the trace file -------------------------------------------------------------------

REPLAY = ["--tokenizer", "fallback", "--prompt", "plain"]


@pytest.mark.parametrize(
    ("name", "data", "needles"),
    [
        ("empty", b"", ("no requests",)),
        ("blank-lines", b"\n\n  \n", ("no requests",)),
        ("binary", b"\x00\x01\x02\xff\xfe\n", ("trace line 1", "UTF-8")),
        ("latin1", (GOOD_LINE + "\n").encode() + "caf\xe9\n".encode("latin-1"), ("line 2",)),
        ("not-json", (GOOD_LINE + "\n{oops\n").encode(), ("trace line 2", "invalid JSON")),
        ("json-array", b"[1, 2]\n", ("trace line 1", "JSON object")),
        ("missing-id", b'{"query": "q", "chunks": []}\n', ("trace line 1", "'id'")),
        ("bad-chunks", b'{"id": "r", "query": "q", "chunks": "abc"}\n', ("'chunks'",)),
        ("bool-turn", b'{"id": "r", "query": "q", "chunks": [], "turn": true}\n', ("'turn'",)),
        ("deep-json", b"[" * 100_000 + b"\n", ("trace line 1",)),
    ],
)
def test_replay_refuses_a_bad_trace_naming_the_line(
    work: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, needles: tuple[str]
) -> None:
    path = write_input(work, name, data)
    code, out, err = run_main(["replay", str(path), *REPLAY], capsys)
    assert_user_error(code, err, *needles)
    assert out == ""


def test_replay_of_a_folder(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["replay", str(work), *REPLAY], capsys)
    assert_user_error(code, err, str(work), "folder")


def test_replay_of_a_missing_file(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["replay", "nope.jsonl", *REPLAY], capsys)
    assert_user_error(code, err, "nope.jsonl", "no such file")


def test_replay_of_a_fifo_does_not_block(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = work / "input-fifo"
    os.mkfifo(fifo)  # no writer: opening it for reading would block forever
    code, _, err = run_main(["replay", str(fifo), *REPLAY], capsys)
    assert_user_error(code, err, "not a regular file")


def test_replay_of_an_unreadable_file(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = write_input(work, "private", (GOOD_LINE + "\n").encode())
    path.chmod(0)
    code, _, err = run_main(["replay", str(path), *REPLAY], capsys)
    assert_user_error(code, err, "not readable")


@pytest.mark.parametrize(
    "option",
    [
        ["--max-tokens", "-1000"],
        ["--max-tokens", "True"],
        ["--max-model-len", "0"],
        ["--window", "0"],
        ["--window", "-5"],
        ["--threshold", "0"],
        ["--threshold", "2.5"],
        ["--block-size", "0"],
        ["--block-size", "99999999999999999999"],
        ["--cache-tokens", "-1"],
        ["--cache-tokens", "1e9"],
        ["--policy", "random"],
    ],
)
def test_replay_refuses_bad_numbers(
    work: Path, capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    code, out, err = run_main(["replay", "good.jsonl", *REPLAY, *option], capsys)
    assert_user_error(code, err, option[0])
    assert out == ""


def test_replay_json_output_is_one_strict_json_object(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(["replay", "good.jsonl", *REPLAY, "--json"], capsys)
    assert code == 0, err
    payload = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert payload["requests"] == 1 and set(payload["policies"]) == {
        "frequency",
        "retriever",
        "tree",
    }


# ---- trace: the output is checked before any data is loaded or embedded -------------------------


def test_trace_out_is_a_folder(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (work / "input-dir").mkdir()
    code, out, err = run_main(["trace", "--dataset", "squad", "--out", "input-dir"], capsys)
    assert_user_error(code, err, "--out", "input-dir")
    assert out == ""


def test_trace_out_in_a_missing_folder(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["trace", "--dataset", "squad", "--out", "no/such/t.jsonl"], capsys)
    assert_user_error(code, err, "--out", "does not exist")


def test_trace_out_not_writable(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # /proc/self refuses new files even for root, which os.access-based checks would miss.
    code, _, err = run_main(["trace", "--dataset", "squad", "--out", "/proc/self/t.jsonl"], capsys)
    assert_user_error(code, err, "--out", "/proc/self")


def test_trace_with_craft_rag_data_missing(
    work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAFT_RAG_DATA", str(work / "no-such-data"))
    code, out, err = run_main(["trace", "--dataset", "mtrag", "--out", "t.jsonl"], capsys)
    assert_user_error(code, err, "CRAFT_RAG_DATA", "does not exist")
    assert out == "" and not (work / "t.jsonl").exists()


def test_trace_with_craft_rag_data_a_file(
    work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAFT_RAG_DATA", str(work / "good.jsonl"))
    code, _, err = run_main(["trace", "--dataset", "mtrag", "--out", "t.jsonl"], capsys)
    assert_user_error(code, err, "CRAFT_RAG_DATA", "not a folder")


def test_trace_with_a_missing_data_dir(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["trace", "--dataset", "mtrag", "--data-dir", "nowhere"], capsys)
    assert_user_error(code, err, "--data-dir", "nowhere")


@pytest.mark.parametrize(
    "option",
    [
        ["--requests", "0"],
        ["--requests", "100000000000"],
        ["--top-k", "-1"],
        ["--top-k", "1000000"],
        ["--zipf", "nan"],
        ["--repeat", "inf"],
        ["--seed", "-1"],
        ["--threads", "0"],
        ["--concurrency", "False"],
    ],
)
def test_trace_refuses_bad_numbers(
    work: Path, capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    code, out, err = run_main(["trace", "--dataset", "squad", "--out", "t.jsonl", *option], capsys)
    assert_user_error(code, err, option[0])
    assert out == ""


# ---- bench: --trace, --requests and the results folder, checked before any suite ----------------


def test_bench_trace_missing(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(
        ["bench", "overlap", "--trace", "nope.jsonl", "--out", "bench-out", "--no-plots"], capsys
    )
    assert_user_error(code, err, "--trace", "nope.jsonl")
    assert not (work / "bench-out").exists()


def test_bench_trace_malformed_names_the_line(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_input(work, "bad", (GOOD_LINE + "\n" + GOOD_LINE + "\nnot json\n").encode())
    code, _, err = run_main(
        ["bench", "overlap", "--trace", str(path), "--out", "bench-out", "--no-plots"], capsys
    )
    assert_user_error(code, err, "trace line 3")
    assert not (work / "bench-out").exists()


def test_bench_out_is_a_file(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(
        ["bench", "overlap", "--trace", "good.jsonl", "--out", "good.jsonl"], capsys
    )
    assert_user_error(code, err, "--out", "not a folder")


def test_bench_requests_without_trace(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["bench", "overlap", "--requests", "5", "--out", "bench-out"], capsys)
    assert_user_error(code, err, "--requests", "--trace")


@pytest.mark.parametrize(
    "option", [["--requests", "0"], ["--distinct", "-3"], ["--block-size", "0"], ["--seed", "x"]]
)
def test_bench_refuses_bad_numbers(
    work: Path, capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    code, _, err = run_main(["bench", "overlap", "--trace", "good.jsonl", *option], capsys)
    assert_user_error(code, err, option[0])


# ---- demo and model: inputs checked before vLLM is imported or a model converted ----------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--trace", "nope.jsonl"], "nope.jsonl"),
        (["demo", "--trace", "."], "folder"),
        (["demo", "--trace", "input-empty"], "no requests"),
        (["demo", "--requests", "0"], "--requests"),
        (["demo", "--max-tokens", "-1"], "--max-tokens"),
        (["demo", "--systems", "craft,nonsense"], "nonsense"),
        (["demo", "--systems", ","], "no system"),
    ],
)
def test_demo_refuses_bad_input(
    work: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    write_input(work, "empty", b"\n")
    code, _, err = run_main(argv, capsys)
    assert_user_error(code, err, needle)


def test_model_prepare_never_replaces_a_folder_of_other_files(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = work / "input-mine"
    folder.mkdir()
    (folder / "thesis.txt").write_text("years of work", encoding="utf-8")
    code, _, err = run_main(["model", "prepare", "--dir", str(folder)], capsys)
    assert_user_error(code, err, "not a prepared model")
    assert (folder / "thesis.txt").read_text(encoding="utf-8") == "years of work"


def test_model_prepare_into_a_file(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["model", "prepare", "--dir", "good.jsonl"], capsys)
    assert_user_error(code, err, "is a file")


def test_unknown_subcommand_is_one_line(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["frobnicate"], capsys)
    assert_user_error(code, err, "frobnicate")


# ---- the real entry point, end to end ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "."],
        ["replay", "input-binary", "--tokenizer", "fallback"],
        ["trace", "--dataset", "squad", "--out", "."],
        ["replay", "good.jsonl", "--max-tokens", "-1000"],
    ],
)
def test_subprocess_user_errors_have_no_traceback(work: Path, argv: list[str]) -> None:
    write_input(work, "binary", b"\x89PNG\r\n\x1a\n\x00\x00")
    proc = subprocess.run(
        [sys.executable, "-m", "craft_rag.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert_user_error(proc.returncode, proc.stderr)
    assert proc.stdout == ""


# ---- the trace reader itself (item 15) -----------------------------------------------------------


def test_read_trace_refuses_an_absurd_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("wb") as handle:
        handle.write(GOOD_LINE.encode() + b"\n")
        handle.write(b'{"id": "' + b"x" * 4096 + b'"}\n')
    with pytest.raises(TraceFormatError, match=r"trace line 2: line longer than 1,024 bytes"):
        read_trace(path, max_line_bytes=1024)
    assert len(read_trace(path, limit=1, max_line_bytes=1024)) == 1  # stops before line 2
    assert MAX_LINE_BYTES == 16 * 1024 * 1024


def test_iter_trace_file_streams(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([GOOD_LINE] * 3 + ["not json"]) + "\n", encoding="utf-8")
    requests = iter_trace_file(path)
    assert [next(requests).id for _ in range(3)] == ["r1"] * 3  # read before the bad line
    with pytest.raises(TraceFormatError, match="trace line 4"):
        next(requests)
