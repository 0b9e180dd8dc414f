"""Speculative retrieval pipelining's decisions (:mod:`craft_rag.scheduling.pipelining`) over a
fake prefill target and a fake staged retriever (lists of top-k lists); the IVF staged search
over a real faiss index."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from craft_rag.scheduling.pipelining import (
    IVFStagedSearch,
    SpeculativePipeline,
    check_max_in_flight,
)
from craft_rag.testing import FakeClock


@dataclass
class FakeSpeculation:
    chunks: tuple[str, ...]
    prompt: tuple[str, ...]
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True

    def wasted_tokens(self, final_prompt: Sequence[int]) -> int:
        assert self.aborted, "wasted tokens are asked only of aborted speculations"
        return len(self.prompt)


@dataclass
class FakeTarget:
    """Speculations in flight until aborted or served; ``others``: other requests in flight."""

    others: int = 0
    speculations: list[FakeSpeculation] = field(default_factory=list)
    served: list[tuple[tuple[str, ...], FakeSpeculation | None]] = field(default_factory=list)
    fail_serve: bool = False

    def speculate(self, chunks: Sequence[str]) -> FakeSpeculation:
        spec = FakeSpeculation(tuple(chunks), tuple(sorted(chunks)))
        self.speculations.append(spec)
        return spec

    def serve(
        self, chunks: Sequence[str], speculation: FakeSpeculation | None
    ) -> tuple[str, Sequence[int]]:
        if self.fail_serve:
            raise RuntimeError("engine down")
        self.served.append((tuple(chunks), speculation))
        return "answer:" + ",".join(sorted(chunks)), [0] * len(chunks)

    def in_flight(self) -> int:
        return self.others + sum(not s.aborted for s in self.speculations)


def timed(clock: FakeClock, stages: list[list[str]], seconds: float) -> Iterator[list[str]]:
    """Each stage's search takes ``seconds`` on ``clock``."""
    for stage in stages:
        clock.now += seconds
        yield stage


def pipeline(
    target: FakeTarget, **kwargs: object
) -> SpeculativePipeline[str, FakeSpeculation, str]:
    return SpeculativePipeline(target, key=lambda c: c, **kwargs)  # type: ignore[arg-type]


def test_a_changed_set_restarts_the_speculation() -> None:
    target = FakeTarget()
    stages = [["a", "c"], ["a", "b"], ["a", "b"], ["a", "b"]]  # RAGCache's Figure 13
    out = pipeline(target).run(stages)
    first, second = target.speculations
    assert (first.chunks, first.aborted) == (("a", "c"), True)
    assert second.chunks == ("a", "b")
    assert target.served == [(("a", "b"), second)]  # the final request reuses it
    report = out.report
    assert (report.stages, report.speculations, report.restarts, report.gated) == (4, 2, 1, 0)
    assert report.reused and out.result == "answer:a,b" and out.chunks == ("a", "b")
    assert report.wasted_tokens == 2  # the aborted speculation's prompt


def test_a_stable_set_in_another_order_keeps_its_speculation() -> None:
    target = FakeTarget()
    out = pipeline(target).run([["a", "b"], ["b", "a"], ["a", "b"]])
    assert len(target.speculations) == 1 and not target.speculations[0].aborted
    assert out.report.restarts == 0 and out.report.reused and out.report.wasted_tokens == 0
    assert target.served[0][0] == ("a", "b")  # the final stage's chunks, served


def test_the_queue_gate_stops_speculation_but_drops_stale_ones() -> None:
    target = FakeTarget()
    spec = pipeline(target, max_in_flight=1)
    stages: list[list[str]] = [["a"], ["b"], ["c"]]

    def busy_after_first() -> Iterator[list[str]]:
        yield stages[0]
        target.others = 2  # two other requests arrive: more than max_in_flight
        yield from stages[1:]

    out = spec.run(busy_after_first())
    (only,) = target.speculations
    assert only.chunks == ("a",) and only.aborted  # stale, aborted although nothing replaced it
    assert target.served == [(("c",), None)]
    assert (out.report.speculations, out.report.restarts, out.report.gated) == (1, 1, 2)
    assert not out.report.reused


@pytest.mark.parametrize("others", [0, 1])
def test_gate_counts_other_requests_up_to_max_in_flight(others: int) -> None:
    target = FakeTarget(others=others)
    out = pipeline(target, max_in_flight=0).run([["a"], ["a"]])
    assert out.report.speculations == (1 if others == 0 else 0)
    assert out.report.gated == 2 * others  # each stage: no speculation running, still busy


def test_a_known_last_stage_is_served_not_speculated() -> None:
    target = FakeTarget()
    out = pipeline(target).run([["a"], ["b"]], total=2)
    (first,) = target.speculations
    assert first.chunks == ("a",) and first.aborted
    assert target.served == [(("b",), None)]
    assert out.report.speculations == 1 and out.report.restarts == 1


