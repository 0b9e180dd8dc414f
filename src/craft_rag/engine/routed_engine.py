"""``CraftEngine(server=[url, url, ...])``: one engine over several vLLM servers (replicas).

``CraftEngine.__new__`` returns a :class:`RoutedEngine` when ``server=`` is a list, so the user
code for N replicas is that one argument; the request forms (``generate``, ``stream``,
``astream``, ``generate_batch``, their ``_tokens``/``_messages`` forms, ``submit``) are the
same. Every request is routed and ordered jointly (``routing=``, default ``"craft_joint"``:
:mod:`craft_rag.routing`), served on the chosen replica, committed to that replica's CP-Tree
and finished in the router (:mod:`craft_rag.engine.replica_set`). The replica that served a
request, whether its conversation was re-homed and how often it was retried are in its
:class:`~craft_rag.engine.results.ReuseReport` (``replica``, ``rehomed``, ``retries``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Unpack

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationHistory
from craft_rag.engine.backends.server.settings import ServerSettings
from craft_rag.engine.backends.vllm.backend import EngineSettings
from craft_rag.engine.driver import RequestIds
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.engine_settings import (
    BackendParts,
    ConversationSettings,
    FlatKeywords,
    PlannerSettings,
    RenderingSettings,
    group_keywords,
)
from craft_rag.engine.messages import ChatTurn
from craft_rag.engine.replica_set import (
    DEFAULT_PROBE_INTERVAL_S,
    ReplicaSet,
    RoutedRequest,
    replica_names,
)
from craft_rag.engine.requests import InFlight, RequestHandle, finish_request
from craft_rag.engine.results import EngineRequest, GenerationResult
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.routing.policies import get_routing_policy
from craft_rag.routing.replica import PlannerSource, ReplicaId
from craft_rag.routing.router import FaultReport, Router, RouterConfig
from craft_rag.routing.shared_state import RoutingState, routing_state_for
from craft_rag.stores import as_store
from craft_rag.stores.scoped import ScopedStore, replica_scope
from craft_rag.types import ChunkKey
from craft_rag.validation import validate_cache_salt

__all__ = ["RoutedEngine"]


class RoutedEngine(CraftEngine):
    """A :class:`CraftEngine` over several vLLM servers (made by ``CraftEngine(server=[...])``).

    Invariants: one replica engine per server (each ``CraftEngine(server=url)``: its own
    backend, KV events, planners and conversation histories); the router reads those planners
    and never writes a tree; a request is committed only on the replica that served it, and
    finished in the router exactly once. Not supported here (``RuntimeError`` naming why):
    ``plan=`` plans, ``planner``/``planner_for``/``set_planner`` (each replica has its own
    planner: :meth:`replica_engine`). ``store=`` (``redis://``; ``memory://`` within one
    process) shares the routing with the other app workers given the same servers and store:
    each replica's planners in its own store namespaces, the conversation homes and in-flight
    loads in :mod:`craft_rag.routing.shared_state` (docs/routing.md, "Several app workers").
    Start-up: one server connection per replica, in order.
    """

    def __init__(
        self,
        settings: EngineSettings | None = None,
        planner: CraftPlanner | None = None,
        *,
        server: Sequence[str | ServerSettings] | str | ServerSettings | None = None,
        routing: str | None = None,
        planners: PlannerSettings | None = None,
        rendering: RenderingSettings | None = None,
        conversation: ConversationSettings | None = None,
        parts: BackendParts | None = None,
        **flat: Unpack[FlatKeywords],
    ) -> None:
        """Connect to every server in ``server`` (a list of URLs or :class:`ServerSettings`,
        each a ``craft-rag serve``/vLLM server of the same model) and route over them with
        ``routing`` (a :data:`~craft_rag.routing.ROUTING_POLICIES` name, default
        ``"craft_joint"``). ``planner``: its config is every replica planner's (with the
        routing policy's ordering); the other options are :class:`CraftEngine`'s, given to
        every replica's engine. ``store``: shared with other app workers (``redis://``; a
        ``sqlite://`` store is a ``ValueError``: the loads' leases need Redis). ``ValueError``
        for a bad list, ``backend=`` (one server each), or an unknown policy; a server that
        cannot be reached raises as for one server (the replicas connected so far are
        closed)."""
        if server is None or isinstance(server, str | ServerSettings):
            msg = "RoutedEngine takes server=[url, url, ...] (use CraftEngine for one server)"
            raise ValueError(msg)
        servers = list(server)
        names = replica_names(servers)
        groups = group_keywords(planners, rendering, conversation, parts, flat)
        if groups.parts.backend is not None:
            msg = "pass server=[...] or backend=, not both (each server is its own backend)"
            raise ValueError(msg)
        policy = get_routing_policy(routing or "craft_joint")
        base = planner.config if planner is not None else PlannerConfig()
        router_base = RouterConfig(planner=base)
        planner_config = replace(base, policy=policy.ordering, promotion="served")
        shared_store = None
        shared_state: RoutingState | None = None
        if groups.planners.store is not None:
            # Several app workers: each replica's planners in its own store namespaces, the
            # homes and loads beside them (craft_rag.routing.shared_state).
            shared_store = as_store(groups.planners.store)
            shared_state = routing_state_for(shared_store, names)
        engines: dict[ReplicaId, CraftEngine] = {}
        try:
            for name, spec in zip(names, servers, strict=True):
                replica_planners = groups.planners
                replica_planner: CraftPlanner | None = CraftPlanner(planner_config)
                if shared_store is not None:
                    scoped = ScopedStore(shared_store, replica_scope(name), planner_config)
                    replica_planners = replace(groups.planners, store=scoped)
                    replica_planner = None  # the engine makes them on the store
                engines[name] = CraftEngine(
                    settings,
                    replica_planner,
                    server=spec,
                    planners=replica_planners,
                    rendering=groups.rendering,
                    conversation=groups.conversation,
                    parts=groups.parts,
                )
        except BaseException:
            for engine in engines.values():
                engine.close()
            if shared_state is not None:
                shared_state.close()
            raise
        first = next(iter(engines.values()))
        sizes = {e.block_size for e in engines.values()}
        lengths = {e.max_model_len for e in engines.values()}
        if len(sizes) > 1 or len(lengths) > 1:
            for engine in engines.values():
                engine.close()
            if shared_state is not None:
                shared_state.close()
            msg = (
                f"the servers differ in block size {sorted(sizes)} or max_model_len "
                f"{sorted(lengths)}; start every replica with the same settings"
            )
            raise ValueError(msg)
        sources: dict[str, PlannerSource] = {
            name: engine.planner_for for name, engine in engines.items()
        }
        router = Router(
            list(engines),
            policy.name,
            replace(router_base, block_size=first.block_size),
            planner_sources=sources,
            shared=shared_state,
        )
        self._replicas = ReplicaSet(
            engines,
            router,
            lambda: CraftPlanner(planner_config),
            probe_interval_s=DEFAULT_PROBE_INTERVAL_S,
            shared_planners=shared_store is not None,
        )
        # The model-facing pieces are the same on every replica: read them from the first.
        self.settings = first.settings
        self.system_prompt = first.system_prompt
        self.instructions = first.instructions
        self.prompt_format = first.prompt_format
        self.assembler = first.assembler
        self.prompt_renderer = first.prompt_renderer  # renders; conversations live per replica
        self.block_hasher = first.block_hasher
        self.kv_events = None  # each replica's engine has its own (replica_engine(r).kv_events)
        self._chat_rendering = first.chat_rendering
        self._ids = RequestIds()
        self._renderer_lock = threading.Lock()

    # ---- the replicas ----------------------------------------------------------------------

    @property
    def router(self) -> Router:
        """The router (read its ``load()``, ``home()``, ``stats``; the engine drives it)."""
        return self._replicas.router

    @property
    def replicas(self) -> tuple[ReplicaId, ...]:
        """The replica ids: each server's URL without credentials, in ``server=`` order."""
        return self.router.replica_ids

    def replica_engine(self, replica: str) -> CraftEngine:
        """The engine serving ``replica`` (its planners, KV events, conversations).
        ``KeyError`` names the valid ids."""
        try:
            return self._replicas.engines[ReplicaId(replica)]
        except KeyError:
            msg = f"unknown replica {replica!r}; valid: {list(self.replicas)}"
            raise KeyError(msg) from None

    @property
    def faults(self) -> tuple[FaultReport, ...]:
        """Every replica loss so far (what was dropped and where conversations went)."""
        return tuple(self._replicas.faults)

    def mark_down(self, replica: str) -> FaultReport:
        """Take ``replica`` out (e.g. for maintenance): its trees are dropped and its
        conversations re-homed; it is probed and rejoins empty once it answers."""
        self.replica_engine(replica)
        return self._replicas.mark_down(replica)

    def check_replicas(self) -> list[ReplicaId]:
        """Probe every replica that is down now (a 1-token request each); those that answer
        rejoin empty. Returns them. (Also done in the background as requests arrive, at most
        every few seconds.)"""
        return self._replicas.probe()

    # ---- configuration -----------------------------------------------------------------------

    def _one_planner(self) -> RuntimeError:
        return RuntimeError(
            "several servers: each replica has its own planner (its CP-Tree); read one with "
            "engine.replica_engine(replica).planner_for(salt)"
        )

    @property
    def planner(self) -> CraftPlanner:
        raise self._one_planner()

    def planner_for(self, cache_salt: str | None = None) -> CraftPlanner:
        raise self._one_planner()

    def set_planner(self, planner: CraftPlanner) -> None:
        raise self._one_planner()

    @property
    def max_model_len(self) -> int:
        return next(iter(self._replicas.engines.values())).max_model_len

    @property
    def block_size(self) -> int:
        return next(iter(self._replicas.engines.values())).block_size

    @property
    def requests_in_flight(self) -> int:
        """Requests routed and not finished, over all replicas. O(N)."""
        return sum(load.requests for load in self.router.load().values())

    def _home_engine(self, conversation_id: str | None, cache_salt: str | None) -> CraftEngine:
        salt = validate_cache_salt(cache_salt)
        home = None
        if conversation_id is not None:
            home = self.router.home(conversation_id, salt=salt)
        if home is None:
            return next(iter(self._replicas.engines.values()))
        return self._replicas.engines[home]

    def turn_count(self, conversation_id: str, *, cache_salt: str | None = None) -> int:
        """Turns the conversation's home replica holds (0: no home, ended or re-homed). With
        ``store=``: read after pulling what the other workers committed there."""
        salt = validate_cache_salt(cache_salt)
        if self.router.home(conversation_id, salt=salt) is None:
            return 0
        engine = self._home_engine(conversation_id, salt)
        engine.planner_for(salt).sync()  # no-op without a store
        return engine.turn_count(conversation_id, cache_salt=salt)

    def reset_prefix_cache(self) -> bool:
        """Reset every replica's prefix cache and trees (those that are up). True if all did."""
        done = True
        for rid, engine in self._replicas.engines.items():
            if self.router.replica(rid).healthy:
                done = engine.reset_prefix_cache() and done
        return done

    def end_conversation(self, conversation_id: str, *, cache_salt: str | None = None) -> bool:
        """Forget the conversation on its home replica and its home in the router."""
        salt = validate_cache_salt(cache_salt)
        home = self.router.home(conversation_id, salt=salt)
        known = False
        if home is not None:
            engine = self._replicas.engines[home]
            known = engine.end_conversation(conversation_id, cache_salt=salt)
        return self.router.end_conversation(conversation_id, salt=salt) or known

    def export_conversation(
        self, conversation_id: str, *, cache_salt: str | None = None
    ) -> ConversationHistory | None:
        """As :meth:`CraftEngine.export_conversation`, from the conversation's home replica
        (None: no home)."""
        salt = validate_cache_salt(cache_salt)
        if self.router.home(conversation_id, salt=salt) is None:
            return None
        engine = self._home_engine(conversation_id, salt)
        return engine.export_conversation(conversation_id, cache_salt=salt)

    def import_conversation(
        self,
        conversation_id: str,
        history: ConversationHistory,
        *,
        cache_salt: str | None = None,
    ) -> bool:
        """Not supported here (``RuntimeError``): the router homes a conversation when its
        first turn is routed. A re-homed conversation's history moves by itself."""
        del conversation_id, history, cache_salt
        msg = (
            "import_conversation with several servers is not supported: the router homes a "
            "conversation on its first turn (a re-homed one's history moves by itself)"
        )
        raise RuntimeError(msg)

    def fit_turn(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None,
        max_tokens: int,
        cache_salt: str | None = None,
    ) -> frozenset[ChunkKey]:
        """As :meth:`CraftEngine.fit_turn`, on the conversation's home replica (the engine
        does this itself before routing each turn)."""
        engine = self._home_engine(conversation_id, cache_salt)
        return engine.fit_turn(
            chunks,
            question,
            conversation_id=conversation_id,
            max_tokens=max_tokens,
            cache_salt=cache_salt,
        )

    def side_prompt_ids(
        self, conversation_id: str | None, text: str, *, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """As :meth:`CraftEngine.side_prompt_ids`, from the conversation's home replica. The
        request that serves them is routed like any prompt without chunks (load only), so it
        may run on another replica than the cached history."""
        engine = self._home_engine(conversation_id, cache_salt)
        return engine.side_prompt_ids(conversation_id, text, cache_salt=cache_salt)

    def message_token_ids(self, messages: Sequence[ChatTurn]) -> tuple[int, ...]:
        return next(iter(self._replicas.engines.values())).message_token_ids(messages)

    # ---- the request path --------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> RequestHandle:
        """Route ``request`` to a replica and start it there (see :meth:`CraftEngine.submit`);
        the handle reads it as with one server (result, iteration, ``async for``, abort).
        ``ValueError`` for a ``plan=`` (the router plans); ``RuntimeError`` when no replica
        is up. Cost: one route (policy + plan) plus the replica's render."""
        routed = RoutedRequest(self._replicas, request, self._ids())
        return RequestHandle(routed.start, routed.abort, self._finish)

    def _finish(self, flight: InFlight) -> GenerationResult:
        return finish_request(flight)

    def close(self) -> None:
        """Close every replica's engine."""
        self._replicas.close()


# Write-once: ``CraftEngine(server=[...])`` makes this class (see CraftEngine.several_servers).
assert CraftEngine.several_servers in (None, RoutedEngine)
CraftEngine.several_servers = RoutedEngine
