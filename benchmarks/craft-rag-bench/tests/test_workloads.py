"""Trace builders: request schedules, rewording, interleaving, MTRAG/ShareGPT traces, the CLI.

Tests marked ``retrieval`` use the real MiniLM + faiss over the small corpus of
test_retrieval.py (its embeddings are cached on disk, content-keyed).
"""

from __future__ import annotations

import argparse
import io
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.chunk import make_chunk
from craft_rag.trace import TraceRequest, read_trace, write_trace
from craft_rag_bench.datasets import LOADERS, Dataset, Passage, Question, load_mtrag, load_sharegpt
from craft_rag_bench.queries import plan_queries, reword, zipf_weights
from craft_rag_bench.retrieval import Embedder, Retriever
from craft_rag_bench.workloads import (
    TraceConfig,
    build_trace,
    interleave,
    mtrag_trace,
    retrieved_conversation_trace,
    sharing_report,
    single_turn_trace,
)
from craft_rag_bench.workloads_cli import add_trace_parser

QUESTIONS = (
    "Which NFL team represented the AFC at Super Bowl 50?",
    "Who is older, Annie Morton or Terry Richardson?",
    "What is the name of the fight song of the university in Lawrence, Kansas?",
    "2014 S/S is the debut album of a South Korean boy group that was formed by who?",
    "What day was the game played on?",
    "Where did Super Bowl 50 take place?",
    "Who won?",
)


def make_questions(n: int) -> list[Question]:
    return [
        Question(id=str(i), question=f"Question number {i} about topic {i}?", answers=(f"a{i}",),
                 dataset="toy")
        for i in range(n)
    ]  # fmt: skip


def parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="craft-rag")
    add_trace_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def mtrag() -> Dataset:
    return load_mtrag()


# ----------------------------------------------------------------------------- schedules


def test_no_repeats_is_dataset_order() -> None:
    questions = make_questions(50)
    plan = plan_queries(questions, repeat=0.0, seed=3)
    assert [p.question.id for p in plan] == [q.id for q in questions]
    assert {p.kind for p in plan} == {"first"}
    assert [p.request_id for p in plan] == [f"toy:{i}" for i in range(50)]


def test_repeats_are_earlier_questions_and_fresh_ones_stay_in_order() -> None:
    questions = make_questions(400)
    plan = plan_queries(questions, requests=300, repeat=0.3, seed=1)
    assert len(plan) == 300
    firsts = [p.question.id for p in plan if p.kind == "first"]
    assert firsts == [q.id for q in questions[: len(firsts)]]
    asked: set[str] = set()
    for p in plan:
        if p.kind != "first":
            assert p.question.id in asked
        asked.add(p.question.id)
    re_asks = sum(p.kind != "first" for p in plan)
    assert 60 <= re_asks <= 120  # ~0.3 x 300, seeded
    assert len({p.request_id for p in plan}) == 300


def test_zipf_skew_concentrates_re_asks_on_few_questions() -> None:
    questions = make_questions(2000)

    def top_share(s: float) -> float:
        plan = plan_queries(questions, requests=1000, repeat=0.5, zipf=s, seed=7)
        counts = Counter(p.question.id for p in plan if p.kind != "first")
        return counts.most_common(1)[0][1] / sum(counts.values())

    assert top_share(2.0) > 3 * top_share(0.0)
    assert top_share(0.0) < 0.05


def test_zipf_weights() -> None:
    assert zipf_weights(3, 0.0) == [1.0, 1.0, 1.0]
    assert zipf_weights(3, 1.0) == [1.0, 0.5, 1 / 3]


def test_seed_reproduces_and_changes_the_schedule() -> None:
    questions = make_questions(200)
    a = plan_queries(questions, requests=150, seed=11)
    b = plan_queries(questions, requests=150, seed=11)
    c = plan_queries(questions, requests=150, seed=12)
    assert a == b
    assert [(p.request_id, p.text) for p in a] != [(p.request_id, p.text) for p in c]


def test_near_duplicate_knob() -> None:
    questions = make_questions(100)
    none = plan_queries(questions, requests=100, repeat=0.5, near_duplicates=0.0, seed=2)
    assert all(p.text == p.question.question for p in none)
    assert any(p.kind == "repeat" for p in none)
    every = plan_queries(questions, requests=100, repeat=0.5, near_duplicates=1.0, seed=2)
    re_asks = [p for p in every if p.kind != "first"]
    assert re_asks and all(p.kind == "near_duplicate" for p in re_asks)
    assert all(p.text != p.question.question for p in re_asks)


