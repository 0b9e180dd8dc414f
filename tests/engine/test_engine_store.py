"""CraftEngine(store=...): the engine's planners share state through a store, one namespace per
cache salt (tenants share nothing). Fake backend; the stores are real (SQLite file, memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.planner import CraftPlanner
from craft_rag.stores import StateStore, namespace_for_salt, open_store
from craft_rag.testing import make_chunks, make_fake_engine


def make_engine(store: StateStore | str, **kwargs: Any) -> CraftEngine:
    return make_fake_engine(store=store, **kwargs)[0]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_two_engines_share_planner_state_per_salt(kind: str, tmp_path: Path) -> None:
    url = "memory://" if kind == "memory" else f"sqlite://{tmp_path / 'state.db'}"
    store_a = open_store(url)
    store_b = store_a if kind == "memory" else open_store(url)
    a, b = make_engine(store_a), make_engine(store_b)
    try:
        chunks = make_chunks(4)
        a.generate(chunks, "what?", cache_salt="tenant-1", max_tokens=2)
        a.generate(chunks[:2], "and?", max_tokens=2)
        tenant = b.planner_for("tenant-1")
        assert isinstance(tenant, CraftPlanner)
        tenant.sync()
        assert tenant.access_table.count(chunks[3].key) == 1
        assert tenant.store is not None
        position = tenant.shared_position()
        assert position is not None and position.namespace == namespace_for_salt("tenant-1")
        # The default namespace saw only the unsalted request; another tenant saw nothing.
        default = b.planner
        assert isinstance(default, CraftPlanner)
        default.sync()
        assert default.access_table.count(chunks[3].key) == 0
        assert default.access_table.count(chunks[0].key) == 1
        other = b.planner_for("tenant-2")
        assert isinstance(other, CraftPlanner)
        assert len(other.access_table) == 0
        # Engine B's commit reaches engine A's planner of that salt.
        b.generate(chunks, "again?", cache_salt="tenant-1", max_tokens=2)
        mine = a.planner_for("tenant-1")
        assert isinstance(mine, CraftPlanner)
        mine.sync()
        assert mine.access_table.count(chunks[3].key) == 2
    finally:
        a.close()
        b.close()


def test_store_with_a_planner_is_refused() -> None:
    with pytest.raises(ValueError, match="store: pass either store="):
        make_engine("memory://", planner=CraftPlanner())
