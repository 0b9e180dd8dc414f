"""Against the real in-process vLLM engine (session fixture ``craft_engine``, see conftest.py):
128 blocks of 32 tokens, max_model_len 2048, KV events on. Run alone: ``pytest -m engine``.

Every test starts from a fresh planner and an empty prefix cache (``fresh``), keeps
``max_tokens`` tiny (decode is ~0.1 s/token here) and chunks short.
"""

from __future__ import annotations

import asyncio
import importlib
import random
from collections.abc import Iterator
from typing import Any

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine.cpu_dtype import default_dtype
from craft_rag.engine.engine import CraftEngine, EngineFailure, EngineSettings
from craft_rag.engine.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEventSync
from craft_rag.planner import CraftPlanner, PlannerConfig

pytestmark = pytest.mark.engine

TOPICS = [
    "The Loire river flows west through the valley past many old castles and vineyards.",
    "Marie Curie won two Nobel prizes, one in physics and one in chemistry, in Paris.",
    "The bridge was built in 1889 from iron and steel and carried the railway north.",
    "Honeybees communicate the direction of flowers with a waggle dance inside the hive.",
    "The observatory sits on a mountain above the clouds, far from the city lights.",
    "Basalt columns form when thick lava flows cool slowly and crack into hexagons.",
]


def make_chunks(n: int = 5, *, repeat: int = 3, prefix: str = "doc") -> list[Chunk]:
    """Short distinct chunks (~50-70 tokens each with repeat=3)."""
    return [
        make_chunk(
            f"[{prefix} {i}] " + " ".join([TOPICS[i % len(TOPICS)]] * repeat), id=f"{prefix}-{i}"
        )
        for i in range(n)
    ]


def events(engine: CraftEngine) -> KVEventSync:
    assert engine.kv_events is not None
    return engine.kv_events


@pytest.fixture
def fresh(craft_engine: CraftEngine) -> Iterator[CraftEngine]:
    """The shared engine with a new tree-policy planner and an empty prefix cache."""
    craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    assert craft_engine.reset_prefix_cache()
    events(craft_engine).clear_recent()
    yield craft_engine


def tree(engine: CraftEngine) -> Any:
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    return planner.prefix_tree


def test_grounded_greedy_answer_is_chat_correct(fresh: CraftEngine) -> None:
    chunks = [make_chunk("Paris is the capital and largest city of France.", id="paris")]
    result = fresh.generate(chunks, "What is the capital of France?", max_tokens=12)
    assert "Paris" in result.text
    assert result.report.prompt_tokens == len(result.prompt_token_ids)


def test_expected_block_hashes_equal_blockstored_events(fresh: CraftEngine) -> None:
    hasher = fresh.block_hasher
    assert hasher is not None
    kv_cache_utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")
    hashing: Any = importlib.import_module("vllm.utils.hashing")
    # Our NONE_HASH and chaining are vLLM's own.
    assert hasher.none_hash == bytes(kv_cache_utils.NONE_HASH)
    sample = [random.Random(0).randrange(49152) for _ in range(100)]
    parent = None
    for j, raw in enumerate(hasher.raw_hashes(sample)):
        parent = kv_cache_utils.hash_block_tokens(
            hashing.sha256, parent, sample[j * 32 : (j + 1) * 32]
        )
        assert raw == bytes(parent)

    result = fresh.generate(make_chunks(4), "Which river flows west?", max_tokens=1)
    expected = hasher.block_hashes(result.prompt_token_ids)
    assert len(expected) == len(result.prompt_token_ids) // 32 >= 6

    def stored(evs: list[Any]) -> list[Any]:
        return [h for e in evs if isinstance(e, BlocksStored) for h in e.hashes]

    assert events(fresh).wait_for(lambda evs: len(stored(evs)) >= len(expected))
    reported = [e for e in events(fresh).recent_events() if isinstance(e, BlocksStored)]
    assert stored(reported)[: len(expected)] == expected
    assert reported[0].parent is None
    assert reported[0].token_ids == ()  # the recent log keeps hashes (they imply the ids)


