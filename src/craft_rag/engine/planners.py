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

Dropping the least recently used salted planner loses only planning state (its CA-Table and
CP-Tree); vLLM still holds that salt's blocks, and a later request with the salt starts a fresh
planner that learns them again. Its conversation store is kept (the stores of at most
``max_salted`` dropped planners) and handed to that next planner, so a conversation keeps its
turns and its salt.

**Conversations are per salt.** A conversation lives in its salt's planner alone: the same
conversation id under two salts is two independent conversations (two tenants may both have a
"support-1"), and ending or touching one never reaches another salt's planner or store
namespace. Nothing answers whether another salt uses an id.

**Caller-made plans.** ``CraftEngine.generate(..., plan=p)`` serves a plan that
``planner.plan()`` made earlier (a LlamaIndex postprocessor, a LangChain reorder step with the
commit deferred) and commits that plan instead of planning again. :func:`check_plan` refuses,
before anything reaches vLLM, a plan that does not fit the request or cannot be committed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationStore
from craft_rag.kvtiers.approx_params import APPROX_SALT_PREFIX
from craft_rag.planner import CraftPlanner, Plan, PlannerConfig
from craft_rag.stores import DEFAULT_NAMESPACE, StateStore, as_store, namespace_for_salt
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash, ChunkKey, ConversationId

# The salt type and its check live in the core (no core module imports the engine); both
# stay importable from here.
from craft_rag.types import CacheSalt as CacheSalt
from craft_rag.validation import validate_cache_salt as validate_cache_salt

DEFAULT_MAX_SALT_NAMESPACES = 64
"""Salted planners an engine keeps (least recently used dropped first)."""

ENGINE_MAX_CONVERSATIONS = 1024
"""Conversations an engine's default planner keeps when ``CraftEngine(max_conversations=)``
is not given (its ``PlannerConfig.max_conversations``). The one other default of that bound
is a planner's own, :data:`craft_rag.conversation.DEFAULT_MAX_CONVERSATIONS` (10,000): a
``CraftPlanner`` made without an engine, and an engine's planners with ``store=`` (the store's
workers share that config). The engine's is lower because each of its conversations also
keeps its prompt's token ids (up to the history budget, ~3,000 ints), not only chunk keys."""


class SaltCheck:
    """A request's ``cache_salt`` checked for one engine: :func:`validate_cache_salt`, and
    refused (``ValueError`` naming the fix) when the engine's backend cannot pass a salt to
    vLLM. Called once per request, before its planner is looked up. O(len(salt))."""

    __slots__ = ("_backend_name", "_takes_salt")

    def __init__(self, takes_salt: bool, backend_name: str) -> None:
        self._takes_salt = takes_salt
        self._backend_name = backend_name

    def __call__(self, cache_salt: str | None) -> CacheSalt | None:
        salt = validate_cache_salt(cache_salt)
        if salt is not None and salt.startswith(APPROX_SALT_PREFIX):
            # Reserved: the approximate connector reads such a salt as request-scoped and keys
            # its exact KV under the part after '|', another tenant's salt (kvtiers.approx_params).
            msg = f"cache_salt must not start with {APPROX_SALT_PREFIX!r} (reserved); pick another"
            raise ValueError(msg)
        if salt is not None and not self._takes_salt:
            msg = (
                f"this engine's backend ({self._backend_name}) takes no cache_salt: "
                "its add_request needs a cache_salt keyword put into vLLM's prompt dict; "
                "send the request without cache_salt or use the vLLM backend"
            )
            raise ValueError(msg)
        return salt


def planner_factory_like(default: CraftPlanner) -> Callable[[], CraftPlanner]:
    """A factory of fresh planners configured like ``default`` (its ``config``)."""
    config = default.config
    return lambda: CraftPlanner(config)


def default_planner(max_conversations: int = ENGINE_MAX_CONVERSATIONS) -> CraftPlanner:
    """The engine's planner when none is given: the ``tree`` policy, ``max_conversations``
    conversations."""
    return CraftPlanner(PlannerConfig(policy="tree", max_conversations=max_conversations))


def bound_conversations(planner: CraftPlanner, max_conversations: int) -> CraftPlanner:
    """``planner`` with its conversation store bounded by ``max_conversations`` (its config
    too, so planners made like it share the bound). ``ValueError`` for a bad bound."""
    planner.config = replace(planner.config, max_conversations=max_conversations)
    planner.conversations.max_conversations = planner.config.max_conversations
    return planner


