"""The router scopes conversations by tenant (salt): one conversation id under two salts is two
conversations with their own homes, turns and ends, and no error, log line or repr the router
makes shows a salt."""

from __future__ import annotations

import logging

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.routing import RouteDecision, Router, RouterConfig
from craft_rag.routing.policies import RouteRequest

SECRET_A = "tenant-a-secret-9f1c"
SECRET_B = "tenant-b-secret-77d0"


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n, num_tokens=64) for n in names]


def serve(router: Router, names: str, conversation: str, salt: str | None) -> RouteDecision:
    chunks = make_chunks(*names.split())
    d = router.route(chunks, prompt_tokens=32 + 64 * len(chunks) + 16,
                     conversation_id=conversation, salt=salt)
    router.planner(d.replica, salt).commit(d.plan, prefix_tokens=32)
    assert router.finish(d)
    return d


def test_one_id_under_two_salts_is_two_conversations(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    router = Router(["r0", "r1"], "craft_joint", RouterConfig())
    a1 = serve(router, "a b", "support-1", SECRET_A)
    b1 = serve(router, "x y", "support-1", SECRET_B)  # no collision error: B's own first turn
    assert (a1.plan.turn, b1.plan.turn) == (1, 1) and not b1.sticky
    u1 = serve(router, "a", "support-1", None)
    assert u1.plan.turn == 1
    a2 = serve(router, "b c", "support-1", SECRET_A)
    assert (a2.replica, a2.sticky, a2.plan.turn) == (a1.replica, True, 2)
    assert [c.key for c in a2.plan.removed_duplicates] == ["b"]
    assert router.home("support-1", salt=SECRET_B) == b1.replica
    assert router.home("support-1") == u1.replica
    # B ends its conversation: A's and the unsalted one go on.
    assert router.end_conversation("support-1", salt=SECRET_B)
    assert not router.end_conversation("support-1", salt=SECRET_B)
    assert router.home("support-1", salt=SECRET_B) is None
    assert serve(router, "c d", "support-1", SECRET_A).plan.turn == 3
    assert serve(router, "x", "support-1", SECRET_B).plan.turn == 1
    assert router.end_conversation("support-1")  # the old call: the unsalted one only
    assert serve(router, "d e", "support-1", SECRET_A).plan.turn == 4
    router._check_invariants()
    # A replica fault re-homes both tenants' conversations, each keeping its salt.
    report = router.mark_down(a1.replica)
    router._check_invariants()
    request = RouteRequest(tuple(make_chunks("a")), ("a",), 100, None, SECRET_A)  # type: ignore[arg-type]
    for seen in (repr(report), repr(a2), repr(request), repr(router.load()), caplog.text):
        assert SECRET_A not in seen and SECRET_B not in seen


def test_router_errors_never_show_a_salt() -> None:
    router = Router(["r0"], "round_robin", RouterConfig())
    serve(router, "a", "c", SECRET_A)
    errors: list[str] = []
    for salt in ("", 5, SECRET_B):
        try:
            router.route(make_chunks("b"), prompt_tokens=0, conversation_id="c", salt=salt)  # type: ignore[arg-type]
        except ValueError as e:
            errors.append(str(e))
    with pytest.raises(ValueError) as bad:
        router.route(make_chunks("b"), prompt_tokens=200, conversation_id="c", salt="")
    errors.append(str(bad.value))
    assert errors and all(SECRET_A not in e and SECRET_B not in e for e in errors)