def test_craft_order_reuses_the_whole_chunk_prefix_retriever_order_does_not(
    craft_engine: CraftEngine,
) -> None:
    chunks = make_chunks(5)
    retriever_orders = [chunks, [chunks[i] for i in (3, 0, 4, 2, 1)]]
    reports = {}
    for policy in ("tree", "retriever"):
        craft_engine.set_planner(CraftPlanner(PlannerConfig(policy=policy)))
        assert craft_engine.reset_prefix_cache()
        first = craft_engine.generate(retriever_orders[0], "Who won two prizes?", max_tokens=1)
        second = craft_engine.generate(retriever_orders[1], "Where are castles?", max_tokens=1)
        reports[policy] = (first.report, second.report)

    (cold, craft) = reports["tree"]
    (_, retriever) = reports["retriever"]
    assert cold.cached_tokens == 0
    assert craft.chunk_order == cold.chunk_order  # CRAFT kept the cached order
    assert craft.predicted_chunks == 5
    # Reused = every token inside the cached prefix: chunk 5's tail shares a block with the
    # (different) question, so it counts only if it ends on a cached block boundary.
    assert craft.predicted_tokens is not None
    assert craft.reused_chunks == (5 if craft.predicted_tokens <= craft.cached_tokens else 4)
    # All full blocks up to the question were hits.
    assert craft.cached_tokens >= craft.prompt_tokens - 2 * 32
    # Retriever order: only the constant head's full blocks match.
    assert retriever.chunk_order == tuple(c.key for c in retriever_orders[1])
    assert retriever.reused_chunks == 0
    assert retriever.cached_tokens == retriever.prefix_tokens // 32 * 32
    # On this CPU, TTFT follows the uncached tokens.
    assert craft.ttft_ms < cold.ttft_ms


def test_second_turn_reuses_the_first_turns_tokens(fresh: CraftEngine) -> None:
    chunks = make_chunks(4)
    first = fresh.generate(chunks[:3], "Who won prizes?", conversation_id="t2", max_tokens=4)
    second = fresh.generate(chunks[1:], "Where?", conversation_id="t2", max_tokens=2)
    assert second.report.turn == 2
    assert set(second.report.removed_duplicates) == {chunks[1].key, chunks[2].key}
    assert second.report.chunk_order == (chunks[3].key,)
    assert second.prompt_token_ids[: first.report.prompt_tokens] == first.prompt_token_ids
    # At least every full block of turn 1's prompt is reused.
    assert second.report.cached_tokens >= first.report.prompt_tokens // 32 * 32


def test_kv_event_eviction_removes_cp_tree_nodes(fresh: CraftEngine) -> None:
    chunks = make_chunks(4, prefix="keep")
    fresh.generate(chunks, "Which?", max_tokens=1)
    assert len(tree(fresh)) == 4
    nodes_removed_before = events(fresh).stats.nodes_removed

    # Flood the small test cache (TEST_ENGINE_BLOCKS blocks of 32) with unrelated prompts
    # (~45 blocks each) until vLLM evicts: the first request's chunk blocks are the least
    # recently used, so they go first.
    def removed(evs: list[Any]) -> bool:
        return sum(len(e.hashes) for e in evs if isinstance(e, BlocksRemoved)) > 0

    for round_ in range(12):
        flood = make_chunks(6, repeat=12, prefix=f"flood{round_}")
        fresh.generate(flood, f"Flood question {round_}?", max_tokens=1)
        if removed(events(fresh).recent_events()):  # applied before the commit returned
            break
    assert events(fresh).wait_for(removed)
    assert events(fresh).stats.nodes_removed > nodes_removed_before
    # The flood's own paths may be in the tree, the first request's path is not (whole or
    # partly evicted), and the engine agrees: nothing of it is cached any more.
    keep_keys = tuple(c.key for c in chunks)
    assert keep_keys not in tree(fresh).iter_paths()
    again = fresh.generate(chunks, "Which?", max_tokens=1)
    assert again.report.reused_chunks < 4


def test_reset_prefix_cache_empties_the_tree_and_publishes_a_clear(fresh: CraftEngine) -> None:
    chunks = make_chunks(3)
    fresh.generate(chunks, "Q?", max_tokens=1)
    assert len(tree(fresh)) > 0
    assert fresh.reset_prefix_cache()
    assert len(tree(fresh)) == 0
    after = fresh.generate(chunks, "Q?", max_tokens=1)
    assert after.report.cached_tokens == 0
    assert any(isinstance(e, AllCleared) for e in events(fresh).recent_events())
    assert len(tree(fresh)) == 3  # the clear landed before this commit, not after it


