"""Turn layout on the real in-process vLLM engine (session fixture ``craft_engine``): a
restarted turn's prompt is the compacted history plus all of its chunks, vLLM computes what the
layout predicted, and the next turn reuses the restarted prompt.
Run alone with ``pytest -m engine``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.engine import APPEND_ONLY, DEFAULT_TURN_LAYOUT, CraftEngine, TurnLayoutPolicy
from craft_rag.planner import CraftPlanner, PlannerConfig

pytestmark = pytest.mark.engine

FILLER = [
    make_chunk(
        f"Report {i}: the river valley district {i} keeps records of rainfall, harvests, "
        f"market prices and road repairs for the year {1900 + i}, with tables by month.",
        id=f"filler-{i}",
    )
    for i in range(6)
]
PARIS = make_chunk("Paris is the capital and largest city of France.", id="paris")


def count(hay: tuple[int, ...], needle: tuple[int, ...] | list[int]) -> int:
    """How many times ``needle`` occurs in ``hay`` (token ids)."""
    n = len(needle)
    return sum(1 for i in range(len(hay) - n + 1) if list(hay[i: i + n]) == list(needle))


@pytest.fixture
def engine(craft_engine: CraftEngine) -> Iterator[CraftEngine]:
    craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    assert craft_engine.reset_prefix_cache()
    saved = craft_engine.conversations.turn_layout
    yield craft_engine
    craft_engine.conversations.turn_layout = saved


def test_restart_on_vllm_compacts_predicts_and_is_reused_next_turn(engine: CraftEngine) -> None:
    cid = "layout-vllm-1"
    engine.conversations.turn_layout = TurnLayoutPolicy(mode="always_restart")
    first = engine.generate(FILLER[:3], "Which district keeps tables?", conversation_id=cid,
                            max_tokens=8)
    assert first.report.layout is None
    second = engine.generate([FILLER[1], PARIS], "What is the capital of France?",
                             conversation_id=cid, max_tokens=12)
    layout = second.report.layout
    assert layout is not None and layout.restart and layout.compacted_turns == 1
    assert second.text.strip()
    a, ids = engine.conversations.chat_assembler, second.prompt_token_ids  # conversation format
    assert count(ids, a.question_ids("Which district keeps tables?")) == 1  # turn 1's question
    reply = [t for t in first.token_ids if t not in engine._backend.eos_token_ids]
    assert count(ids, reply) == 1  # and its answer stay
    assert count(ids, a.chunk_ids(FILLER[0])) == count(ids, a.chunk_ids(FILLER[2])) == 0
    assert count(ids, a.chunk_ids(FILLER[1])) == 1  # re-sent once: this turn retrieved it
    # vLLM computed what the layout predicted (whole blocks; the last token is recomputed).
    assert abs(second.report.uncached_tokens - layout.restart_new) <= engine.block_size
    # The next turn appends to the restarted prompt and reuses it.
    engine.conversations.turn_layout = APPEND_ONLY
    third = engine.generate([PARIS, FILLER[4]], "And its largest city?", conversation_id=cid,
                            max_tokens=8)
    assert third.report.removed_duplicates == (PARIS.key,)
    reused = len(second.prompt_token_ids) + len(second.token_ids) - engine.block_size - 1
    assert third.report.cached_tokens >= reused
    assert engine.end_conversation(cid)


def test_default_layout_predicts_what_vllm_computes_for_both_layouts(engine: CraftEngine) -> None:
    """Whatever the default picks, its token predictions match the engine's counts."""
    engine.conversations.turn_layout = DEFAULT_TURN_LAYOUT
    cid = "layout-vllm-2"
    engine.generate(FILLER[:4], "Summarise the reports.", conversation_id=cid, max_tokens=8)
    r = engine.generate([*FILLER[2:], PARIS], "What is the capital of France?",
                        conversation_id=cid, max_tokens=8)
    layout = r.report.layout
    assert layout is not None
    predicted = layout.restart_new if layout.restart else layout.append_new
    assert abs(r.report.uncached_tokens - predicted) <= engine.block_size
    assert engine.end_conversation(cid)
