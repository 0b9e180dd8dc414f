"""A planner state saved by the code before the tree/planner packages (commit f1e0a95, fixture
written by tests/fixtures/make_planner_state_f1e0a95.py) still loads, unchanged and usable."""

from __future__ import annotations

import json
from pathlib import Path

from craft_rag import CraftPlanner
from craft_rag.chunk import make_chunk
from craft_rag.types import ChunkKey

FIXTURE = Path(__file__).parent / "fixtures" / "planner_state_f1e0a95.json"


def test_state_saved_at_f1e0a95_loads_and_round_trips() -> None:
    planner = CraftPlanner.load(FIXTURE, clock=lambda: 2000.0)
    planner._check_invariants()
    # The codec is unchanged: the loaded state writes back the very JSON it was read from.
    assert planner.to_json() == json.loads(FIXTURE.read_text())
    assert len(planner.prefix_tree) == 8
    assert planner.access_table.count(ChunkKey("A")) == 7
    assert planner.committed_turns("conv-1") == 2
    assert planner.committed_turns("conv-2") == 1


def test_state_saved_at_f1e0a95_plans_from_its_tree() -> None:
    planner = CraftPlanner.load(FIXTURE, clock=lambda: 2000.0)
    chunks = [make_chunk(f"text of {n}", id=n, num_tokens=17) for n in ("C", "B", "A")]
    plan = planner.plan(chunks)
    assert plan.keys == ("A", "B", "C")
    assert (plan.matched_chunks, plan.matched_tokens) == (3, 58)
    # conv-1 already holds A, B, C, F, G, H: only the new chunk is sent.
    turn = planner.plan([make_chunk("text of A", id="A"), make_chunk("z", id="Z")], "conv-1")
    assert [c.key for c in turn.ordered] == ["Z"] and turn.turn == 3