def test_no_cache_baseline_on_the_same_engine(fresh: CraftEngine) -> None:
    chunks = make_chunks(3)
    fresh.generate(chunks, "Q?", max_tokens=1)
    warm = fresh.generate(chunks, "Q?", max_tokens=1)
    cold = fresh.generate(chunks, "Q?", max_tokens=1, read_prefix_cache=False)
    assert warm.report.cached_tokens > 0
    assert cold.report.cached_tokens == 0 and not cold.report.read_prefix_cache


def test_streaming_yields_tokens_and_a_ttft(fresh: CraftEngine) -> None:
    chunks = make_chunks(2)
    pieces = list(fresh.stream(chunks, "What do bees do?", max_tokens=3))
    deltas = [p for p in pieces if not p.finished]
    final = pieces[-1].result
    assert final is not None and deltas
    assert sum(len(p.token_ids) for p in deltas) == len(final.token_ids) == 3
    assert "".join(p.text for p in deltas) == final.text
    assert deltas[0].elapsed_ms == pytest.approx(final.report.ttft_ms)
    assert 0 < final.report.ttft_ms <= final.report.latency_ms

    async def consume() -> list[Any]:
        return [p async for p in fresh.astream(chunks, "What do bees do?", max_tokens=2)]

    apieces = asyncio.run(consume())
    afinal = apieces[-1].result
    assert afinal is not None and afinal.token_ids[:2] == final.token_ids[:2]  # greedy
    assert afinal.report.cached_tokens > 0


def test_overlong_prompt_is_a_clear_error(fresh: CraftEngine) -> None:
    huge = make_chunks(6, repeat=40, prefix="huge")
    with pytest.raises(ValueError, match="max_model_len 2048"):
        fresh.generate(huge, "Too much?", max_tokens=4)
    assert len(tree(fresh)) == 0


