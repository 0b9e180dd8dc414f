"""Request scheduling ahead of the engine: cache-aware admission (:mod:`.admission`).

The public names are each module's ``__all__`` (listed once, there)."""

from craft_rag.scheduling import admission
from craft_rag.scheduling.admission import *  # noqa: F403

__all__: list[str] = []
__all__ += admission.__all__
