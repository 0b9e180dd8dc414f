"""A turn whose token ids never reached the store (its worker failed between commit and store)
does not refuse the conversation for good: past a grace period every worker drops it (logged
through the store) and serves on. Two engines (fake backend) on each real store backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.stores import StateStore, StoreUnavailable
from craft_rag.stores import histories as histories_module
from craft_rag.testing import FakeBackend, make_chunks, make_fake_engine

StoreFactory = Callable[..., StateStore]
CONV = "chat-1"


def _engine(store: StateStore) -> CraftEngine:
    return make_fake_engine(FakeBackend(max_model_len=1024), store=store)[0]


def test_a_turn_whose_history_was_never_stored_is_given_up_not_refused_forever(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_a, store_b = make_store(), make_store()
    a, b = _engine(store_a), _engine(store_b)
    chunks = make_chunks(6, words=12)

    def lost(*args: object, **kwargs: object) -> bool:
        raise StoreUnavailable("injected: the worker died before storing the history")

    try:
        a.generate(chunks[:2], "q1", conversation_id=CONV, max_tokens=3)
        monkeypatch.setattr(store_a, "put_history", lost)
        a.generate(chunks[2:4], "q2", conversation_id=CONV, max_tokens=3)  # committed only
        monkeypatch.undo()
        # Within the grace period the ids may still arrive: the turn is refused (retryable).
        with pytest.raises(RuntimeError, match="not in this worker's history"):
            b.generate([chunks[2], chunks[4]], "q3", conversation_id=CONV, max_tokens=3)
        monkeypatch.setattr(histories_module, "LOST_HISTORY_GRACE_S", 0.0, raising=False)
        r3 = b.generate([chunks[2], chunks[4]], "q3", conversation_id=CONV, max_tokens=3)
        assert r3.report.turn == 3
        # Turns 1-2 were dropped on every worker: chunk 2 is sent again, not deduplicated.
        assert chunks[2].key in r3.report.chunk_order
        r4 = a.generate([chunks[4], chunks[5]], "q4", conversation_id=CONV, max_tokens=3)
        assert r4.report.turn == 4 and r4.report.removed_duplicates == (chunks[4].key,)
        head = r3.prompt_token_ids + r3.token_ids  # A continues B's prompt token for token
        assert r4.prompt_token_ids[: len(head)] == head
    finally:
        for x in (a, b):
            x.close()
