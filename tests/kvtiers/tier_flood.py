"""The planner-sees-the-tiers scenario's shared steps: chunks of repeated topic sentences and a
flood of other prompts that fills a small vLLM pool until it evicts a kept chunk-prefix. Used in
process (test_planner_tiers_vllm.py) and over HTTP (test_connector_server.py); this folder is on
``sys.path`` under pytest's default import mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from craft_rag.chunk import Chunk
    from craft_rag.engine import CraftEngine
    from craft_rag.types import BlockHash, ChunkKey

TOPICS = [
    "The Loire river flows west through the valley past many old castles and vineyards.",
    "Marie Curie won two Nobel prizes, one in physics and one in chemistry, in Paris.",
    "The bridge was built in 1889 from iron and steel and carried the railway north.",
    "Honeybees communicate the direction of flowers with a waggle dance inside the hive.",
    "The observatory sits on a mountain above the clouds, far from the city lights.",
    "Basalt columns form when thick lava flows cool slowly and crack into hexagons.",
]


def make_chunks(n: int, repeat: int, prefix: str) -> list[Chunk]:
    """``n`` chunks ``{prefix}-{i}``, each one topic sentence said ``repeat`` times."""
    from craft_rag.chunk import make_chunk

    return [
        make_chunk(f"[{prefix} {i}] " + " ".join([TOPICS[i % len(TOPICS)]] * repeat),
                   id=f"{prefix}-{i}")
        for i in range(n)
    ]


def flood_until_evicted(
    engine: CraftEngine, keys: tuple[ChunkKey, ...], *, timeout: float = 5.0, rounds: int = 6
) -> tuple[set[BlockHash], bool]:
    """Generate flood prompts (6 chunks each, at most ``rounds``) until the engine's KV event
    subscriber has seen the GPU pool remove a block of ``keys``' CP-Tree path. Returns those
    blocks' hashes (read before the flood; empty if the path has none) and whether the removal
    was seen within ``timeout`` seconds after the last round. Side effects: ``rounds`` or fewer
    one-token generations on ``engine``; its KV event subscription must be on."""
    from craft_rag.engine.kv_events import BlocksRemoved

    sync, tree = engine.kv_events, engine.planner.prefix_tree
    assert sync is not None, "no KV event subscription"
    hashes = {h for node in tree.match(keys).nodes for h in node.block_hashes}

    def pool_dropped(events: list[Any]) -> bool:
        return any(
            isinstance(e, BlocksRemoved) and e.medium == "GPU" and hashes & set(e.hashes)
            for e in events
        )

    for round_ in range(rounds):
        flood = make_chunks(6, repeat=4, prefix=f"flood{round_}")
        engine.generate(flood, f"Flood question {round_}?", max_tokens=1)
        if pool_dropped(sync.recent_events()):
            break
    return hashes, sync.wait_for(pool_dropped, timeout=timeout)
