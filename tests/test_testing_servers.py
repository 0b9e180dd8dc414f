"""craft_rag.testing.servers without servers: the pair is the two URLs and stops/starts one
by index; the fixture is registered (the real servers: tests/server/test_routed_real.py)."""

from __future__ import annotations

import pytest

from craft_rag.testing.servers import ServerPair


class FakeHandle:
    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")


def test_server_pair_is_the_two_urls_and_stops_and_starts_one() -> None:
    a, b = FakeHandle("http://127.0.0.1:1"), FakeHandle("http://127.0.0.1:2")
    pair = ServerPair((a, b))
    first, second = pair
    assert (first, second) == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert pair == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    pair.stop(1)
    pair.start(1)
    assert (a.calls, b.calls) == ([], ["stop", "start"])


@pytest.mark.parametrize("index", [-1, 2, True, "0"])
def test_server_pair_refuses_an_index_other_than_0_or_1(index: object) -> None:
    a, b = FakeHandle("http://127.0.0.1:1"), FakeHandle("http://127.0.0.1:2")
    pair = ServerPair((a, b))
    with pytest.raises(ValueError, match="0 or 1"):
        pair.stop(index)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 or 1"):
        pair.start(index)  # type: ignore[arg-type]
    assert (a.calls, b.calls) == ([], [])


def test_fixture_is_registered(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.hasplugin("craft_rag.testing.servers")
