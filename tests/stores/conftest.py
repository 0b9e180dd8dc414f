"""Store fixtures: a real redis-server, real SQLite files, and one factory per backend.

Redis: ``CRAFT_RAG_TEST_REDIS=redis://127.0.0.1:PORT/0`` (set by ``.ci/run``) names a disposable
database (it is flushed before each test); without it a session redis-server is started on a
free loopback port if the binary exists. With ``CI`` set a missing Redis fails the tests
instead of skipping them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from craft_rag.stores import MemoryStore, StateStore, open_store

BACKENDS = ("memory", "sqlite", "redis")


def _missing_redis(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: Redis is required; .ci/run installs and starts it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real redis-server database for the tests."""
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        _missing_redis("redis-server not installed (apt-get install -y redis-server)")
    from craft_rag.stores.local_redis import local_redis

    with local_redis() as started:
        yield started


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The test Redis database, flushed (tests start empty)."""
    import redis

    client = redis.Redis.from_url(redis_server)
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as e:
        _missing_redis(f"cannot reach the test Redis {redis_server}: {e}")
    finally:
        client.close()
    return redis_server


StoreFactory = Callable[..., StateStore]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A URL of an empty store of ``backend`` (memory:// stores are per object, see
    ``make_store``)."""
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite://{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def make_store(store_url: str) -> Iterator[StoreFactory]:
    """``make_store(**options)``: a connection to the SAME store as every earlier call (another
    worker's view): the one MemoryStore object for memory://, a new connection otherwise.
    Options become URL query options (``snapshot_every=4``)."""
    opened: list[StateStore] = []
    shared: dict[str, MemoryStore] = {}

    def make(**options: object) -> StateStore:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        url = store_url + (f"?{query}" if query else "")
        if store_url.startswith("memory"):
            if url not in shared:
                shared[url] = MemoryStore.from_url(url)
            return shared[url]
        store = open_store(url)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
