"""A commit whose store call fails without a clear answer is recorded once or not at all, and
the conversation stays usable either way (real redis-server behind a delaying proxy, real
SQLite files held locked by another connection)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from delay_proxy import DelayProxy

from craft_rag import Chunk, CraftPlanner, PlannerConfig, make_chunk
from craft_rag.stores import StateStore, StoreUnavailable
from craft_rag.stores.base import CommitVoided, LogEntry
from craft_rag.stores.histories import load_history, save_history
from craft_rag.stores.sqlite_store import SQLiteStore

CONFIG = PlannerConfig(policy="tree", window=20, max_tree_nodes=40, max_conversations=8)
COMMIT = b'"v":"c"'  # a commit entry's kind (end and forget entries are "e", "f")


def chunks(*ids: int) -> list[Chunk]:
    return [make_chunk(f"passage {i}", id=f"doc-{i}", num_tokens=5 + i) for i in ids]


def turn_ids(turn: int) -> list[int]:
    return [100 * turn + i for i in range(7)]


def commits_of(store: StateStore, conversation: str) -> list[int]:
    """The turns of ``conversation`` the log holds, in log order."""
    turns = []
    for entry in store.read("default", 0).entries:
        data = json.loads(entry.data)
        if data["v"] == "c" and data["c"] == conversation:
            turns.append(data["t"])
    return turns


@pytest.fixture
def proxy(redis_url: str) -> Iterator[tuple[DelayProxy, str]]:
    """A delaying proxy in front of the test Redis, and the store URL through it."""
    parts = urlsplit(redis_url)
    proxy = DelayProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    yield proxy, f"redis://127.0.0.1:{proxy.port}{parts.path}?timeout_ms=800"
    proxy.close()


def _serve(planner: CraftPlanner, ids: tuple[int, ...], turn: int) -> Any:
    plan = planner.plan(chunks(*ids), "chat")
    assert plan.turn == turn
    return plan


def _check_usable(slow: CraftPlanner, other: CraftPlanner, turns: int) -> None:
    """Both workers know every live turn's token ids (the engine renders from them) and serve
    the next turn."""
    save_history(slow, "chat")
    load_history(other, "chat")
    for planner in (slow, other):
        planner.sync()
        history = planner.conversations.history("chat")  # type: ignore[arg-type]
        assert history is not None and history.turn_count == turns
        assert None not in history.turns, "a turn's token ids are unknown: render refuses"
        assert list(history.turns[-1] or ()) == turn_ids(turns)
    plan = other.plan(chunks(8, 9), "chat")
    assert plan.turn == turns + 1
    other.commit(plan, turn_tokens=turn_ids(turns + 1))
    slow.sync()
    assert slow.committed_turns("chat") == turns + 1


def test_a_commit_answered_after_the_timeout_is_done_not_lost(
    proxy: tuple[DelayProxy, str], redis_url: str
) -> None:
    delays, url = proxy
    slow = CraftPlanner(CONFIG, store=url)
    other = CraftPlanner(CONFIG, store=redis_url)
    slow.commit(_serve(slow, (1, 2), 1), turn_tokens=turn_ids(1))
    plan = _serve(slow, (2, 3, 4), 2)
    delays.delay_reply_to(COMMIT, 2.0)  # Redis writes it at once, answers after 2 s
    result = slow.commit(plan, turn_tokens=turn_ids(2))  # settled: it was written
    assert delays.delayed == 1
    assert result.turn == 2 and not slow.is_pending(plan)
    assert commits_of(slow.store, "chat") == [1, 2]  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="already committed"):
        slow.commit(plan)
    _check_usable(slow, other, 2)


def test_a_commit_request_delayed_past_the_timeout_is_voided_and_can_be_retried(
    proxy: tuple[DelayProxy, str], redis_url: str
) -> None:
    delays, url = proxy
    slow = CraftPlanner(CONFIG, store=url)
    other = CraftPlanner(CONFIG, store=redis_url)
    slow.commit(_serve(slow, (1, 2), 1), turn_tokens=turn_ids(1))
    plan = _serve(slow, (2, 3, 4), 2)
    delays.delay_request(COMMIT, 2.0)  # reaches Redis after the client gave up
    with pytest.raises(StoreUnavailable, match=r"was not written.*still pending"):
        slow.commit(plan, turn_tokens=turn_ids(2))
    assert slow.is_pending(plan)
    time.sleep(2.5)  # the held request lands now, and is refused: its token is void
    assert commits_of(slow.store, "chat") == [1]  # type: ignore[arg-type]
    assert slow.commit(plan, turn_tokens=turn_ids(2)).turn == 2
    assert commits_of(slow.store, "chat") == [1, 2]  # type: ignore[arg-type]
    _check_usable(slow, other, 2)


def test_redis_settle_primitive_finds_or_voids(redis_url: str) -> None:
    from craft_rag.stores import open_store

    store = open_store(redis_url)
    store.attach("default", "fp")
    store.append("default", '"a"', since=0, token="t-1")
    assert store.settle("default", "t-1") == 1
    assert store.settle("default", "t-2") == 0
    with pytest.raises(CommitVoided):
        store.append("default", '"b"', since=1, token="t-2")
    assert store.read("default", 0).head == 1
    store.close()


# ---- SQLite -------------------------------------------------------------------------------


def test_sqlite_commit_refused_by_a_lock_leaves_the_plan_committable(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    url = f"sqlite://{path}?busy_timeout_ms=150"
    slow = CraftPlanner(CONFIG, store=url)
    other = CraftPlanner(CONFIG, store=url)
    slow.commit(_serve(slow, (1, 2), 1), turn_tokens=turn_ids(1))
    plan = _serve(slow, (2, 3, 4), 2)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process mid-transaction, past the timeout
    try:
        with pytest.raises(StoreUnavailable, match="still pending"):
            slow.commit(plan, turn_tokens=turn_ids(2))
        assert slow.is_pending(plan)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert slow.commit(plan, turn_tokens=turn_ids(2)).turn == 2  # not "already committed"
    assert commits_of(slow.store, "chat") == [1, 2]  # type: ignore[arg-type]
    _check_usable(slow, other, 2)


class _LostReply(SQLiteStore):
    """A real SQLite store whose next append is written but answered with an error (the reply
    lost on its way back), or fails before writing."""

    lose_reply = False
    fail_before = False

    def _append(self, *args: Any, **kwargs: Any) -> tuple[int, list[LogEntry]]:
        if self.fail_before:
            self.fail_before = False
            raise StoreUnavailable("injected: failed before writing")
        out = super()._append(*args, **kwargs)
        if self.lose_reply:
            self.lose_reply = False
            raise StoreUnavailable("injected: reply lost")
        return out


class _Mute(_LostReply):
    """... whose next ``mute_settle`` settles get no answer either."""

    mute_settle = 0

    def settle(self, namespace: str, token: str) -> int:
        if self.mute_settle:
            self.mute_settle -= 1
            raise StoreUnavailable("injected: no answer")
        return super().settle(namespace, token)


def test_sqlite_commit_written_but_unanswered_is_settled_as_done(tmp_path: Path) -> None:
    store = _LostReply(tmp_path / "state.db")
    slow = CraftPlanner(CONFIG, store=store)
    other = CraftPlanner(CONFIG, store=f"sqlite://{tmp_path / 'state.db'}")
    slow.commit(_serve(slow, (1, 2), 1), turn_tokens=turn_ids(1))
    store.lose_reply = True
    assert slow.commit(_serve(slow, (2, 3, 4), 2), turn_tokens=turn_ids(2)).turn == 2
    assert commits_of(store, "chat") == [1, 2]
    _check_usable(slow, other, 2)


def test_settle_that_gets_no_answer_keeps_the_plan_and_settles_on_retry(tmp_path: Path) -> None:
    """The store fails the append (written) AND the settle: the caller hears the outcome is
    unknown, the plan stays pending, a pull in between keeps the turn's token ids, and the
    retry returns the recorded result without writing twice."""

    store = _Mute(tmp_path / "state.db")
    slow = CraftPlanner(CONFIG, store=store)
    slow.commit(_serve(slow, (1, 2), 1), turn_tokens=turn_ids(1))
    plan = _serve(slow, (2, 3), 2)
    store.lose_reply, store.mute_settle = True, 2
    with pytest.raises(StoreUnavailable, match="did not answer"):
        slow.commit(plan, turn_tokens=turn_ids(2))
    assert slow.is_pending(plan)
    slow.sync()  # meets the entry: this worker's own turn, token ids kept
    history = slow.conversations.history("chat")  # type: ignore[arg-type]
    assert history is not None and list(history.turns[-1] or ()) == turn_ids(2)
    assert slow.commit(plan).turn == 2
    assert commits_of(store, "chat") == [1, 2]


def test_abort_of_an_unsettled_commit_voids_it(tmp_path: Path) -> None:
    store = _LostReply(tmp_path / "state.db")
    slow = CraftPlanner(CONFIG, store=store)
    plan = _serve(slow, (1, 2), 1)
    store.fail_before = True
    with pytest.raises(StoreUnavailable, match="not written"):
        slow.commit(plan, turn_tokens=turn_ids(1))
    assert slow.abort(plan) is True
    assert commits_of(store, "chat") == []
    again = _serve(slow, (1, 2), 1)  # the conversation is free again
    slow.commit(again, turn_tokens=turn_ids(1))
    assert commits_of(store, "chat") == [1]


def test_abort_after_an_unanswered_commit_settles_it(tmp_path: Path) -> None:
    """The engine aborts a turn whose commit raised: written after all -> abort says so
    (False) and the turn is recorded with its token ids; not written -> voided, True."""

    store = _Mute(tmp_path / "state.db")
    slow = CraftPlanner(CONFIG, store=store)
    plan = _serve(slow, (1, 2), 1)
    store.lose_reply, store.mute_settle = True, 2
    with pytest.raises(StoreUnavailable, match="did not answer"):
        slow.commit(plan, turn_tokens=turn_ids(1))
    assert slow.abort(plan) is False  # it was written: the turn stands
    history = slow.conversations.history("chat")  # type: ignore[arg-type]
    assert history is not None and list(history.turns[-1] or ()) == turn_ids(1)
    plan = _serve(slow, (3, 4), 2)
    store.fail_before, store.mute_settle = True, 2
    with pytest.raises(StoreUnavailable, match="did not answer"):
        slow.commit(plan, turn_tokens=turn_ids(2))
    assert slow.abort(plan) is True  # never written: voided, the conversation is free
    assert commits_of(store, "chat") == [1]
    assert _serve(slow, (3, 4), 2).turn == 2


def test_engine_turn_answered_late_by_redis_keeps_its_reply_and_the_conversation(
    proxy: tuple[DelayProxy, str], redis_url: str
) -> None:
    """The engine's turn whose commit Redis answers after timeout_ms returns its reply, and
    the next turns go on, on this worker and on another."""
    from craft_rag.engine.chat_format import jinja_renderer
    from craft_rag.engine.engine import CraftEngine
    from craft_rag.stores import open_store
    from craft_rag.testing import CHATML, FAKE_FORMAT, FakeBackend, make_chunks
    from craft_rag.tokenizer import HashingTokenizer

    def engine(url: str) -> CraftEngine:
        backend = FakeBackend(max_model_len=1024)
        return CraftEngine(
            backend=backend, tokenizer=HashingTokenizer(), prompt_format=FAKE_FORMAT,
            block_hasher=backend.hasher, chat_renderer=jinja_renderer(CHATML),
            store=open_store(url),
        )

    delays, url = proxy
    a, b = engine(url), engine(redis_url)
    docs = make_chunks(6, words=12)
    try:
        a.generate(docs[:2], "q1", conversation_id="chat", max_tokens=3)
        delays.delay_reply_to(COMMIT, 2.0)
        r2 = a.generate(docs[2:4], "q2", conversation_id="chat", max_tokens=3)
        assert delays.delayed == 1 and r2.report.turn == 2 and r2.token_ids
        r3 = b.generate([docs[3], docs[4]], "q3", conversation_id="chat", max_tokens=3)
        assert r3.report.turn == 3 and r3.report.removed_duplicates == (docs[3].key,)
        head = r2.prompt_token_ids + r2.token_ids
        assert r3.prompt_token_ids[: len(head)] == head
        r4 = a.generate([docs[5]], "q4", conversation_id="chat", max_tokens=3)
        assert r4.report.turn == 4
    finally:
        a.close()
        b.close()