def test_engine_failure_raises_and_commits_nothing(
    fresh: CraftEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    planner = fresh.planner
    assert isinstance(planner, CraftPlanner)
    backend = fresh._backend
    real_step = backend.step

    def broken_step() -> Any:
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(backend, "step", broken_step)
    with pytest.raises(EngineFailure, match="simulated device fault"):
        fresh.generate(make_chunks(2), "Q?", conversation_id="fail", max_tokens=1)
    assert planner.stats.commits == 0
    assert len(planner.prefix_tree) == 0
    assert fresh.conversations.history_tokens("fail") == 0

    monkeypatch.setattr(backend, "step", real_step)
    ok = fresh.generate(make_chunks(2), "Q?", conversation_id="fail", max_tokens=1)
    assert ok.report.turn == 1
    assert planner.stats.commits == 1


def test_cache_salt_isolates_tenants_and_salted_hashes_match_blockstored(
    fresh: CraftEngine,
) -> None:
    hasher = fresh.block_hasher
    assert hasher is not None
    chunks = make_chunks(3, prefix="salt")
    first = fresh.generate(chunks, "Who won prizes?", max_tokens=1, cache_salt="tenant-a")
    ids = first.prompt_token_ids
    expected = hasher.block_hashes(ids, "tenant-a")
    assert not set(expected) & set(hasher.block_hashes(ids))  # the salt changes every block

    def stored(evs: list[Any]) -> list[Any]:
        return [h for e in evs if isinstance(e, BlocksStored) for h in e.hashes]

    assert events(fresh).wait_for(lambda evs: len(stored(evs)) >= len(expected))
    reported = [e for e in events(fresh).recent_events() if isinstance(e, BlocksStored)]
    assert stored(reported)[: len(expected)] == expected
    assert reported[0].extra_keys is not None and reported[0].extra_keys[0] == ("tenant-a",)

    same = fresh.generate(chunks, "Who won prizes?", max_tokens=1, cache_salt="tenant-a")
    other = fresh.generate(chunks, "Who won prizes?", max_tokens=1, cache_salt="tenant-b")
    plain = fresh.generate(chunks, "Who won prizes?", max_tokens=1)
    assert same.report.cached_tokens == (len(ids) - 1) // 32 * 32  # full reuse
    assert same.report.predicted_chunks == 3 and same.report.predicted_tokens is not None
    inside = same.report.predicted_tokens <= same.report.cached_tokens
    assert same.report.reused_chunks == (3 if inside else 2)
    assert other.prompt_token_ids == ids
    assert other.report.cached_tokens == 0 and other.report.predicted_chunks == 0
    assert plain.report.cached_tokens == 0 and plain.report.predicted_chunks == 0
    assert fresh.reset_prefix_cache()  # clears every salt's tree too
    assert all(len(p.prefix_tree) == 0 for p in fresh._namespaces.all())


def test_a_given_plan_is_served_token_exactly_and_committed_once(fresh: CraftEngine) -> None:
    planner = fresh.planner
    assert isinstance(planner, CraftPlanner)
    chunks = make_chunks(4, prefix="plan")
    plan = planner.plan([chunks[i] for i in (2, 0, 3, 1)])
    plans, commits = planner.stats.plans, planner.stats.commits
    result = fresh.generate(plan.ordered, "Where are castles?", plan=plan, max_tokens=1)
    assert (planner.stats.plans, planner.stats.commits) == (plans, commits + 1)
    assert result.report.chunk_order == plan.keys and result.report.plan_id == plan.plan_id
    segment = [i for c in plan.ordered for i in fresh.assembler.chunk_ids(c)]
    start = result.report.prefix_tokens
    assert list(result.prompt_token_ids[start : start + len(segment)]) == segment
    assert plan.keys in tree(fresh).iter_paths()
    with pytest.raises(RuntimeError, match="already committed"):
        fresh.generate(plan.ordered, "Again?", plan=plan, max_tokens=1)
    with pytest.raises(RuntimeError, match="another planner"):
        fresh.generate(chunks, "Q?", plan=CraftPlanner().plan(chunks), max_tokens=1)
    assert planner.stats.commits == commits + 1


def test_plain_chat_messages_reuse_earlier_messages(fresh: CraftEngine) -> None:
    chat = [("user", "What is the capital of France? Answer in one short sentence.")]
    first = fresh.generate_messages(chat, max_tokens=8)
    assert "Paris" in first.text
    assert first.report.chunk_order == () and first.report.plan_id is None
    longer = [*chat, ("assistant", first.text), ("user", "And the capital of Italy?")]
    second = fresh.generate_messages(longer, max_tokens=1)
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.report.cached_tokens >= len(first.prompt_token_ids) // 32 * 32 > 0
    assert len(tree(fresh)) == 0  # nothing planned or committed


def test_settings_map_onto_vllm_engine_args_and_engine_kwargs_win(tmp_path: Any) -> None:
    from craft_rag.engine.backends.vllm.backend import VLLMBackend

    backend = VLLMBackend(
        EngineSettings(
            block_size=64,
            max_model_len=1024,
            num_gpu_blocks_override=40,
            kv_events_endpoint=f"ipc://{tmp_path}/x.sock",
            engine_kwargs={"enforce_eager": False, "max_model_len": 512},
        ),
        "/some/model",
    )
    kwargs = backend.engine_kwargs
    assert kwargs["model"] == "/some/model" and kwargs["block_size"] == 64
    assert kwargs["enable_prefix_caching"] is True and kwargs["dtype"] == default_dtype()
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30 and kwargs["num_gpu_blocks_override"] == 40
    assert kwargs["enforce_eager"] is False and kwargs["max_model_len"] == 512
    assert kwargs["kv_events_config"].endpoint == f"ipc://{tmp_path}/x.sock"
    assert backend.kv_events_endpoint == f"ipc://{tmp_path}/x.sock"
    no_events = VLLMBackend(EngineSettings(prefix_caching=False), "/m")
    assert "kv_events_config" not in no_events.engine_kwargs
    assert no_events.kv_events_endpoint is None


def test_start_failure_is_one_clear_error(tmp_path: Any) -> None:
    from craft_rag.engine.backends.vllm.backend import EngineStartError, VLLMBackend

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-arch"}', encoding="utf-8")
    backend = VLLMBackend(EngineSettings(kv_events=False), str(broken))
    with pytest.raises(EngineStartError, match=r"(?s)vLLM failed to start: .* Fix: .*architecture"):
        backend.start()
