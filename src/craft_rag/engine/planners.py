"""The planners an engine serves with: one per cache salt, and checks on caller-made plans.

**Salt namespaces.** vLLM's ``cache_salt`` isolates prefix-cache entries between tenants: the
salt is mixed into the first block's hash, so every block of a salted prompt has a hash no
other salt (and no unsalted prompt) produces, and nothing is reused across salts. The CP-Tree
must not predict or record reuse across salts either, so :class:`PlannerNamespaces` keeps one
planner per salt: the default planner (no salt) plus salted planners created lazily by a
factory (default: a ``CraftPlanner`` with the default planner's config), LRU-bounded. The
planners themselves stay salt-agnostic. Every KV event goes to every planner: a removed block's
hash can only match nodes of the namespace whose prompts produced it, and a full clear empties
them all.

Dropping the least recently used salted planner loses only planning state (its CA-Table,
CP-Tree and conversation registry); vLLM still holds that salt's blocks, and a later request
with the salt starts a fresh planner that learns them again.

**Caller-made plans.** ``CraftEngine.generate(..., plan=p)`` serves a plan that
``planner.plan()`` made earlier (a LlamaIndex postprocessor, a LangChain reorder step with the
commit deferred) and commits that plan instead of planning again. :func:`check_plan` refuses,
before anything reaches vLLM, a plan that does not fit the request or cannot be committed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NewType, Protocol

from craft_rag.chunk import Chunk
from craft_rag.types import BlockHash, ChunkKey

CacheSalt = NewType("CacheSalt", str)
"""A vLLM ``cache_salt``: prefix-cache entries are shared only between requests with the same
salt (tenants, users)."""

DEFAULT_MAX_SALT_NAMESPACES = 64

# vLLM's own limits on salts (vllm.entrypoints.generate.base.protocol.validate_cache_salt):
# the in-process engine does not check them, cache backends keyed by the salt rely on them.
_MAX_SALT_LENGTH = 128
_FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")


class PlanLike(Protocol):
    """The parts of :class:`craft_rag.planner.Plan` the engine reads."""

    @property
    def plan_id(self) -> int: ...
    @property
    def ordered(self) -> tuple[Chunk, ...]: ...
    @property
    def removed_duplicates(self) -> tuple[Chunk, ...]: ...
    @property
    def repeated_in_request(self) -> tuple[Chunk, ...]: ...
    @property
    def matched_chunks(self) -> int: ...
    @property
    def matched_tokens(self) -> int | None: ...
    @property
    def conversation_id(self) -> str | None: ...
    @property
    def turn(self) -> int: ...


class PlannerLike(Protocol):
    """What the engine needs from a planner (:class:`craft_rag.planner.CraftPlanner`)."""

    def plan(self, chunks: Sequence[Chunk], conversation_id: str | None = None) -> Any: ...

    def commit(
        self,
        plan: Any,
        *,
        prefix_tokens: int | None = None,
        chunk_token_counts: Sequence[int] | None = None,
        reused_chunks: int | None = None,
        block_hashes: Sequence[Sequence[BlockHash]] | None = None,
    ) -> Any: ...

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int: ...

    def on_all_blocks_cleared(self) -> None: ...

    def end_conversation(self, conversation_id: str) -> bool: ...


def validate_cache_salt(cache_salt: object) -> CacheSalt | None:
    """``cache_salt`` as a :data:`CacheSalt` (``None`` stays ``None``). ``ValueError`` unless it
    is a non-empty string of at most 128 characters without ``@``, ``/``, ``\\`` or NUL
    (vLLM's rules)."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        msg = f"cache_salt must be a non-empty string or None, got {cache_salt!r}"
        raise ValueError(msg)
    if len(cache_salt) > _MAX_SALT_LENGTH or any(c in _FORBIDDEN_SALT_CHARS for c in cache_salt):
        msg = (
            f"cache_salt must be at most {_MAX_SALT_LENGTH} characters without '@', '/', '\\' "
            f"or NUL (vLLM's rules), got {cache_salt[:40]!r}...; hash the tenant id if needed"
        )
        raise ValueError(msg)
    return CacheSalt(cache_salt)


def planner_factory_like(default: PlannerLike) -> Callable[[], PlannerLike]:
    """A factory of fresh planners configured like ``default``: a ``CraftPlanner`` with
    ``default.config`` when that is a ``PlannerConfig`` (also for wrappers exposing their
    planner's ``config``), else the engine's default (tree policy)."""
    from craft_rag.planner import CraftPlanner, PlannerConfig

    config = getattr(default, "config", None)
    if not isinstance(config, PlannerConfig):
        config = PlannerConfig(policy="tree")
    frozen: PlannerConfig = config
    return lambda: CraftPlanner(frozen)


class PlannerNamespaces:
    """The default planner plus one planner per cache salt, LRU-bounded; the KV-event listener.

    Invariants: the default planner is never dropped; at most ``max_salted`` salted planners
    (least recently used dropped first); every KV event reaches every planner held. Owner of
    the salt -> planner map (under ``_lock``); each planner owns its own state (and lock), so
    events are applied outside ``_lock``. Cost: ``get`` O(1); an event costs what it costs each
    planner, times the number of planners.
    """

    def __init__(
        self,
        default: PlannerLike,
        factory: Callable[[], PlannerLike] | None = None,
        *,
        max_salted: int = DEFAULT_MAX_SALT_NAMESPACES,
        salted_factory: Callable[[CacheSalt], PlannerLike] | None = None,
    ) -> None:
        """``salted_factory(salt)``, when given, makes each salt's planner instead of
        ``factory`` (the engine's ``store=`` uses it: each salt gets its own store namespace)."""
        if not isinstance(max_salted, int) or max_salted < 1:
            msg = f"max_salt_namespaces must be an int >= 1, got {max_salted!r}"
            raise ValueError(msg)
        self.max_salted = max_salted
        self._lock = threading.Lock()
        self._default = default
        self._custom_factory = factory
        self._factory = factory or planner_factory_like(default)
        self._salted_factory = salted_factory
        self._salted: OrderedDict[CacheSalt, PlannerLike] = OrderedDict()  # owner: _lock

    @property
    def default(self) -> PlannerLike:
        return self._default

    def reset(self, default: PlannerLike) -> None:
        """Serve with ``default`` from now on and drop every salted planner (they were made
        like the old default). A custom factory stays."""
        with self._lock:
            self._default = default
            self._factory = self._custom_factory or planner_factory_like(default)
            self._salted.clear()

    def get(self, salt: CacheSalt | None) -> PlannerLike:
        """The planner for ``salt`` (the default for ``None``), created on first use and marked
        most recently used; may drop the least recently used salted planner."""
        if salt is None:
            return self._default
        with self._lock:
            planner = self._salted.get(salt)
            if planner is None:
                if self._salted_factory is not None:
                    planner = self._salted_factory(salt)
                else:
                    planner = self._factory()
                self._salted[salt] = planner
                while len(self._salted) > self.max_salted:
                    self._salted.popitem(last=False)
            else:
                self._salted.move_to_end(salt)
            return planner

    def peek(self, salt: CacheSalt | None) -> PlannerLike | None:
        """The planner for ``salt`` if one exists; creates nothing, touches no LRU order."""
        if salt is None:
            return self._default
        with self._lock:
            return self._salted.get(salt)

    def salts(self) -> list[CacheSalt]:
        """Salts with a planner, least recently used first."""
        with self._lock:
            return list(self._salted)

    def all(self) -> list[PlannerLike]:
        with self._lock:
            return [self._default, *self._salted.values()]

    # ---- KV events (EvictionListener) and conversations ----

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
        """Offer the evicted hashes to every planner; CP-Tree nodes removed in total."""
        hashes = tuple(hashes)
        return sum(planner.on_blocks_removed(hashes) for planner in self.all())

    def on_all_blocks_cleared(self) -> None:
        for planner in self.all():
            planner.on_all_blocks_cleared()

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget the conversation in every planner (it lives in one). True if any knew it."""
        known = [planner.end_conversation(conversation_id) for planner in self.all()]
        return any(known)

    def _check_invariants(self) -> None:
        with self._lock:
            assert len(self._salted) <= self.max_salted
            assert all(p is not self._default for p in self._salted.values())


def _plan_pending(planner: PlannerLike, plan: PlanLike) -> bool | None:
    """Whether ``planner`` still waits for ``plan``'s commit; ``None`` when it cannot tell
    (e.g. a wrapper planner; its commit then decides)."""
    is_pending = getattr(planner, "is_pending", None)
    if callable(is_pending):
        return bool(is_pending(plan))
    return None


def _committed_turns(planner: PlannerLike, conversation_id: str) -> int | None:
    """Turns of ``conversation_id`` committed in ``planner`` (``None`` when it cannot tell)."""
    registry = getattr(planner, "conversations", None)
    turn_count = getattr(registry, "turn_count", None)
    if not callable(turn_count):
        return None
    count = turn_count(conversation_id)
    return count if isinstance(count, int) else None


def check_plan(
    plan: object,
    planner: PlannerLike,
    chunks: Sequence[Chunk],
    conversation_id: str | None,
    *,
    salt: CacheSalt | None = None,
) -> PlanLike:
    """``plan`` as a :class:`PlanLike` the engine may serve with ``planner`` and commit.

    ``chunks`` must hold the keys the plan orders (in any order), or all the keys it was made
    from (the ordered ones plus earlier turns' duplicates); ``conversation_id`` must be ``None``
    or the plan's. ``ValueError`` when the plan is not a plan or does not fit the request;
    ``RuntimeError`` when ``planner`` no longer waits for it (already committed, too old, or
    made by another planner: e.g. another salt's) or the conversation moved on since it was
    made. O(k).

    A plan made by another planner whose id happens to be pending here too cannot be told
    apart (plan ids count from 1 in every planner); the commit then records it here.
    """
    required = ("plan_id", "ordered", "removed_duplicates", "repeated_in_request", "turn")
    if not all(hasattr(plan, name) for name in required) or not isinstance(
        getattr(plan, "plan_id", None), int
    ):
        msg = (
            f"plan must be a craft_rag.planner.Plan made by the engine's planner "
            f"(engine.planner_for(cache_salt).plan(chunks, conversation_id)), got "
            f"{type(plan).__name__}"
        )
        raise ValueError(msg)
    checked: PlanLike = plan  # type: ignore[assignment]  # structurally checked above
    where = "the default planner" if salt is None else "the planner of this cache_salt"
    if conversation_id is not None and conversation_id != checked.conversation_id:
        msg = (
            f"plan {checked.plan_id} was made for conversation {checked.conversation_id!r}, "
            f"not {conversation_id!r}; plan with the request's conversation id"
        )
        raise ValueError(msg)
    given = {c.key for c in chunks}
    ordered: set[ChunkKey] = {c.key for c in checked.ordered}
    made_from = ordered | {c.key for c in checked.removed_duplicates}
    if given != ordered and given != made_from:
        missing = sorted(ordered - given)[:3]
        extra = sorted(given - made_from)[:3]
        msg = (
            f"chunks do not match plan {checked.plan_id} (missing {missing}, not in the plan "
            f"{extra}); pass plan.ordered (or the chunks the plan was made from)"
        )
        raise ValueError(msg)
    if _plan_pending(planner, checked) is False:
        msg = (
            f"plan {checked.plan_id} is not waiting for a commit in {where}: it was already "
            "committed, is too old, or was made by another planner; make a new plan with "
            "engine.planner_for(cache_salt).plan(...)"
        )
        raise RuntimeError(msg)
    if checked.conversation_id is not None:
        turns = _committed_turns(planner, checked.conversation_id)
        if turns is not None and checked.turn != turns + 1:
            msg = (
                f"plan {checked.plan_id} is for turn {checked.turn} of conversation "
                f"{checked.conversation_id!r}, which has {turns} committed turns now; plan the "
                "turn again"
            )
            raise RuntimeError(msg)
    return checked
