"""Cluster simulator: a trace through N simulated vLLM replicas behind one :class:`Router`.

Each replica is a :class:`~craft_rag.prefix_cache_sim.SimulatedPrefixCache` of
``capacity_tokens`` (vLLM's block-chained LRU prefix cache) plus one FIFO prefill server whose
service time is the fitted :class:`~craft_rag.routing.queueing.TTFTModel`. Requests arrive as a
seeded Poisson process at ``load`` times the cluster's no-cache capacity
(``rate = load * N / mean(model.predict(prompt_tokens, 0))``).

Per arrival: finish every request whose prefill ended by then (its replica's KV events — the
blocks its prefill evicted — then its commit with the cache's reuse report, then the router's
``finish``), route, render the token-exact prompt in the planned order, serve it on that
replica's cache, and queue it. Per replica, events reach the router in the order the cache saw
the requests, so each replica's CP-Tree stays true up to the requests still in flight.
Conversations render append-only (history = previous prompt + answer); a turn arrives no
earlier than its previous turn's finish (no think time); a turn whose planner says
``turn == 1`` (new, or re-homed after a fault) starts fresh. Prompts are not cut to a
model length. Everything is a function of (trace, config): same seed, same result.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner, Plan
from craft_rag.prefix_cache_sim import SimulatedPrefixCache, block_hashes
from craft_rag.prompt import PromptAssembler, PromptFormat
from craft_rag.routing.policies import ROUTING_POLICIES
from craft_rag.routing.queueing import DEFAULT_TTFT_MODEL, TTFTModel
from craft_rag.routing.router import RouteDecision, Router, RouterConfig
from craft_rag.tokenizer import Tokenizer
from craft_rag.trace import TraceRequest
from craft_rag.types import BlockHash, ConversationId
from craft_rag.validation import check_int, check_number


@dataclass(frozen=True, slots=True)
class Fault:
    """Before request number ``at_request`` (0-based), replica ``replica`` (0-based index)
    goes down (``up=False``) or comes back (``up=True``)."""

    at_request: int
    replica: int
    up: bool = False


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run. ``capacity_tokens`` is per replica; ``load`` is the offered load as a
    fraction of the cluster's no-cache prefill capacity."""

    replicas: int
    policy: str = "craft_joint"
    capacity_tokens: int = 1 << 16
    block_size: int = 32
    load: float = 0.8
    seed: int = 0
    ttft_model: TTFTModel = DEFAULT_TTFT_MODEL
    router: RouterConfig | None = None
    faults: tuple[Fault, ...] = ()
    kv_events: bool = True
    """False: the router never hears evictions (only reuse reports correct its trees)."""

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or (
            self.replicas < 1
        ):
            msg = f"replicas must be an int >= 1, got {self.replicas!r}"
            raise ValueError(msg)
        if self.policy not in ROUTING_POLICIES:
            valid = sorted(ROUTING_POLICIES)
            msg = f"unknown routing policy {self.policy!r}; choose one of {valid}"
            raise ValueError(msg)
        check_int(self.block_size, "block_size", minimum=1)  # not True, int64
        check_int(self.seed, "seed", minimum=0)
        check_int(self.capacity_tokens, "capacity_tokens", minimum=1)
        if self.capacity_tokens < self.block_size:
            msg = (
                f"capacity_tokens must be an int >= block_size ({self.block_size}), "
                f"got {self.capacity_tokens!r}"
            )
            raise ValueError(msg)
        check_number(self.load, "load (fraction of no-cache capacity)", positive=True)
        if not self.load < 10:
            msg = f"load must be in (0, 10) (fraction of no-cache capacity), got {self.load!r}"
            raise ValueError(msg)
        for fault in self.faults:
            if not 0 <= fault.replica < self.replicas or fault.at_request < 0:
                msg = f"fault {fault} names no replica in [0, {self.replicas}) or a negative time"
                raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class SimResult:
    """Aggregates of one run. ``load_imbalance``: max over replicas of requests served there,
    over the mean; ``predicted_cached_fraction``: the router's predicted cached tokens over
    prompt tokens (close to the real one when the trees are kept true); ``decision_us_*``:
    wall time of :meth:`Router.route` per request (placement plus the chosen replica's
    ``plan()``), ``decision_cpu_us_*`` its thread CPU time (free of preemption on a shared
    machine), ``placement_us_*`` the wall time of ``route()`` less its ``plan()`` (the routing
    decision proper: what a single replica would not pay)."""

    replicas: int
    policy: str
    capacity_tokens: int
    requests: int
    cached_token_fraction: float
    predicted_cached_fraction: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    load_imbalance: float
    requests_per_replica: tuple[int, ...]
    decision_us_p50: float
    decision_us_p99: float
    decision_cpu_us_p50: float
    decision_cpu_us_p99: float
    placement_us_p50: float
    placement_us_p99: float
    rate_per_s: float
    rehomed_turns: int
    faults: int

    def row(self) -> dict[str, Any]:
        """The JSON row of ``bench routing`` (``requests_per_replica`` summarised)."""
        out = {k: getattr(self, k) for k in self.__slots__ if k != "requests_per_replica"}
        out["max_requests_per_replica"] = max(self.requests_per_replica)
        out["min_requests_per_replica"] = min(self.requests_per_replica)
        return out