def test_requests_beyond_the_dataset_are_re_asks_and_none_means_every_question_once() -> None:
    questions = make_questions(10)
    plan = plan_queries(questions, requests=40, repeat=0.1, seed=0)
    assert len(plan) == 40
    assert sum(p.kind == "first" for p in plan) == 10
    whole = plan_queries(questions, repeat=0.3, seed=0)
    assert sum(p.kind == "first" for p in whole) == 10
    assert whole[-1].kind == "first"


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no questions"):
        plan_queries([])
    with pytest.raises(ValueError, match="requests"):
        plan_queries(make_questions(3), requests=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("requests", 0),
        ("top_k", 0),
        ("repeat", 1.0),
        ("repeat", -0.1),
        ("zipf", -1.0),
        ("near_duplicates", 1.5),
        ("corpus", "web"),
        ("index", "hnsw"),
        ("concurrency", 0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TraceConfig(dataset="squad", **{field: value})  # type: ignore[arg-type]


def test_unknown_dataset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: " + ", ".join(LOADERS)):
        TraceConfig(dataset="msmarco")


# ----------------------------------------------------------------------------- rewording


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(QUESTIONS), st.integers(0, 2**32))
def test_reword_differs_is_deterministic_and_keeps_content_words(text: str, seed: int) -> None:
    out = reword(text, random.Random(seed))
    assert out and out != text
    assert out == reword(text, random.Random(seed))

    def words(s: str) -> set[str]:
        return {w.strip("?,.:\"'").lower() for w in s.split()} - {"the", "a", "is", "was", "of"}

    content = words(text)
    assert len(content & words(out)) >= 0.6 * len(content)


# ----------------------------------------------------------------------------- interleave


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=12),
    st.integers(0, 1000),
    st.integers(1, 5),
)
def test_interleave_keeps_stream_order_and_bounds_open_streams(
    lengths: list[int], seed: int, concurrency: int
) -> None:
    streams = [[(s, i) for i in range(n)] for s, n in enumerate(lengths)]
    merged = interleave(streams, seed=seed, concurrency=concurrency)
    assert sorted(merged) == sorted(item for stream in streams for item in stream)
    for s, stream in enumerate(streams):
        assert [item for item in merged if item[0] == s] == stream
    open_now: set[int] = set()
    remaining = {s: n for s, n in enumerate(lengths)}
    for s, _ in merged:
        open_now.add(s)
        assert len(open_now) <= concurrency
        remaining[s] -= 1
        if remaining[s] == 0:
            open_now.discard(s)
    assert merged == interleave(streams, seed=seed, concurrency=concurrency)
    assert interleave(streams) == [item for stream in streams for item in stream]


# ----------------------------------------------------------------------------- multi-turn


def test_mtrag_trace_replays_the_shown_passages(mtrag: Dataset) -> None:
    trace = mtrag_trace(mtrag.conversations)
    assert len(trace) == 842
    by_id = {c.id: c for c in mtrag.conversations}
    for request in trace:
        assert request.conversation_id is not None and request.turn is not None
        turn = by_id[request.conversation_id].turns[request.turn - 1]
        assert [str(c.key) for c in request.chunks] == [str(s.passage.id) for s in turn.contexts]
        assert [c.score for c in request.chunks] == [s.score for s in turn.contexts]
        assert request.query == turn.question and request.answer == turn.answer
    first = trace[0]
    assert first.conversation_id == mtrag.conversations[0].id and first.turn == 1


def test_mtrag_interleaving_and_request_cap(mtrag: Dataset) -> None:
    sequential = mtrag_trace(mtrag.conversations)
    mixed = mtrag_trace(mtrag.conversations, interleave_seed=5, concurrency=4)
    assert mixed != sequential
    assert sorted(r.id for r in mixed) == sorted(r.id for r in sequential)
    turns: dict[str, int] = {}
    for r in mixed:
        assert r.conversation_id is not None and r.turn is not None
        assert r.turn == turns.get(r.conversation_id, 0) + 1
        turns[r.conversation_id] = r.turn
    assert mtrag_trace(mtrag.conversations, requests=10) == sequential[:10]


