"""Bad input to the shared routing state (``craft_rag.routing.shared_state``).

Settings out of range are refused with the name of what is wrong; values other workers (or
anyone with access to the Redis database) left malformed are ignored, never trusted as a load;
a good worker's load beside them is still read. Real redis-server (``CRAFT_RAG_TEST_REDIS``).
"""

from __future__ import annotations

import math
import os

import pytest

from craft_rag.routing.replica import ReplicaId, ReplicaLoad
from craft_rag.routing.shared_state import (
    MemoryRoutingState,
    RedisRoutingState,
    _parse_load,
    routing_scope,
    routing_state_for,
)
from craft_rag.stores.redis_store import RedisStore


@pytest.mark.parametrize("field", ["lease_s", "home_ttl_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf])
def test_memory_state_refuses_bad_durations(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        MemoryRoutingState(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "1 2 3",
        "1 2 3 4 5",
        "a 2 0.5 4",
        "1 2 x 4",
        "-1 2 0.5 4",
        "1 -2 0.5 4",
        "1 2 -0.5 4",
        "1 2 inf 4",
        "1 2 nan 4",
        "1 2 0.5 -4",
    ],
)
def test_malformed_load_texts_are_ignored(text: str | None) -> None:
    assert _parse_load(text) is None


def test_a_well_formed_load_text_parses() -> None:
    assert _parse_load("3 120 0.25 7") == ReplicaLoad(3, 120, 0.25, 7)


@pytest.fixture
def redis_store() -> RedisStore:
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI needs CRAFT_RAG_TEST_REDIS (a disposable Redis database)")
        pytest.skip("set CRAFT_RAG_TEST_REDIS=redis://127.0.0.1:PORT/DB (a disposable database)")
    store = RedisStore(url)
    store._client.flushdb()
    return store


def test_redis_state_refuses_a_bad_scope_and_durations(redis_store: RedisStore) -> None:
    client, call = redis_store._client, redis_store._call
    with pytest.raises(ValueError, match="scope"):
        RedisRoutingState(client, call, "routing:../x")
    with pytest.raises(ValueError, match="lease_s"):
        RedisRoutingState(client, call, "abc", lease_s=0)
    with pytest.raises(ValueError, match="home_ttl_s"):
        RedisRoutingState(client, call, "abc", home_ttl_s=-5)


def test_corrupt_loads_in_redis_are_ignored_and_good_ones_kept(redis_store: RedisStore) -> None:
    replicas = ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    me = routing_state_for(redis_store, replicas)
    other = routing_state_for(redis_store, replicas)
    assert isinstance(me, RedisRoutingState) and isinstance(other, RedisRoutingState)
    good = ReplicaLoad(2, 300, 0.5, 4)
    other.publish_loads({ReplicaId("a"): good})
    # A third "worker" that wrote garbage straight into the database.
    prefix = f"craft-rag:{{routing.{routing_scope(replicas)}}}:"
    client = redis_store._client
    client.hset(
        prefix + "load:evil",
        mapping={"a": "9 9 nan 9", "b": "not a load", "c": "-1 0 0 0", b"\xff": "1 1 1.0 1"},
    )
    client.sadd(prefix + "workers", "evil")
    assert me.other_loads() == {ReplicaId("a"): good}
    me.close()
    other.close()
