"""Cache-aware admission: keys, the queue's exact orders, the starvation bound, bad inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from craft_rag.scheduling import (
    ADMISSION_POLICIES,
    PRIORITY_SCALE,
    AdmissionOrder,
    AdmissionQueue,
    get_admission_policy,
)
from craft_rag.testing import FakeClock


def make_queue(
    policy: str = "cache_aware", window: int = 32, clock: FakeClock | None = None
) -> AdmissionQueue[str]:
    return AdmissionQueue(AdmissionOrder(policy, window), clock=clock or FakeClock(100.0))


def pop_all(queue: AdmissionQueue[str]) -> list[str]:
    out = []
    while (admitted := queue.pop()) is not None:
        queue._check_invariants()
        out.append(admitted.item)
    return out


def test_cache_aware_serves_the_most_cached_first() -> None:
    queue = make_queue()
    for name, cached in (("cold", 0), ("warm", 90), ("half", 50), ("cold2", 0)):
        queue.push(name, name, cached, 100)
    assert pop_all(queue) == ["warm", "half", "cold", "cold2"]


@pytest.mark.parametrize("policy", sorted(ADMISSION_POLICIES))
def test_equal_predictions_go_first_come_first_served(policy: str) -> None:
    queue = make_queue(policy)
    for i in range(6):
        queue.push(f"r{i}", f"r{i}", 40, 100)
    assert pop_all(queue) == [f"r{i}" for i in range(6)]


def test_fcfs_ignores_predictions() -> None:
    queue = make_queue("fcfs")
    for i, cached in enumerate((0, 99, 50, 10)):
        queue.push(f"r{i}", f"r{i}", cached, 100)
    assert pop_all(queue) == ["r0", "r1", "r2", "r3"]


def test_equal_keys_tie_to_the_earlier_arrival() -> None:
    # arrival 0 with f=0 and arrival 1 with f=1/32 get the same key (32 * SCALE).
    order = AdmissionOrder("cache_aware", 32)
    queue: AdmissionQueue[str] = AdmissionQueue(order, clock=FakeClock(100.0))
    assert queue.push("a", "a", 0, 64) == 32 * PRIORITY_SCALE
    assert queue.push("b", "b", 2, 64) == 32 * PRIORITY_SCALE
    assert pop_all(queue) == ["a", "b"]


def test_aging_bounds_how_many_later_requests_overtake() -> None:
    # window 4: a cold request is overtaken by at most 3 later, nearly fully cached ones.
    queue = make_queue(window=4)
    queue.push("cold", "cold", 0, 100)
    for k in range(1, 8):
        queue.push(f"hot{k}", f"hot{k}", 99, 100)
    assert pop_all(queue) == ["hot1", "hot2", "hot3", "cold", "hot4", "hot5", "hot6", "hot7"]


def test_window_one_is_fcfs() -> None:
    queue = make_queue(window=1)
    for i, cached in enumerate((0, 100, 99, 0, 100)):
        queue.push(f"r{i}", f"r{i}", cached, 100)
    assert pop_all(queue) == [f"r{i}" for i in range(5)]


def test_held_time_comes_from_the_injected_clock() -> None:
    clock = FakeClock(100.0)
    queue = make_queue(clock=clock)
    queue.push("a", "a", 0, 10)
    clock.tick(0.25)
    queue.push("b", "b", 0, 10)
    clock.tick(0.5)
    first, second = queue.pop(), queue.pop()
    assert first is not None and second is not None
    assert (first.request_id, first.held_s) == ("a", 0.75)
    assert (second.request_id, second.held_s) == ("b", 0.5)
    assert queue.pop() is None


def test_remove_takes_a_waiting_request_out() -> None:
    queue = make_queue()
    for name, cached in (("a", 0), ("b", 90), ("c", 50)):
        queue.push(name, name, cached, 100)
    assert queue.remove("b") == "b"
    assert queue.remove("b") is None
    assert "b" not in queue and len(queue) == 2
    queue._check_invariants()
    assert pop_all(queue) == ["c", "a"]
    queue.push("d", "d", 0, 100)
    assert queue.remove("d") == "d" and queue.pop() is None
    queue._check_invariants()


def test_drain_returns_admission_order() -> None:
    queue = make_queue()
    for name, cached in (("a", 0), ("b", 90)):
        queue.push(name, name, cached, 100)
    assert queue.drain() == ["b", "a"] and len(queue) == 0


def test_whole_prompt_predicted_still_computes_one_token() -> None:
    order = AdmissionOrder("cache_aware", 32)
    assert order.fraction(100, 100) == pytest.approx(99 / 100)
    assert order.fraction(0, 1) == 0.0 and order.fraction(1, 1) == 0.0


def test_keys_fit_vllm_priorities() -> None:
    order = AdmissionOrder("cache_aware", 32)
    keys = [order.key(c, 100) for c in (100, 0, 100, 50)]
    assert all(0 <= k < 2**63 for k in keys)
    assert order.key_of(0, 1.0) == 0 and order.key_of(0, 0.0) == 32 * PRIORITY_SCALE


def test_duplicate_id_is_refused() -> None:
    queue = make_queue()
    queue.push("a", "a", 0, 10)
    with pytest.raises(RuntimeError, match="already waiting"):
        queue.push("a", "a", 0, 10)


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"cache_aware.*fcfs"):
        get_admission_policy("lifo")
    with pytest.raises(ValueError, match="fcfs"):
        AdmissionOrder("random")


@pytest.mark.parametrize("window", [0, -1, True, 1.5, "32"])
def test_bad_window(window: object) -> None:
    with pytest.raises(ValueError, match="window"):
        AdmissionOrder("fcfs", window)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cached", "prompt"), [(-1, 10), (11, 10), (0, 0), (True, 10), (1.0, 10), (0, None)]
)
def test_bad_token_counts(cached: object, prompt: object) -> None:
    queue = make_queue()
    with pytest.raises(ValueError):
        queue.push("a", "a", cached, prompt)  # type: ignore[arg-type]
    assert len(queue) == 0
    # No arrival number was consumed by the refused push.
    assert queue.push("b", "b", 0, 10) == 32 * PRIORITY_SCALE


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 200), st.integers(1, 200)),
        st.tuples(st.just("pop"), st.just(0), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 60), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, window=st.integers(1, 8), policy=st.sampled_from(sorted(ADMISSION_POLICIES)))
def test_no_request_is_overtaken_by_window_or_more_later_arrivals(
    ops: list[tuple[str, int, int]], window: int, policy: str
) -> None:
    queue = make_queue(policy, window)
    arrivals = 0
    served_after: dict[int, int] = {}  # arrival -> later arrivals served while it waited
    waiting: set[int] = set()
    for op, a, b in ops:
        if op == "push":
            cached = min(a, b)
            queue.push(str(arrivals), str(arrivals), cached, b)
            waiting.add(arrivals)
            served_after[arrivals] = 0
            arrivals += 1
        elif op == "pop":
            admitted = queue.pop()
            if admitted is None:
                assert not waiting
                continue
            n = int(admitted.item)
            waiting.discard(n)
            for w in waiting:
                if w < n:
                    served_after[w] += 1
                    assert served_after[w] <= window - 1, (w, n, served_after[w])
            if policy == "fcfs":
                assert all(w > n for w in waiting)
        elif str(a) in queue:
            queue.remove(str(a))
            waiting.discard(a)
        queue._check_invariants()
        assert len(queue) == len(waiting)
