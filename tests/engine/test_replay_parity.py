"""Replay and the engine run the same RAG-turn code (issue 12 item 4): on one small trace, with
the embedded model's real tokenizer and chat format, every turn gets the same prompt, the same
cached tokens and the same reused-chunk count from ``CraftEngine`` (over the fake backend's
prefix cache) as from ``replay`` (over the simulated prefix cache)."""

from __future__ import annotations

from pathlib import Path

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.engine import CraftEngine
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.replay import ServedRequest, replay
from craft_rag.testing import FakeBackend
from craft_rag.tokenizer import HFTokenizer
from craft_rag.trace import TraceRequest
from craft_rag.types import ConversationId

BLOCK = 16
TEXTS = {
    "harbour": "The harbour opened in 1871 and handles grain, timber and container ships.",
    "bridge": "A steel bridge crosses the river north of the harbour; it opened in 1932.",
    "market": "The covered market sells fish every morning except on public holidays.",
    "museum": "The maritime museum shows ship models, charts and a lighthouse lens.",
    "ferry": "Ferries leave the east pier every forty minutes for the two islands.",
}


def chunks(*names: str) -> tuple[Chunk, ...]:
    return tuple(make_chunk(TEXTS[n], id=n) for n in names)


CHAT = ConversationId("chat")
TRACE = [
    TraceRequest("r1", "When did the harbour open?", chunks("harbour", "bridge", "market")),
    TraceRequest("r2", "What does the market sell?", chunks("market", "harbour", "bridge")),
    TraceRequest("c1", "Tell me about the museum.", chunks("museum", "ferry"), CHAT, 1),
    TraceRequest("c2", "And the ferries?", chunks("ferry", "harbour"), CHAT, 2),
    TraceRequest("r3", "Which bridge is it?", chunks("bridge", "harbour", "market")),
    TraceRequest("c3", "How often do they leave?", chunks("ferry", "museum", "bridge"), CHAT, 3),
]


def test_engine_and_replay_report_the_same_reuse_per_turn(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    prompt_format = derive_chat_format(model_dir)
    # One generated token, the eos, which the engine strips: the stored reply is just the
    # answer close, as replay stores for a trace turn without an answer.
    backend = FakeBackend(max_model_len=4096, block_size=BLOCK, reply=(2,))
    engine = CraftEngine(
        planner=CraftPlanner(PlannerConfig(policy="tree")),
        backend=backend,
        tokenizer=tokenizer,
        prompt_format=prompt_format,
        block_hasher=backend.block_hasher,
        history_budget=None,
    )
    try:
        served = [
            engine.generate(
                list(r.chunks), r.query, conversation_id=r.conversation_id, max_tokens=1
            ).report
            for r in TRACE
        ]
        prompts = [ids for _, ids, _ in backend.added]
    finally:
        engine.close()
    replayed: list[ServedRequest] = []
    result = replay(
        TRACE,
        PlannerConfig(policy="tree"),
        tokenizer,
        prompt_format=prompt_format,
        block_size=BLOCK,
        max_model_len=4096,
        max_tokens=1,
        on_served=replayed.append,
    )
    assert [s.prompt.token_ids for s in replayed] == prompts
    assert [s.cached_tokens for s in replayed] == [r.cached_tokens for r in served]
    assert [s.reused_chunks for s in replayed] == [r.reused_chunks for r in served]
    assert [s.removed_by_dedup for s in replayed] == [len(r.removed_duplicates) for r in served]
    # The trace exercises reuse and dedup, so the equalities above are not all zeros.
    assert sum(r.reused_chunks for r in served) > 0
    assert sum(len(r.removed_duplicates) for r in served) > 0
    assert result.chunks_reused == sum(r.reused_chunks for r in served)
