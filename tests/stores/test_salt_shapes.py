"""Odd cache salts against the shared stores (a real SQLite file, the real redis-server): a
salt that is not valid Unicode is a ValueError that shows nothing of it (it was a raw
UnicodeEncodeError quoting one of its characters, from the store's namespace digest), and
salts that differ only by case, Unicode normalization or whitespace, a salt spelled like the
default namespace or like a conversation id, are each their own tenant: never the same
conversation (vLLM keys its cache by the exact salt too, so these are different tenants)."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_tenant_scoping import _engine

from craft_rag.engine.engine import CraftEngine
from craft_rag.stores import open_store
from craft_rag.testing import make_chunks

CONV = "support-1"


@pytest.fixture(params=["sqlite", "redis"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CraftEngine]:
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'salts.db'}"
    else:
        url = str(request.getfixturevalue("redis_url"))
    store = open_store(url)
    worker = _engine(store)
    yield worker
    worker.close()
    store.close()


def test_a_salt_with_a_lone_surrogate_is_a_clear_error_showing_nothing(
    engine: CraftEngine,
) -> None:
    salt = "tenant-\udc80-secret"
    calls = [
        lambda: engine.generate(make_chunks(2), "Q?", conversation_id=CONV, cache_salt=salt),
        lambda: engine.end_conversation(CONV, cache_salt=salt),
        lambda: engine.turn_count(CONV, cache_salt=salt),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="cache_salt") as info:
            call()
        assert not isinstance(info.value, UnicodeError)
        assert "secret" not in str(info.value) and "udc80" not in str(info.value)
    # Nothing was written: the conversation is new under a good salt and under none.
    assert engine.generate(make_chunks(2), "Q?", conversation_id=CONV).report.turn == 1


def test_look_alike_salts_are_separate_tenants(engine: CraftEngine) -> None:
    salts = [
        "Tenant",
        "tenant",
        "tenant ",
        " tenant",
        "ten\u200bant",
        unicodedata.normalize("NFC", "caf\u00e9"),
        unicodedata.normalize("NFD", "caf\u00e9"),
        "default",
        CONV,
        "x" * 128,
    ]
    for salt in [*salts, None]:
        first = engine.generate(make_chunks(2), "Q?", conversation_id=CONV, cache_salt=salt)
        assert first.report.turn == 1, salt  # no other salt's conversation was continued
    engine.generate(make_chunks(2), "Q2?", conversation_id=CONV, cache_salt="tenant")
    assert engine.end_conversation(CONV, cache_salt="Tenant")
    for salt in [*salts, None]:
        expected = 0 if salt == "Tenant" else 2 if salt == "tenant" else 1
        assert engine.turn_count(CONV, cache_salt=salt) == expected, salt
