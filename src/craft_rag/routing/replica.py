"""One replica as the router sees it: its CP-Trees (one planner per cache salt) and its load.

The trees are the replica's own: they change only through that replica's planners, i.e. through
commits carrying its reuse reports and through its KV events (``on_blocks_removed``). The load
is the router's own accounting of what it sent there and has not heard back about.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NewType

from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_tree import ChunkPrefixTree
from craft_rag.types import ChunkKey, ConversationId

ReplicaId = NewType("ReplicaId", str)
"""Caller-chosen name of one serving replica (an engine or server URL's label)."""

ConversationKey = tuple[str | None, ConversationId]
"""A conversation as the router knows it: (salt, id). Tenants are scoped by salt, so the same
id under two salts is two conversations."""

PlannerSource = Callable[[str | None], CraftPlanner]
"""Salt -> that replica's planner, for replicas whose planners live in an engine
(``CraftEngine.planner_for``); the router then reads their trees but never owns them."""


@dataclass(slots=True)
class ReplicaLoad:
    """In-flight work and assignment count. Owner: :class:`craft_rag.routing.Router` only.

    ``requests``/``prompt_tokens``/``work_s``: requests routed here and not yet finished, their
    prompt tokens and their predicted prefill seconds. ``assigned``: requests routed here since
    the replica (re)joined (the balance bound counts these).
    """

    requests: int = 0
    prompt_tokens: int = 0
    work_s: float = 0.0
    assigned: int = 0


@dataclass(slots=True, eq=False)
class Replica:
    """A replica's planners (one per salt: the salt is part of the key space), health and load.

    Invariants: an unhealthy replica has no planners of its own and zero load; every homed
    conversation belongs to a healthy replica (checked by the router). ``epoch`` counts how
    often the replica went down, so a finish for a request sent before the fault is ignored.
    """

    id: ReplicaId
    index: int
    planner_config: PlannerConfig
    clock: Callable[[], float] = time.monotonic
    source: PlannerSource | None = None
    healthy: bool = True
    epoch: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    conversations: set[ConversationKey] = field(default_factory=set)
    _planners: dict[str | None, CraftPlanner] = field(default_factory=dict)

    def planner(self, salt: str | None) -> CraftPlanner:
        """The planner for ``salt`` (created on first use). ``RuntimeError`` when down."""
        if not self.healthy:
            msg = f"replica {self.id!r} is down; route to a healthy replica"
            raise RuntimeError(msg)
        planner = self._planners.get(salt)
        if planner is None:
            if self.source is not None:
                planner = self.source(salt)
            else:
                planner = CraftPlanner(self.planner_config, clock=self.clock)
            self._planners[salt] = planner
        return planner

    def tree(self, salt: str | None) -> ChunkPrefixTree | None:
        """The CP-Tree for ``salt``, or None if nothing was planned here with that salt. O(1)."""
        planner = self._planners.get(salt)
        return planner.prefix_tree if planner is not None else None

    def holds_any(self, salt: str | None, keys: Iterable[ChunkKey]) -> bool:
        """True if some cached path for ``salt`` starts with one of ``keys`` (only such a
        replica can have a non-empty set match). O(len(keys))."""
        tree = self.tree(salt)
        if tree is None:
            return False
        return not tree.root.children.keys().isdisjoint(keys)

    def tree_nodes(self) -> int:
        """CP-Tree nodes over all salts. O(salts)."""
        return sum(len(p.prefix_tree) for p in self._planners.values())

    def go_down(self) -> int:
        """Drop every tree and the load (the replica's KV is gone). Returns nodes dropped."""
        dropped = self.tree_nodes()
        for planner in self._planners.values():
            if self.source is not None:
                planner.on_all_blocks_cleared()
        self._planners.clear()
        self.healthy = False
        self.epoch += 1
        self.load = ReplicaLoad()
        self.conversations.clear()
        return dropped

    def come_up(self) -> None:
        """Rejoin empty: no trees, no load, no conversations."""
        self._planners.clear()
        self.healthy = True
        self.load = ReplicaLoad()
        self.conversations.clear()
