"""Offline trace replay, a package above the engine: it runs the engine's own RAG-turn code
(:mod:`craft_rag.engine.rag_turn`) around a simulated prefix cache, so a replayed turn and a
served one cannot drift apart. :mod:`.run` holds :func:`replay` and its results; the
``craft-rag replay`` command is :mod:`craft_rag.cli.replay`.
"""

from craft_rag.replay.run import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CACHE_TOKENS,
    ReplayResult,
    ServedRequest,
    percentile,
    replay,
    reused_chunk_count,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_TOKENS",
    "ReplayResult",
    "ServedRequest",
    "percentile",
    "replay",
    "reused_chunk_count",
]