@dataclass(slots=True)
class PreparedTrace:
    """A trace with its token ids computed once (shared by every run over it)."""

    requests: list[TraceRequest]
    assembler: PromptAssembler
    question_ids: list[tuple[int, ...]]
    answer_ids: list[tuple[int, ...]]
    prompt_tokens: list[int] = field(default_factory=list)
    """Single-turn prompt length of each request (head + chunks + question)."""


def prepare_trace(
    requests: Sequence[TraceRequest], tokenizer: Tokenizer, fmt: PromptFormat | None = None
) -> PreparedTrace:
    """Tokenize every chunk, question and answer once. ``ValueError`` for an empty trace or a
    request without chunks. O(trace tokens)."""
    if not requests:
        msg = "the trace has no requests; build one with `craft-rag trace --dataset squad`"
        raise ValueError(msg)
    assembler = PromptAssembler(tokenizer, fmt, cache_size=1 << 20)
    head = len(assembler.head_ids)
    questions, answers, lengths = [], [], []
    for r in requests:
        if not r.chunks:
            msg = f"request {r.id!r} has no chunks; routing needs at least one"
            raise ValueError(msg)
        q = assembler.question_ids(r.query)
        questions.append(q)
        answers.append(assembler.answer_ids(r.answer or "") if r.conversation_id else ())
        unique = {c.key: c for c in r.chunks}.values()
        lengths.append(head + sum(len(assembler.chunk_ids(c)) for c in unique) + len(q))
    return PreparedTrace(list(requests), assembler, questions, answers, lengths)


@dataclass(slots=True)
class _InFlight:
    decision: RouteDecision
    app_plan: Plan | None
    replica: int
    prefix_tokens: int
    spans: list[tuple[int, int]]
    hashes: list[BlockHash]
    cached: int
    evicted: list[BlockHash]


def _chunk_blocks(
    spans: Sequence[tuple[int, int]], hashes: Sequence[BlockHash], block: int
) -> list[tuple[BlockHash, ...]]:
    # Block i covers tokens [i*block, (i+1)*block); it belongs to the chunk holding its last token.
    out: list[list[BlockHash]] = [[] for _ in spans]
    j = 0
    for i, h in enumerate(hashes):
        last = (i + 1) * block - 1
        while j < len(spans) and spans[j][1] <= last:
            j += 1
        if j == len(spans):
            break
        if spans[j][0] <= last:
            out[j].append(h)
    return [tuple(x) for x in out]