def test_mtrag_trace_round_trips_through_the_trace_format(mtrag: Dataset, tmp_path: Path) -> None:
    trace = mtrag_trace(mtrag.conversations, requests=50)
    write_trace(trace, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == trace


def test_sharing_report_counts_exactly() -> None:
    def req(i: int, *keys: str) -> TraceRequest:
        return TraceRequest(str(i), "q", tuple(make_chunk(k, id=k) for k in keys))

    trace = [req(0, "a", "b"), req(1, "b", "a"), req(2, "c"), req(3, "a", "b"), req(4, "c", "d")]
    report = sharing_report(trace)
    assert report.requests == 5
    assert report.sharing_requests == 3  # requests 1, 3, 4
    assert report.reordered_sets == 1  # request 1
    assert report.identical_sets == 1  # request 3
    assert report.shared_chunk_fraction == pytest.approx(5 / 9)


def test_build_trace_for_a_dataset_without_passages_needs_the_union() -> None:
    with pytest.raises(ValueError, match="corpus 'union'"):
        build_trace(TraceConfig(dataset="triviaqa", corpus="dataset"), show_progress=False)


# ----------------------------------------------------------------------------- CLI


def test_cli_writes_a_readable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mtrag.jsonl"
    args = parse_cli(["trace", "--dataset", "mtrag", "--requests", "20", "--out", str(out)])
    assert args.func(args) == 0
    trace = read_trace(out)
    assert len(trace) == 20 and trace[0].turn == 1
    assert "20 requests from mtrag" in capsys.readouterr().err


def test_cli_stdout_is_only_the_trace(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_cli(["trace", "--dataset", "mtrag", "--requests", "3", "--interleave", "-q"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert len(read_trace_text(captured.out)) == 3
    assert captured.err == ""


def read_trace_text(text: str) -> list[TraceRequest]:
    from craft_rag.trace import iter_trace

    return list(iter_trace(io.StringIO(text)))


def test_cli_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_cli(["trace", "--dataset", "nq"])
    with pytest.raises(SystemExit):
        parse_cli(["trace", "--dataset", "squad", "--top-k", "0"])
    args = parse_cli(["trace", "--dataset", "squad", "--repeat", "1.5"])
    assert args.func(args) == 2
    assert "repeat must be" in capsys.readouterr().err


def test_cli_missing_data_names_the_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse_cli(["trace", "--dataset", "mtrag", "--data-dir", str(tmp_path)])
    assert args.func(args) == 2
    assert "CRAFT_RAG_DATA" in capsys.readouterr().err


# ----------------------------------------------------------------------------- with retrieval


@pytest.fixture(scope="module")
def small() -> tuple[Retriever, list[Question]]:
    from test_retrieval import make_small_corpus

    passages, questions = make_small_corpus()
    retriever = Retriever.build(
        passages, embedder=Embedder(num_threads=1), kind="flat", show_progress=False
    )
    return retriever, questions


@pytest.mark.retrieval
def test_single_turn_trace_repeats_and_near_duplicates(
    small: tuple[Retriever, list[Question]],
) -> None:
    retriever, questions = small
    trace = single_turn_trace(
        questions, retriever, requests=120, repeat=0.4, near_duplicates=0.5, seed=4
    )
    assert len(trace) == 120
    assert all(len(r.chunks) == 5 and r.answer for r in trace)
    first: dict[str, TraceRequest] = {}
    overlaps: list[float] = []
    reordered = 0
    exact = 0
    for r in trace:
        base = r.id.split("#")[0]
        if "#" not in r.id:
            first[base] = r
            continue
        keys = [c.key for c in r.chunks]
        original = [c.key for c in first[base].chunks]
        if "#repeat@" in r.id:
            assert keys == original  # exact re-ask: identical list, identical order
            exact += 1
        else:
            assert r.query != first[base].query
            overlaps.append(len(set(keys) & set(original)) / 5)
            shared = [k for k in keys if k in original]
            reordered += shared != [k for k in original if k in keys] or set(keys) != set(original)
    assert exact >= 5 and len(overlaps) >= 5
    assert sum(overlaps) / len(overlaps) >= 0.5  # reworded asks retrieve overlapping sets
    assert reordered >= 1  # ... and not always in the same order
    again = single_turn_trace(
        questions, retriever, requests=120, repeat=0.4, near_duplicates=0.5, seed=4
    )
    assert again == trace
    report = sharing_report(trace)
    assert report.identical_sets >= exact


@pytest.mark.retrieval
def test_sharegpt_trace_retrieves_per_user_turn(small: tuple[Retriever, list[Question]]) -> None:
    retriever, _ = small
    sharegpt = load_sharegpt()
    trace = retrieved_conversation_trace(sharegpt.conversations, retriever, top_k=3, requests=12)
    assert len(trace) == 12
    expected = [(c, t) for c in sharegpt.conversations for t in c.turns][:12]
    for r, (c, t) in zip(trace, expected, strict=True):
        assert (r.conversation_id, r.turn, r.query, r.answer) == (
            c.id,
            t.turn,
            t.question,
            t.answer,
        )
        assert len(r.chunks) == 3
    with pytest.raises(ValueError, match="k"):
        retrieved_conversation_trace(sharegpt.conversations, retriever, top_k=0)


@pytest.mark.retrieval
def test_build_trace_uses_a_given_retriever(small: tuple[Retriever, list[Question]]) -> None:
    retriever, _ = small
    config = TraceConfig(dataset="triviaqa", requests=8, top_k=2, seed=1)
    trace = build_trace(config, retriever=retriever, show_progress=False)
    assert len(trace) == 8
    assert all(r.id.startswith("triviaqa:") and len(r.chunks) == 2 for r in trace)
    assert all(isinstance(c.key, str) and c.text for r in trace for c in r.chunks)
    assert isinstance(retriever.passages[0], Passage)