def test_disabled_searches_then_serves() -> None:
    target = FakeTarget()
    clock = FakeClock()
    stages = timed(clock, [["a"], ["b"], ["b"]], 2.0)
    out = pipeline(target, enabled=False, clock=clock).run(stages)
    assert target.speculations == [] and target.served == [(("b",), None)]
    assert out.report.search_s == out.report.non_overlapped_search_s == 6.0


def test_non_overlapped_search_time_ends_when_the_final_set_was_speculated() -> None:
    clock = FakeClock()
    stages = timed(clock, [["a"], ["b"], ["b"], ["b"]], 10.0)  # "b" found by the second stage
    out = pipeline(FakeTarget(), clock=clock).run(stages)
    assert out.report.search_s == 40.0
    assert out.report.non_overlapped_search_s == 20.0
    assert out.report.speculate_s == 0.0  # starting speculations took no (fake) time


def test_non_overlapped_search_time_is_all_of_it_without_a_kept_speculation() -> None:
    clock = FakeClock()
    stages = timed(clock, [["a"], ["a"], ["b"]], 1.0)
    out = pipeline(FakeTarget(), clock=clock).run(stages, total=3)
    assert (out.report.search_s, out.report.non_overlapped_search_s) == (3.0, 3.0)


def test_no_stage_is_an_error() -> None:
    with pytest.raises(ValueError, match="yielded no stage"):
        pipeline(FakeTarget()).run([])


@pytest.mark.parametrize("where", ["search", "serve"])
def test_an_error_aborts_every_speculation(where: str) -> None:
    target = FakeTarget(fail_serve=where == "serve")

    def stages() -> Iterator[list[str]]:
        yield ["a"]
        yield ["b"]
        if where == "search":
            raise OSError("index file gone")

    with pytest.raises((OSError, RuntimeError)):
        pipeline(target).run(stages())
    assert [s.aborted for s in target.speculations] == [True, True]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_max_in_flight_must_be_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        check_max_in_flight(bad)
    with pytest.raises(ValueError, match="max_in_flight"):
        pipeline(FakeTarget(), max_in_flight=bad)


# ---- IVF staged search (real faiss) ---------------------------------------------------------


def make_ivf(metric: str, nlist: int = 32, n: int = 3000, d: int = 16):  # type: ignore[no-untyped-def]
    faiss = pytest.importorskip("faiss")
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    xb = rng.standard_normal((n, d)).astype("float32")
    if metric == "ip":
        quantizer, kind = faiss.IndexFlatIP(d), faiss.METRIC_INNER_PRODUCT
    else:
        quantizer, kind = faiss.IndexFlatL2(d), faiss.METRIC_L2
    index = faiss.IndexIVFFlat(quantizer, d, nlist, kind)
    index.train(xb)
    index.add(xb)
    return index, xb


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize(("stages", "nprobe", "index_nprobe"), [(4, None, 8), (3, 20, 4)])
def test_ivf_stages_end_at_the_plain_search(
    metric: str, stages: int, nprobe: int | None, index_nprobe: int
) -> None:
    faiss = pytest.importorskip("faiss")
    index, xb = make_ivf(metric)
    index.nprobe = index_nprobe
    staged = IVFStagedSearch(index, stages=stages, nprobe=nprobe)
    reference = faiss.clone_index(index)
    reference.nprobe = nprobe or index_nprobe
    changed = 0
    for query in xb[:25] + 0.1:
        got = list(staged.search(query, 5))
        assert [s.number for s in got] == list(range(1, stages + 1))
        assert [s.final for s in got] == [False] * (stages - 1) + [True]
        assert got[-1].clusters == (nprobe or index_nprobe)
        clusters = [s.clusters for s in got]
        assert clusters == sorted(clusters) and len(set(clusters)) == stages
        _, ids = reference.search(query[None, :], 5)
        assert got[-1].ids == tuple(ids[0].tolist())
        changed += got[0].ids != got[-1].ids
        # Scores only improve (IP: grow, L2: shrink) as clusters are added.
        firsts = [s.scores[0] for s in got]
        assert firsts == (sorted(firsts) if metric == "ip" else sorted(firsts, reverse=True))
    assert changed > 0, "the first stage never differed: the test would not see a restart"
    assert index.nprobe == index_nprobe  # the index is not changed


def test_ivf_staged_search_refuses_other_indexes() -> None:
    faiss = pytest.importorskip("faiss")
    with pytest.raises(ValueError, match="IVF index"):
        IVFStagedSearch(faiss.IndexFlatL2(8))
    with pytest.raises(ValueError, match="IVF index"):
        IVFStagedSearch(object())
    index, xb = make_ivf("l2")
    with pytest.raises(ValueError, match="stages"):
        IVFStagedSearch(index, stages=0)
    with pytest.raises(ValueError, match="nprobe"):
        IVFStagedSearch(index, nprobe=33)
    with pytest.raises(ValueError, match="dimension"):
        next(IVFStagedSearch(index).search(xb[0][:4], 5))
    with pytest.raises(ValueError, match="k must"):
        next(IVFStagedSearch(index).search(xb[0], 0))
