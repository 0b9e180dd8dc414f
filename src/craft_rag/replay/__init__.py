"""Offline trace replay, a package above the engine: it runs the engine's own RAG-turn code
(:mod:`craft_rag.engine.rag_turn`) around a simulated prefix cache, so a replayed turn and a
served one cannot drift apart. :mod:`.run` holds :func:`replay` and its results (its
``__all__`` is this package's); the ``craft-rag replay`` command is :mod:`craft_rag.cli.replay`.
"""

from craft_rag.replay.run import *  # noqa: F403
from craft_rag.replay.run import __all__ as __all__
