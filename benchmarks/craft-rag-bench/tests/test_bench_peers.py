"""Peer orders of the bench (issue 16): ContextPilot online/offline and LongContextReorder."""

from __future__ import annotations

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench import peers
from craft_rag_bench.bench.peers import (
    PEER_ORDERS,
    _litm_langchain,
    _litm_llama_index,
    _litm_rule,
    long_context_reorder,
    peer_orders,
    peer_trace,
)


def make_request(*ids: str) -> list[Chunk]:
    return [make_chunk(f"text of {i}", id=i) for i in ids]


def keys(chunks: list[Chunk]) -> list[str]:
    return [c.key for c in chunks]


def test_litm_rule_puts_the_most_relevant_at_the_ends() -> None:
    assert _litm_rule([1, 2, 3, 4, 5]) == [1, 3, 5, 4, 2]
    assert _litm_rule([1, 2]) == [2, 1]  # even length: the most relevant ends the list


@pytest.mark.parametrize("impl", [_litm_langchain, _litm_llama_index])
def test_real_long_context_reorder_classes_agree_with_the_rule(impl: object) -> None:
    got = impl(["a", "b", "c", "d", "e", "f"])  # type: ignore[operator]
    if got is None:
        pytest.skip("framework not installed")
    assert got == _litm_rule(["a", "b", "c", "d", "e", "f"])


def test_long_context_reorder_is_a_permutation() -> None:
    request = make_request("a", "b", "c", "d", "e")
    assert keys(long_context_reorder(request)) == ["a", "c", "e", "d", "b"]
    assert long_context_reorder(request[:1]) == request[:1]


def test_unknown_peer_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="contextpilot_online"):
        peer_orders("nope", [])


contextpilot = pytest.importorskip("contextpilot.server.live_index")


def workload() -> list[list[Chunk]]:
    return [
        make_request("a", "b", "c", "d"),
        make_request("x", "y", "z"),
        make_request("d", "c", "b", "q"),
        make_request("z", "y", "w"),
        make_request("c", "b", "d", "a"),
    ]


@pytest.mark.parametrize("name", PEER_ORDERS)
def test_every_peer_returns_a_permutation_of_each_request(name: str) -> None:
    requests = workload()
    out = peer_orders(name, requests)
    assert len(out) == len(requests)
    for got, want in zip(out, requests, strict=True):
        assert sorted(keys(got)) == sorted(keys(want))


def test_contextpilot_online_sees_only_the_past() -> None:
    requests = workload()
    short = peer_orders("contextpilot_online", requests[:3])
    full = peer_orders("contextpilot_online", requests)
    assert [keys(o) for o in full[:3]] == [keys(o) for o in short]


def test_contextpilot_online_aligns_a_repeated_overlap() -> None:
    # Request 3 shares {b, c, d} with request 1: ContextPilot puts the shared docs first in
    # the order request 1 was given.
    out = peer_orders("contextpilot_online", workload())
    assert keys(out[2])[:3] == [k for k in keys(out[0]) if k in {"b", "c", "d"}]


def test_contextpilot_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    peer_orders("contextpilot_online", workload())
    peer_orders("contextpilot_offline", workload())
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_contextpilot_online_past_1000_children_uses_the_serial_branch() -> None:
    # 0.5.0's parallel branch (>= 1,000 children at one level) cannot pickle its worker; the
    # patched serial branch must serve the request, and the patch is undone afterwards.
    original = contextpilot.compute_distances_batch
    requests = [make_request(f"d{i}") for i in range(1001)]
    requests.append(make_request("d5", "new"))
    out = peer_orders("contextpilot_online", requests)
    assert keys(out[-1])[0] == "d5"
    assert contextpilot.compute_distances_batch is original


def test_peer_trace_keeps_arrival_order_and_request_fields() -> None:
    trace = [TraceRequest(id=f"r{i}", query=f"q{i}", chunks=tuple(r))
             for i, r in enumerate(workload())]
    out = peer_trace("contextpilot_offline", trace)
    assert [r.id for r in out] == [r.id for r in trace]
    assert [r.query for r in out] == [r.query for r in trace]
    assert frozenset({"contextpilot_offline"}) == peers.SEES_FUTURE
