"""EngineDriver: routing deltas, failures, aborts, consumer errors."""

from __future__ import annotations

import pytest

from craft_rag.engine.driver import EngineDriver, EngineFailure, RequestCancelled, RequestState
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.testing import FakeBackend


def run(driver: EngineDriver, state: RequestState, max_tokens: int = 3) -> RequestState:
    driver.submit([1, 2, 3, 4], SamplingRequest(max_tokens=max_tokens), state)
    assert state.done.wait(5)
    return state


def test_deltas_are_routed_and_timed() -> None:
    ticks = iter(range(100))
    driver = EngineDriver(FakeBackend(), clock=lambda: float(next(ticks)))
    try:
        seen: list[tuple[tuple[int, ...], float]] = []
        state = RequestState("a", on_delta=lambda out, now: seen.append((out.new_token_ids, now)))
        run(driver, state)
        assert state.error is None and state.token_ids == [101, 102, 103]
        assert state.finish_reason == "length" and state.num_cached_tokens == 0
        assert [ids for ids, _ in seen] == [(101,), (102,), (103,)]
        assert state.first_token_at == seen[0][1] and state.finished_at == seen[-1][1]
        assert state.submitted_at < state.first_token_at
    finally:
        driver.close()


def test_engine_failure_fails_every_waiter_and_the_driver_survives() -> None:
    backend = FakeBackend(fail_on_step=True)
    driver = EngineDriver(backend)
    try:
        state = run(driver, RequestState("a"))
        assert isinstance(state.error, EngineFailure)
        assert isinstance(state.error.__cause__, RuntimeError)
        assert backend.aborted == ["a"]
        backend.fail_on_step = False
        assert run(driver, RequestState("b")).error is None
    finally:
        driver.close()


def test_a_broken_consumer_fails_only_its_request() -> None:
    backend = FakeBackend(step_delay=0.01)
    driver = EngineDriver(backend)

    def explode(out: StepOutput, now: float) -> None:
        raise KeyError("consumer bug")

    try:
        bad, good = RequestState("bad", on_delta=explode), RequestState("good")
        driver.submit([1], SamplingRequest(max_tokens=2), bad)
        driver.submit([2], SamplingRequest(max_tokens=2), good)
        assert bad.done.wait(5) and good.done.wait(5)
        assert isinstance(bad.error, KeyError)
        assert good.error is None and good.token_ids == [101, 102]
        assert "bad" in backend.aborted
    finally:
        driver.close()


def test_abort_and_close_cancel() -> None:
    backend = FakeBackend(step_delay=0.01)
    driver = EngineDriver(backend)
    first, second = RequestState("x"), RequestState("y")
    driver.submit([1], SamplingRequest(max_tokens=400), first)
    with pytest.raises(RuntimeError, match="already in flight"):
        driver.submit([1], SamplingRequest(max_tokens=2), RequestState("x"))
    assert driver.abort("x") and not driver.abort("x")
    assert isinstance(first.error, RequestCancelled)
    assert backend.aborted == ["x"]
    driver.submit([1], SamplingRequest(max_tokens=400), second)
    driver.close()
    assert isinstance(second.error, RequestCancelled)
    with pytest.raises(RuntimeError, match="closed"):
        driver.submit([1], SamplingRequest(), RequestState("z"))


def test_add_request_errors_reach_the_caller_and_register_nothing() -> None:
    driver = EngineDriver(FakeBackend(max_model_len=4))
    try:
        with pytest.raises(ValueError, match="too long"):
            driver.submit([1, 2, 3], SamplingRequest(max_tokens=2), RequestState("long"))
        assert driver.in_flight() == 0
    finally:
        driver.close()