def simulate(
    trace: PreparedTrace,
    config: SimConfig,
    *,
    check_invariants: bool = False,
    timings: dict[str, list[int]] | None = None,
) -> SimResult:
    """Run ``trace`` through ``config.replicas`` simulated replicas. Deterministic given the
    config's seed (wall-clock decision timings aside): request i meets the same router state
    in every run, so per-request minima over repeated runs strip preemption from timings.
    ``timings``, if given, receives per-request ``route_ns`` (wall), ``cpu_ns`` and
    ``placement_ns`` (wall less ``plan()``). Cost: O(prompt tokens) hashing plus one
    routing decision per request; ``check_invariants`` (tests) checks the router after every
    request, O(state) each."""
    n, block, model = config.replicas, config.block_size, config.ttft_model
    now = [0.0]
    base = config.router or RouterConfig()
    router = Router(
        [f"r{i}" for i in range(n)],
        config.policy,
        replace(base, block_size=block, ttft_model=model),
        clock=lambda: now[0],
    )
    ids = router.replica_ids
    # A policy modelling an existing serving layer gets prompts the application already
    # ordered: one app planner (per app, blind to placement) orders every request and learns
    # from the serving replica's reuse report, as a client of one gateway URL would; it hears
    # no KV events (they are per replica).
    app_ordering = router.policy.app_ordering
    app_planner = (
        CraftPlanner(replace(router.planner_config, policy=app_ordering), clock=lambda: now[0])
        if app_ordering is not None
        else None
    )
    index_of = {rid: i for i, rid in enumerate(ids)}
    evicted_now: list[BlockHash] = []
    caches = [
        SimulatedPrefixCache(
            block, config.capacity_tokens, on_evict=lambda h: evicted_now.append(BlockHash(h))
        )
        for _ in range(n)
    ]
    mean_service = sum(model.predict(p) for p in trace.prompt_tokens) / len(trace.prompt_tokens)
    rate = config.load * n / mean_service
    rng = random.Random(config.seed)
    faults = sorted(config.faults, key=lambda f: f.at_request)
    histories: dict[ConversationId, tuple[int, ...]] = {}
    open_turn: dict[ConversationId, float] = {}  # finish time of each conversation's last turn
    free_at = [0.0] * n
    served = [0] * n
    pending: list[tuple[float, int, _InFlight]] = []
    ttfts: list[float] = []
    decision_ns: list[int] = []
    cpu_ns: list[int] = []
    placement_ns: list[int] = []
    prompt_total = cached_total = predicted_total = 0
    head = trace.assembler.head_ids
    t = 0.0

    def complete(item: _InFlight, at: float) -> None:
        now[0] = at
        d = item.decision
        replica = router.replica(d.replica)
        reused = 0
        if replica.healthy and replica.epoch == d.epoch:
            if config.kv_events:
                router.on_blocks_removed(d.replica, item.evicted, d.salt)
            for _, end in item.spans:
                if end // block * block > item.cached:
                    break
                reused += 1
            router.planner(d.replica, d.salt).commit(
                d.plan,
                prefix_tokens=item.prefix_tokens,
                chunk_token_counts=[e - s for s, e in item.spans],
                reused_chunks=reused,
                block_hashes=_chunk_blocks(item.spans, item.hashes, block),
            )
        router.finish(d)
        if app_planner is not None and item.app_plan is not None:
            kept = d.plan.turn == 1 and item.app_plan.keys == d.plan.keys
            if replica.healthy and replica.epoch == d.epoch and kept:
                app_planner.commit(
                    item.app_plan,
                    prefix_tokens=item.prefix_tokens,
                    chunk_token_counts=[e - s for s, e in item.spans],
                    reused_chunks=reused,
                )
            else:  # lost with its replica, or a later turn (its history is the replica's)
                app_planner.abort(item.app_plan)

    for i, request in enumerate(trace.requests):
        while faults and faults[0].at_request <= i:
            fault = faults.pop(0)
            if fault.up:
                router.mark_up(ids[fault.replica])
            else:
                router.mark_down(ids[fault.replica])
                caches[fault.replica].clear()
        while pending and pending[0][0] <= t:
            at, _, item = heapq.heappop(pending)
            complete(item, at)
        conv = request.conversation_id
        arrival = t
        if conv is not None and conv in open_turn:
            # A user sends the next turn after the previous answer: hold this turn until its
            # previous turn finished (completions up to then are applied first).
            arrival = max(t, open_turn[conv])
            while pending and pending[0][0] <= arrival:
                at, _, item = heapq.heappop(pending)
                complete(item, at)
        now[0] = arrival
        history = histories.get(conv, head) if conv is not None else head
        estimate = trace.prompt_tokens[i] + len(history) - len(head)
        chunks, app_plan = request.chunks, None
        if app_planner is not None:  # the app's step, not the router's: not timed
            app_plan = app_planner.plan(chunks)
            chunks = app_plan.ordered
        started, cpu_started = time.perf_counter_ns(), time.thread_time_ns()
        decision = router.route(chunks, prompt_tokens=estimate, conversation_id=conv)
        cpu_ns.append(time.thread_time_ns() - cpu_started)
        decision_ns.append(time.perf_counter_ns() - started)
        placement_ns.append(decision_ns[-1] - decision.plan_ns)
        r = index_of[decision.replica]
        if decision.plan.turn == 1:
            history = head
        tokens: list[int] = list(history)
        spans: list[tuple[int, int]] = []
        for chunk in decision.plan.ordered:
            start = len(tokens)
            tokens.extend(trace.assembler.chunk_ids(chunk))
            spans.append((start, len(tokens)))
        tokens.extend(trace.question_ids[i])
        evicted_now.clear()
        cached = caches[r].serve(tokens)
        item = _InFlight(
            decision, app_plan, r, len(history), spans,
            [BlockHash(h) for h in block_hashes(tokens, block)], cached, list(evicted_now),
        )
        if conv is not None:
            histories[conv] = tuple(tokens) + trace.answer_ids[i]
        service = model.predict(len(tokens) - cached, cached)
        finish = max(arrival, free_at[r]) + service
        free_at[r] = finish
        ttfts.append(finish - arrival)
        if conv is not None:
            open_turn[conv] = finish
        served[r] += 1
        prompt_total += len(tokens)
        cached_total += cached
        predicted_total += decision.predicted_cached_tokens
        heapq.heappush(pending, (finish, i, item))
        if check_invariants:
            router._check_invariants()
        t += rng.expovariate(rate)
    while pending:
        at, _, item = heapq.heappop(pending)
        complete(item, at)

    if timings is not None:
        timings["route_ns"] = decision_ns
        timings["cpu_ns"] = cpu_ns
        timings["placement_ns"] = placement_ns
    mean_served = sum(served) / n
    decision_us = [x / 1000 for x in decision_ns]
    cpu_us = [x / 1000 for x in cpu_ns]
    placement_us = [x / 1000 for x in placement_ns]
    return SimResult(
        replicas=n,
        policy=config.policy,
        capacity_tokens=config.capacity_tokens,
        requests=len(ttfts),
        cached_token_fraction=cached_total / prompt_total if prompt_total else 0.0,
        predicted_cached_fraction=predicted_total / prompt_total if prompt_total else 0.0,
        mean_ttft_ms=1000 * sum(ttfts) / len(ttfts),
        p99_ttft_ms=1000 * percentile(ttfts, 99),
        load_imbalance=max(served) / mean_served if mean_served else 0.0,
        requests_per_replica=tuple(served),
        decision_us_p50=percentile(decision_us, 50),
        decision_us_p99=percentile(decision_us, 99),
        decision_cpu_us_p50=percentile(cpu_us, 50),
        decision_cpu_us_p99=percentile(cpu_us, 99),
        placement_us_p50=percentile(placement_us, 50),
        placement_us_p99=percentile(placement_us, 99),
        rate_per_s=rate,
        rehomed_turns=router.stats.rehomed_turns,
        faults=router.stats.faults,
    )

