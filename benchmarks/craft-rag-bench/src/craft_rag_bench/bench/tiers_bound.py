"""The ``tiers`` suite's load-free bound: how many prompt tokens could any KV tier add?

No engine runs. Each request of a single-turn trace is planned by a fresh
:class:`~craft_rag.planner.CraftPlanner`, rendered token-exact with the bench's tokenizer and
chat format (:class:`~craft_rag.prompt.PromptAssembler`), looked up and inserted in a
:class:`~craft_rag.prefix_cache_sim.SimulatedPrefixCache` (vLLM's block-chained LRU prefix
cache; the last prompt token is never a hit), and committed with what the cache reused, as the
engine does: the CP-Tree hears every evicted block first (``on_blocks_removed``, the engine's KV
events), then the commit gives it the reused chunks and each chunk's block hashes. Requests are
served one after another (the tiers suite serves them so too).

The cache sizes (:func:`bound`):

- ``unbounded``: nothing is ever evicted. Every block any earlier request computed is a hit
  where it prefixes this prompt: no pool and no tier of any size or policy can cache more for
  the same order, so ``unbounded_craft`` is the ceiling of CRAFT + tiers (``unbounded_prefix``
  the same for the retriever's order);
- ``pool_only``: an LRU of the bench's pool (``pool_blocks``): CRAFT alone (and the retriever's
  order, ``pool_only_prefix``), load-free; on the 60-request SQuAD trace CRAFT's matched the
  engine's ``craft`` exactly (25,568 of 47,879 tokens) and the retriever order's was 160
  tokens above the engine's ``prefix`` (12,512 vs 12,352);
- ``pool_plus_tiers``: one LRU of pool + RAM-tier + disk-tier blocks, the tier sizes in bytes
  divided by one block's KV bytes (:func:`kv_block_bytes`), and the CP-Tree hears evictions
  from that whole hierarchy: the optimistic reading of the tiers (every tier-resident block
  is a hit wherever it extends the prompt's prefix, and the planner knows what the tiers hold).
  When pool + tiers hold the trace's distinct blocks it equals ``unbounded``.
  ``pool_plus_tiers_craft_blind``: the same cache, but the CP-Tree hears only the pool's
  evictions (a chunk-prefix the pool lost is no longer planned first, although a tier holds
  it; a tier hit it stumbles on is learnt again at commit), the planner before tier
  residency events.

``max_cached_ratio_over_craft`` = ``unbounded_craft`` over CRAFT alone (the engine's measured
``craft`` fraction when it ran, else ``pool_only_craft``): the largest cached-token ratio any
tier could give over CRAFT alone on this trace. Cost: O(prompt tokens) hashing per size plus
one plan and commit per request: seconds for 300 requests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from craft_rag.metrics import chunks_with_cached_blocks
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_cache_sim import SimulatedPrefixCache, block_hashes
from craft_rag.prompt import PromptAssembler
from craft_rag.trace import TraceRequest
from craft_rag.types import BlockHash

UNBOUNDED_BLOCKS = 1 << 40
"""Capacity of the ``unbounded`` cache: more blocks than any trace has (nothing evicted)."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
"""KV bytes per element of each KV dtype the CPU engine may use."""


@dataclass(frozen=True, slots=True)
class SimCounts:
    """Prompt and cached tokens of one simulated run; blocks the cache evicted and held at
    the end (without eviction: the distinct full blocks of the prompts sent)."""

    prompt_tokens: int
    cached_tokens: int
    evicted_blocks: int
    resident_blocks: int

    @property
    def fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _StepClock:
    """One second per call: the planner's clock, so a bound does not depend on wall time."""

    def __init__(self) -> None:
        self._now = 0.0

    def __call__(self) -> float:
        self._now += 1.0
        return self._now


def simulate_cached(
    trace: Sequence[TraceRequest],
    assembler: PromptAssembler,
    policy: str,
    block_size: int,
    capacity_blocks: int = UNBOUNDED_BLOCKS,
    *,
    heard_blocks: int | None = None,
) -> SimCounts:
    """Serve ``trace`` (single-turn, in order) under the ordering ``policy`` (``tree`` is
    CRAFT, ``retriever`` the retriever's order) against a prefix cache of ``capacity_blocks``
    blocks of ``block_size`` tokens (see the module). ``heard_blocks``: the CP-Tree hears the
    evictions of a second LRU of that many blocks fed the same prompts (the engine's pool
    alone: a planner blind to the tiers, as before tier residency events), not the cache's
    own. ``ValueError`` for a multi-turn request (its history is not modelled), an unknown
    policy (naming the valid ones) or a capacity below one block. Cost: O(prompt tokens) per
    cache plus one plan/commit per request."""
    if capacity_blocks < 1 or (heard_blocks is not None and heard_blocks < 1):
        msg = (f"capacity_blocks and heard_blocks must be >= 1, got {capacity_blocks} and "
               f"{heard_blocks}")
        raise ValueError(msg)
    planner = CraftPlanner(PlannerConfig(policy=policy), clock=_StepClock())
    evicted: list[BlockHash] = []

    def hear(h: bytes) -> None:
        evicted.append(BlockHash(h))

    cache = SimulatedPrefixCache(block_size, capacity_blocks * block_size,
                                 on_evict=hear if heard_blocks is None else None)
    heard = None if heard_blocks is None else SimulatedPrefixCache(
        block_size, heard_blocks * block_size, on_evict=hear)
    prompt_total = cached_total = 0
    for request in trace:
        if request.conversation_id is not None:
            msg = (f"request {request.id!r} is a conversation turn; the tiers bound covers "
                   "single-turn traces (craft-rag trace --dataset squad or hotpotqa)")
            raise ValueError(msg)
        plan = planner.plan(request.chunks)
        prompt = assembler.single_turn(plan.ordered, request.query)
        hashes = [BlockHash(h) for h in block_hashes(prompt.token_ids, block_size)]
        evicted.clear()
        cached = cache.serve(prompt.token_ids)
        if heard is not None:
            heard.serve(prompt.token_ids)
        if evicted:  # the engine's KV events reach the CP-Tree before the commit
            planner.on_blocks_removed(evicted)
        spans = prompt.chunk_spans
        planner.commit(
            plan,
            prefix_tokens=prompt.prefix_tokens,
            chunk_token_counts=[end - start for start, end in spans],
            reused_chunks=chunks_with_cached_blocks(spans, cached, block_size),
            block_hashes=_per_chunk(hashes, spans, block_size),
        )
        prompt_total += prompt.num_tokens
        cached_total += cached
    return SimCounts(prompt_total, cached_total, cache.evicted_blocks, len(cache))