def store_planners(
    store: StateStore | str,
    planner: CraftPlanner | None,
    salt_planner_factory: Callable[[], CraftPlanner] | None,
    max_conversations: int | None = None,
) -> tuple[CraftPlanner, Callable[[CacheSalt], CraftPlanner]]:
    """The default planner and the per-salt factory of an engine with ``store=``: one store
    namespace per salt, every planner configured like the default one (``max_conversations``:
    None keeps :class:`PlannerConfig`'s default, as the store's other workers expect)."""
    if planner is not None or salt_planner_factory is not None:
        msg = (
            "store: pass either store= (the engine makes its planners) or planner=/"
            "salt_planner_factory= with CraftPlanner(config, store=..., namespace=...)"
        )
        raise ValueError(msg)
    shared = as_store(store)
    config = PlannerConfig(policy="tree")  # every worker's (the store checks it)
    scoped_config = getattr(shared, "planner_config", None)  # stores.scoped.ScopedStore's
    if isinstance(scoped_config, PlannerConfig):
        config = scoped_config  # a routed engine's replica: its routing policy's planners
    if max_conversations is not None:
        config = replace(config, max_conversations=max_conversations)
    default = CraftPlanner(config, store=shared, namespace=DEFAULT_NAMESPACE)

    def for_salt(salt: CacheSalt) -> CraftPlanner:
        return CraftPlanner(config, store=shared, namespace=namespace_for_salt(salt))

    return default, for_salt


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
        default: CraftPlanner,
        factory: Callable[[], CraftPlanner] | None = None,
        *,
        max_salted: int = DEFAULT_MAX_SALT_NAMESPACES,
        salted_factory: Callable[[CacheSalt], CraftPlanner] | None = None,
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
        self._salted: OrderedDict[CacheSalt, CraftPlanner] = OrderedDict()  # owner: _lock
        # The conversation stores of dropped local planners (at most max_salted, LRU): a
        # salt's conversations outlive its planning state and go to its next planner.
        self._kept: OrderedDict[CacheSalt, ConversationStore] = OrderedDict()  # owner: _lock

    @property
    def default(self) -> CraftPlanner:
        return self._default

    def reset(self, default: CraftPlanner) -> None:
        """Serve with ``default`` from now on and drop every salted planner (they were made
        like the old default). A custom factory stays."""
        with self._lock:
            self._default = default
            self._factory = self._custom_factory or planner_factory_like(default)
            self._salted.clear()
            self._kept.clear()

    def get(self, salt: CacheSalt | None) -> CraftPlanner:
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
                kept = self._kept.pop(salt, None)
                if kept is not None and planner.store is None:
                    planner.conversations = kept
                self._salted[salt] = planner
                while len(self._salted) > self.max_salted:
                    old_salt, old = self._salted.popitem(last=False)
                    if old.store is None:  # a sharing planner's are in its store
                        self._kept[old_salt] = old.conversations
                while len(self._kept) > self.max_salted:
                    self._kept.popitem(last=False)
            else:
                self._salted.move_to_end(salt)
            return planner

    def peek(self, salt: CacheSalt | None) -> CraftPlanner | None:
        """The planner for ``salt`` if one exists; creates nothing, touches no LRU order."""
        if salt is None:
            return self._default
        with self._lock:
            return self._salted.get(salt)

    def salts(self) -> list[CacheSalt]:
        """Salts with a planner, least recently used first."""
        with self._lock:
            return list(self._salted)

    def all(self) -> list[CraftPlanner]:
        with self._lock:
            return [self._default, *self._salted.values()]

    # ---- KV events (EvictionListener) and conversations ----

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int:
        """Offer the evicted hashes to every planner; CP-Tree nodes removed in total."""
        hashes = tuple(hashes)
        return sum(planner.on_blocks_removed(hashes) for planner in self.all())

    def on_blocks_moved(self, hashes: Iterable[BlockHash], location: KVLocation) -> int:
        """Offer the moved hashes (a KV tier's residency, :mod:`craft_rag.engine.kv_residency`)
        to every planner; CP-Tree nodes relocated in total."""
        hashes = tuple(hashes)
        return sum(planner.on_blocks_moved(hashes, location) for planner in self.all())

    def on_all_blocks_cleared(self) -> None:
        for planner in self.all():
            planner.on_all_blocks_cleared()

    def end_conversation(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        """Forget ``cache_salt``'s conversation ``conversation_id`` in that salt's planner
        alone (another tenant's conversation with the same id is untouched). With a shared
        store the end is logged in the salt's namespace even when this worker holds no planner
        of that salt yet (one is made: other workers may hold the conversation). True if it
        was known. O(1) plus the planner's end."""
        salt = CacheSalt(cache_salt) if cache_salt is not None else None
        planner = self.peek(salt)
        if planner is None:
            with self._lock:
                kept = self._kept.get(salt) if salt is not None else None
            if kept is not None:
                return kept.end(ConversationId(conversation_id))
            if self._default.store is None:
                return False  # local planners: no planner, no conversation
            planner = self.get(salt)
        return planner.end_conversation(conversation_id)

    # ---- the conversation stores (ConversationStores): each planner's own ----

    def conversation_stores(self) -> list[tuple[str | None, ConversationStore]]:
        """Every held planner's store with its salt (the default planner's first)."""
        with self._lock:
            salted = [(str(s), p.conversations) for s, p in self._salted.items()]
            salted += [(str(s), store) for s, store in self._kept.items()]
        return [(None, self._default.conversations), *salted]

    def held_store(self, cache_salt: str | None) -> ConversationStore | None:
        """The conversation store of ``cache_salt``'s planner if one is held (or kept after
        its planner was dropped); creates nothing, touches no LRU order. O(1)."""
        salt = CacheSalt(cache_salt) if cache_salt is not None else None
        planner = self.peek(salt)
        if planner is not None:
            return planner.conversations
        with self._lock:
            return self._kept.get(salt) if salt is not None else None

    def _check_invariants(self) -> None:
        with self._lock:
            assert len(self._salted) <= self.max_salted and len(self._kept) <= self.max_salted
            assert not self._kept.keys() & self._salted.keys()
            assert all(p is not self._default for p in self._salted.values())


def check_plan(
    plan: object,
    planner: CraftPlanner,
    chunks: Sequence[Chunk],
    conversation_id: str | None,
    *,
    salt: CacheSalt | None = None,
) -> Plan:
    """The :class:`~craft_rag.planner.Plan` that ``plan`` (the plan, its ``ref`` or its
    ``plan_id``) names, if the engine may serve it with ``planner`` and commit it. Read-only:
    the caller then claims it (:meth:`CraftPlanner.claim`).

    ``chunks`` must hold the keys the plan orders (in any order), or all the keys it was made
    from (the ordered ones plus earlier turns' duplicates); ``conversation_id`` must be ``None``
    or the plan's. ``ValueError`` when ``plan`` names no plan or does not fit the request;
    ``RuntimeError`` when ``planner`` no longer waits for it (already committed, too old, or
    made by another planner: e.g. another salt's) or the conversation moved on since it was
    made. O(k).
    """
    where = "the default planner" if salt is None else "the planner of this cache_salt"
    checked: Plan | None
    if isinstance(plan, Plan):
        _check_fit(plan, chunks, conversation_id)
        checked, name = (plan if planner.is_pending(plan) else None), str(plan.plan_id)
    elif isinstance(plan, int | str) and not isinstance(plan, bool):
        checked, name = planner.pending_plan(plan), repr(plan)
    else:
        msg = (
            f"plan must be a craft_rag.planner.Plan made by the engine's planner "
            f"(engine.planner_for(cache_salt).plan(chunks, conversation_id)) or its plan.ref, "
            f"got {type(plan).__name__}"
        )
        raise ValueError(msg)
    if checked is None:
        msg = (
            f"plan {name} is not waiting for a commit in {where}: it was already "
            "committed, is too old, or was made by another planner; make a new plan with "
            "engine.planner_for(cache_salt).plan(...)"
        )
        raise RuntimeError(msg)
    _check_fit(checked, chunks, conversation_id)
    if checked.conversation_id is not None:
        turns = planner.committed_turns(checked.conversation_id)
        if checked.turn != turns + 1:
            msg = (
                f"plan {checked.plan_id} is for turn {checked.turn} of conversation "
                f"{checked.conversation_id!r}, which has {turns} committed turns now; plan the "
                "turn again"
            )
            raise RuntimeError(msg)
    return checked


def _check_fit(plan: Plan, chunks: Sequence[Chunk], conversation_id: str | None) -> None:
    """``ValueError`` unless the request's chunks and conversation fit ``plan``. O(k)."""
    if conversation_id is not None and conversation_id != plan.conversation_id:
        msg = (
            f"plan {plan.plan_id} was made for conversation {plan.conversation_id!r}, "
            f"not {conversation_id!r}; plan with the request's conversation id"
        )
        raise ValueError(msg)
    given = {c.key for c in chunks}
    ordered: set[ChunkKey] = {c.key for c in plan.ordered}
    made_from = ordered | {c.key for c in plan.removed_duplicates}
    if given != ordered and given != made_from:
        missing = sorted(ordered - given)[:3]
        extra = sorted(given - made_from)[:3]
        msg = (
            f"chunks do not match plan {plan.plan_id} (missing {missing}, not in the plan "
            f"{extra}); pass plan.ordered (or the chunks the plan was made from)"
        )
        raise ValueError(msg)
