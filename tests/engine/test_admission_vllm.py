"""Cache-aware admission on the real in-process vLLM engine, under concurrent load.

vLLM runs one request at a time (``max_num_seqs=1``) so the service order is observable: once
a long request has started (its first token seen), two cold RAG turns and then a warm one (its
chunks cached by an earlier turn) arrive. Admission must serve the warm turn before the cold
ones, the cold ones in arrival order, and lose nothing. Once through vLLM's priority scheduler
(keys as ``priority``), once through craft-rag's own queue (vLLM's FCFS scheduler). Each
engine has its own config, hence its own process
(:func:`craft_rag.testing.rerun_in_own_process`).
"""

from __future__ import annotations

import time

import pytest

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine


def serve_under_load(queue: int | None) -> None:
    from craft_rag.engine import CraftEngine, EngineSettings
    from craft_rag.engine.results import RagRequest, SamplingRequest
    from craft_rag.testing import make_chunks

    settings = EngineSettings(
        admission="cache_aware",
        admission_queue=queue,
        max_model_len=2048,
        engine_kwargs={"max_num_seqs": 1},
    )
    with CraftEngine(settings) as engine:
        warm_chunks = make_chunks(4, words=60, prefix="warm")
        engine.generate(warm_chunks, "What is in the documents?", max_tokens=1)
        busy = engine.submit(
            RagRequest(
                make_chunks(2, words=30, prefix="busy"),
                "Summarise.",
                sampling=SamplingRequest(max_tokens=96),
            )
        )
        # The busy request must be running before the others arrive: submitted together, the
        # priority scheduler would rightly pick the warm turn first (CI saw exactly that).
        deadline = time.monotonic() + 600.0
        while busy._flight.state.first_token_at is None and not busy.done():
            assert time.monotonic() < deadline, "the busy request never started"
            time.sleep(0.005)
        one = SamplingRequest(max_tokens=4)
        cold1 = engine.submit(
            RagRequest(make_chunks(4, words=60, prefix="c1"), "Q1?", sampling=one)
        )
        cold2 = engine.submit(
            RagRequest(make_chunks(4, words=60, prefix="c2"), "Q2?", sampling=one)
        )
        warm = engine.submit(RagRequest(warm_chunks, "And again?", sampling=one))
        handles = {"busy": busy, "cold1": cold1, "cold2": cold2, "warm": warm}
        results = {name: h.result() for name, h in handles.items()}  # nothing lost
        first = {name: h._flight.state.first_token_at for name, h in handles.items()}
        assert all(t is not None for t in first.values()), first
        order = sorted(first, key=lambda n: first[n])  # type: ignore[arg-type, return-value]
        assert order == ["busy", "warm", "cold1", "cold2"], (order, first)
        reports = {name: r.report for name, r in results.items()}
        assert reports["warm"].predicted_tokens and reports["warm"].cached_tokens > 0
        assert all(r.output_tokens >= 1 for r in reports.values())
        held = {name: r.admission_held_ms for name, r in reports.items()}
        if queue is None:
            assert held == dict.fromkeys(handles, 0.0)
        else:  # the cold turns waited behind busy and warm in craft-rag's queue
            assert held["cold2"] > held["warm"] > held["busy"] >= 0.0, held  # type: ignore[operator]


def test_priority_scheduler_serves_the_warm_turn_first() -> None:
    if rerun_in_own_process(__file__, "test_priority_scheduler_serves_the_warm_turn_first"):
        return
    serve_under_load(queue=None)


def test_admission_queue_serves_the_warm_turn_first() -> None:
    if rerun_in_own_process(__file__, "test_admission_queue_serves_the_warm_turn_first"):
        return
    serve_under_load(queue=1)