def _per_chunk(
    hashes: Sequence[BlockHash], spans: Sequence[tuple[int, int]], block_size: int
) -> list[list[BlockHash]]:
    # Block j belongs to the chunk holding its last token, (j + 1) * block_size - 1, as the
    # engine's BlockHasher.per_chunk assigns them.
    return [[hashes[j] for j in range(start // block_size, min(end // block_size, len(hashes)))]
            for start, end in spans]


def kv_block_bytes(config: dict[str, Any], block_size: int, dtype: str) -> int:
    """KV bytes of one block of ``block_size`` tokens for a Hugging Face model ``config``
    (``num_hidden_layers`` x ``num_key_value_heads`` x ``head_dim`` x 2 (K and V) x tokens x
    the dtype's bytes; ``head_dim`` defaults to ``hidden_size / num_attention_heads``), the
    payload the connector stores per block. ``ValueError`` for a config missing those fields
    or an unknown dtype (naming :data:`DTYPE_BYTES`)."""
    if dtype not in DTYPE_BYTES:
        msg = f"unknown KV dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}"
        raise ValueError(msg)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_attention_heads") or 0)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        msg = (f"the model config lacks the KV shape ({e!r}); it needs num_hidden_layers, "
               "num_key_value_heads or num_attention_heads, and head_dim or hidden_size")
        raise ValueError(msg) from None
    return layers * kv_heads * head_dim * 2 * block_size * DTYPE_BYTES[dtype]


def model_block_bytes(block_size: int) -> int:
    """:func:`kv_block_bytes` of the bench's model (``config.json`` in the default model
    folder) in the dtype the engine would run (:func:`craft_rag.engine.cpu_dtype.default_dtype`).
    Reads one small file."""
    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.paths import default_model_dir

    path = Path(default_model_dir()) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        msg = f"{path} is not a JSON object; prepare the model again"
        raise ValueError(msg)
    return kv_block_bytes(config, block_size, default_dtype())


def bound(
    trace: Sequence[TraceRequest],
    assembler: PromptAssembler,
    *,
    block_size: int,
    pool_blocks: int,
    ram_bytes: int,
    disk_bytes: int,
    block_bytes: int,
    craft_measured: float | None = None,
) -> dict[str, Any]:
    """The load-free bound of one workload (see the module): cached-token fractions of CRAFT's
    order (``tree``) and the retriever's (``prefix``) without eviction and on the pool alone,
    of CRAFT on pool + tiers, and ``max_cached_ratio_over_craft``, with the sizes used.
    ``craft_measured``: the engine's ``craft`` cached fraction when it ran (the ratio's
    denominator; else ``pool_only_craft``). ``ValueError`` for a block size below 1 byte."""
    if block_bytes < 1:
        msg = f"block_bytes must be >= 1, got {block_bytes}"
        raise ValueError(msg)
    ram_blocks, disk_blocks = ram_bytes // block_bytes, disk_bytes // block_bytes
    runs = {
        "unbounded_craft": simulate_cached(trace, assembler, "tree", block_size),
        "unbounded_prefix": simulate_cached(trace, assembler, "retriever", block_size),
        "pool_only_craft": simulate_cached(trace, assembler, "tree", block_size, pool_blocks),
        "pool_only_prefix": simulate_cached(
            trace, assembler, "retriever", block_size, pool_blocks),
        "pool_plus_tiers_craft": simulate_cached(
            trace, assembler, "tree", block_size, pool_blocks + ram_blocks + disk_blocks),
        "pool_plus_tiers_craft_blind": simulate_cached(
            trace, assembler, "tree", block_size, pool_blocks + ram_blocks + disk_blocks,
            heard_blocks=pool_blocks),
    }
    out: dict[str, Any] = {name: counts.fraction for name, counts in runs.items()}
    reference = craft_measured if craft_measured is not None else out["pool_only_craft"]
    out["max_cached_ratio_over_craft"] = (
        out["unbounded_craft"] / reference if reference else None)
    out["ratio_reference"] = "craft_measured" if craft_measured is not None else "pool_only_craft"
    out["pool_plus_tiers_ratio_over_craft"] = (
        out["pool_plus_tiers_craft"] / reference if reference else None)
    out["pool_blocks"] = pool_blocks
    out["block_bytes"] = block_bytes
    out["tier_blocks"] = {"ram": ram_blocks, "disk": disk_blocks}
    out["distinct_blocks"] = runs["unbounded_craft"].resident_blocks
    out["evicted_blocks"] = {name: counts.evicted_blocks for name, counts in runs.items()}
    out["prompt_tokens"] = runs["unbounded_craft"].prompt_tokens
    return out

