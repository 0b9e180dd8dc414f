"""Cache-aware admission in the drivers: craft-rag's queue, vLLM priorities, the engine switch."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from craft_rag.chunk import Chunk
from craft_rag.engine import EngineSettings
from craft_rag.engine.admission import Admission, admission_of
from craft_rag.engine.backends.server.backend import ServerBackend
from craft_rag.engine.backends.server.driver import ServerDriver
from craft_rag.engine.driver import EngineDriver, RequestCancelled, RequestState
from craft_rag.engine.history_budget import HistoryBudget
from craft_rag.engine.results import RagRequest, SamplingRequest
from craft_rag.scheduling import PRIORITY_SCALE, AdmissionOrder
from craft_rag.testing import FakeBackend, FakeClock, make_chunks, make_fake_engine

PROMPT = list(range(3, 103))  # 100 tokens


def queued_driver(
    policy: str, backend: FakeBackend, clock: FakeClock, max_running: int = 1
) -> EngineDriver:
    return EngineDriver(
        backend, clock=clock, admission=Admission(AdmissionOrder(policy, 32), max_running)
    )


def submit(driver: EngineDriver, name: str, predicted: int, max_tokens: int = 2) -> RequestState:
    state = RequestState(name, predicted_cached_tokens=predicted)
    driver.submit(PROMPT, SamplingRequest(max_tokens=max_tokens), state)
    return state


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("cache_aware", ["busy", "warm", "half", "cold", "cold2"]),
        ("fcfs", ["busy", "cold", "warm", "half", "cold2"]),
    ],
)
def test_the_queue_lets_requests_in_by_policy(policy: str, expected: list[str]) -> None:
    gate = threading.Event()  # holds the first step until everything is queued
    backend, clock = FakeBackend(step_gate=gate), FakeClock()
    driver = queued_driver(policy, backend, clock)
    try:
        states = [submit(driver, "busy", 0)]
        clock.now = 1.0
        for name, predicted in (("cold", 0), ("warm", 90), ("half", 50), ("cold2", 0)):
            states.append(submit(driver, name, predicted))
        assert [rid for rid, _, _ in backend.added] == ["busy"]  # one at a time
        clock.now = 3.0
        gate.set()
        assert all(s.done.wait(5) for s in states)
        assert [rid for rid, _, _ in backend.added] == expected
        assert all(s.error is None and len(s.token_ids) == 2 for s in states)
        assert states[0].held_s == 0.0
        assert all(s.held_s is not None and s.held_s >= 2.0 for s in states[1:])
    finally:
        driver.close()


def test_a_held_request_aborted_never_reaches_the_engine() -> None:
    gate = threading.Event()
    backend, clock = FakeBackend(step_gate=gate), FakeClock()
    driver = queued_driver("cache_aware", backend, clock)
    try:
        busy, held, other = (
            submit(driver, "busy", 0),
            submit(driver, "held", 90),
            submit(driver, "other", 0),
        )
        assert driver.abort("held") and not driver.abort("held")
        assert isinstance(held.error, RequestCancelled)
        gate.set()
        assert busy.done.wait(5) and other.done.wait(5)
        assert [rid for rid, _, _ in backend.added] == ["busy", "other"]
        assert "held" not in backend.aborted and driver.in_flight() == 0
    finally:
        driver.close()


def test_an_error_entering_the_engine_fails_only_that_request() -> None:
    gate = threading.Event()
    backend, clock = FakeBackend(step_gate=gate, max_model_len=104), FakeClock()
    driver = queued_driver("fcfs", backend, clock)
    try:
        busy = submit(driver, "busy", 0)
        too_long = submit(driver, "long", 0, max_tokens=50)  # held: the error comes later
        fine = submit(driver, "fine", 0)
        gate.set()
        assert busy.done.wait(5) and too_long.done.wait(5) and fine.done.wait(5)
        assert isinstance(too_long.error, ValueError)
        assert busy.error is None and fine.error is None
        assert [rid for rid, _, _ in backend.added] == ["busy", "fine"]
    finally:
        driver.close()


def test_closing_fails_held_requests() -> None:
    gate = threading.Event()
    backend, clock = FakeBackend(step_gate=gate), FakeClock()
    driver = queued_driver("fcfs", backend, clock)
    busy, held = submit(driver, "busy", 0), submit(driver, "held", 0)
    gate.set()
    driver.close()
    assert busy.done.wait(5) and held.done.wait(5)
    assert held.error is not None and "held" not in [rid for rid, _, _ in backend.added]


def test_priority_mode_hands_the_keys_to_the_engine() -> None:
    backend = FakeBackend()
    driver = EngineDriver(backend, admission=Admission(AdmissionOrder("cache_aware", 32)))
    try:
        cold, warm = submit(driver, "cold", 0), submit(driver, "warm", 100)
        assert cold.done.wait(5) and warm.done.wait(5)
        # arrival 0, fraction 0; arrival 1, fraction 99/100 (one token is always computed)
        assert backend.priorities == {
            "cold": 32 * PRIORITY_SCALE,
            "warm": 33 * PRIORITY_SCALE - int(32 * PRIORITY_SCALE * 0.99),
        }
        assert cold.held_s == 0.0 and warm.held_s == 0.0
    finally:
        driver.close()


def test_without_admission_nothing_changes() -> None:
    backend = FakeBackend()
    driver = EngineDriver(backend)
    try:
        state = submit(driver, "a", 50)
        assert state.done.wait(5) and state.held_s is None
    finally:
        driver.close()


def test_engine_settings_switch() -> None:
    assert admission_of(EngineSettings()) is None
    on = admission_of(EngineSettings(admission="cache_aware"))
    assert on is not None and on.uses_priority and on.order.window == 32
    queued = admission_of(EngineSettings(admission_queue=4, admission_window=8))
    assert queued is not None and queued.max_running == 4 and queued.order.policy.name == "fcfs"
    with pytest.raises(ValueError, match=r"cache_aware.*fcfs"):
        EngineSettings(admission="sjf")
    with pytest.raises(ValueError, match="admission_window"):
        EngineSettings(admission_window=0)
    with pytest.raises(ValueError, match="admission_queue"):
        EngineSettings(admission_queue=0)


def test_a_server_body_carries_the_priority() -> None:
    backend = object.__new__(ServerBackend)
    backend.model_name = "m"
    body = ServerBackend.body(backend, [1, 2], SamplingRequest(), None, 1234)
    assert body["priority"] == 1234
    assert "priority" not in ServerBackend.body(backend, [1, 2], SamplingRequest(), None)


def test_the_engine_serves_the_predicted_warm_turn_first_and_reports_the_hold() -> None:
    gate = threading.Event()
    settings = EngineSettings(admission="cache_aware", admission_queue=1)
    engine, backend = make_fake_engine(FakeBackend(step_gate=gate), settings=settings)
    try:
        warm_chunks = make_chunks(4, words=40)
        cold_chunks = make_chunks(4, words=40, prefix="cold", seed=9)
        gate.set()
        engine.generate(warm_chunks, "first?", max_tokens=1)  # warms the CP-Tree
        gate.clear()
        busy = engine.submit(RagRequest(make_chunks(2, prefix="x", seed=3), "busy?"))
        cold = engine.submit(RagRequest(cold_chunks, "cold?"))
        warm = engine.submit(RagRequest(warm_chunks, "warm again?"))
        gate.set()
        results = [h.result() for h in (busy, cold, warm)]
        order = [rid for rid, _, _ in backend.added][1:]
        assert order == [busy.request_id, warm.request_id, cold.request_id]
        assert results[2].report.predicted_tokens and results[2].report.cached_tokens > 0
        assert all(r.report.admission_held_ms is not None for r in results)
        assert results[1].report.admission_held_ms > 0.0  # type: ignore[operator]
    finally:
        engine.close()


def test_the_report_has_no_hold_with_admission_off() -> None:
    engine, _ = make_fake_engine()
    try:
        result = engine.generate(make_chunks(2), "q?", max_tokens=1)
        assert result.report.admission_held_ms is None
    finally:
        engine.close()


class RecordingServer:
    """Stands in for ``ServerBackend.stream``: records the priority each request carried."""

    def __init__(self) -> None:
        self.priorities: list[int | None] = []

    def stream(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        cancelled: threading.Event | None = None,
        *,
        priority: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        self.priorities.append(priority)
        yield {"token_ids": [7], "text": "x"}
        yield {"done": True, "finish_reason": "length", "cached_tokens": 0}


def test_the_server_driver_sends_each_request_its_key() -> None:
    server = RecordingServer()
    admission = Admission(AdmissionOrder("cache_aware", 32))
    driver = ServerDriver(server, admission=admission)  # type: ignore[arg-type]
    try:
        cold, warm = submit_to(driver, "cold", 0), submit_to(driver, "warm", 100)
        assert cold.done.wait(5) and warm.done.wait(5)
        assert cold.error is None and warm.error is None
        assert sorted(server.priorities) == sorted(  # type: ignore[type-var]
            [32 * PRIORITY_SCALE, 33 * PRIORITY_SCALE - int(32 * PRIORITY_SCALE * 0.99)]
        )
        assert cold.held_s == 0.0 and warm.held_s == 0.0
    finally:
        driver.close()


def submit_to(driver: ServerDriver, name: str, predicted: int) -> RequestState:
    state = RequestState(name, predicted_cached_tokens=predicted)
    driver.submit(PROMPT, SamplingRequest(max_tokens=1), state)
    return state


def test_a_later_turn_ranks_by_its_cached_history() -> None:
    # An append-only turn starts with the previous prompt and reply (cached): it ranks warmer
    # than a cold first turn of the same length that arrived before it.
    backend = FakeBackend()
    engine, _ = make_fake_engine(backend, settings=EngineSettings(admission="cache_aware"))
    renderer = engine.prompt_renderer
    head = len(renderer.chat_assembler.head_ids)
    try:
        engine.submit(RagRequest(make_chunks(3, words=30), "first?", "c")).result()
        new_chunks = make_chunks(1, words=10, prefix="new", seed=5)
        length = head + renderer.history_tokens("c")
        length += renderer.turn_token_count(new_chunks, "second?", "c")
        words = next(  # a cold first turn of the second turn's length
            w
            for w in range(1, 400)
            if head + renderer.turn_token_count(cold_chunk(w), "cold?", "d") >= length
        )
        cold = engine.submit(RagRequest(cold_chunk(words), "cold?", "d"))
        second = engine.submit(RagRequest(new_chunks, "second?", "c"))
        cold_result, second_result = cold.result(), second.result()
        lengths = {rid: len(ids) for rid, ids, _ in backend.added}
        assert lengths[cold.request_id] == lengths[second.request_id] == length
        keys = backend.priorities
        assert keys[cold.request_id] == 33 * PRIORITY_SCALE  # arrival 1, nothing cached
        warm_key = keys[second.request_id]
        assert warm_key is not None and warm_key < 33 * PRIORITY_SCALE
        # arrival 2; the history predicted as the layout predicts it (whole blocks).
        layout = second_result.report.layout
        assert layout is not None and not layout.restart and layout.append_cached > length // 2
        fraction = int(32 * PRIORITY_SCALE * layout.append_cached / length)
        assert warm_key == 34 * PRIORITY_SCALE - fraction
        assert cold_result.report.cached_tokens == 0
    finally:
        engine.close()


def test_a_turn_after_dropped_turns_ranks_cold() -> None:
    # The budget drops turn 1 once turn 2 is served: turn 3's history no longer starts the
    # cached prompts (it differs right after the head), so nothing is predicted cached.
    settings = EngineSettings(admission="cache_aware")
    budget = HistoryBudget(max_tokens=200, keep_tokens=100)
    backend = FakeBackend()
    engine, _ = make_fake_engine(backend, settings=settings, history_budget=budget)
    try:
        engine.submit(RagRequest(make_chunks(3, words=30), "first?", "c")).result()
        second = engine.submit(RagRequest(make_chunks(1, prefix="b", seed=2), "second?", "c"))
        assert second.result().report.dropped_turns == 0
        third = engine.submit(RagRequest(make_chunks(1, prefix="t", seed=3), "third?", "c"))
        assert third.result().report.dropped_turns == 1  # turn 1, left out since turn 2
        warm_key, cold_key = (
            backend.priorities[second.request_id],
            backend.priorities[third.request_id],
        )
        assert warm_key is not None and warm_key < 33 * PRIORITY_SCALE
        assert cold_key == 34 * PRIORITY_SCALE
    finally:
        engine.close()


def cold_chunk(words: int) -> list[Chunk]:
    return make_chunks(1, words=words, prefix="cold", seed=7)
