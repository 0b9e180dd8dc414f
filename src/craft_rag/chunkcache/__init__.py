"""Chunk-caches (Cache-Craft / CacheBlend): a chunk's KV reused at another position and after
another context, fixed by recomputing a few tokens.

Framework-free math in plain torch + transformers (imported lazily by the functions that need
them); the vLLM connector builds on these functions.

* :mod:`.rope` -- :class:`RopeSpec`, :func:`rerotate_keys` (K at p+d = R(d) K at p);
* :mod:`.layers` -- :class:`LayerKV` and the hand-written Llama layer loop :func:`run_layers`;
* :mod:`.variants` -- :class:`ChunkKV` (one variant, its CCI) and :func:`compute_chunk_kv`;
* :mod:`.selection` -- count rules (fixed share, Cache-Craft CFO) and rankers (``cci``,
  ``kv_deviation``, ``random``);
* :mod:`.blend` -- :func:`assemble` (naive reuse), :func:`blend_prefill` (selective
  recomputation), :func:`full_prefill` (the reference), :func:`continue_greedy`.
"""

from craft_rag.chunkcache.blend import (
    Assembled,
    Continuation,
    assemble,
    blend_prefill,
    continue_greedy,
    continue_greedy_batch,
    from_hf_cache,
    full_prefill,
    to_hf_cache,
)
from craft_rag.chunkcache.layers import LayerKV, load_model, rope_of, run_layers
from craft_rag.chunkcache.rope import RopeSpec, rerotate_keys
from craft_rag.chunkcache.selection import (
    RANKERS,
    RankInput,
    Selection,
    beta_prime,
    cfo,
    cfo_counts,
    fixed_counts,
    get_ranker,
    kendall_distance,
    select_tokens,
    select_top,
)
from craft_rag.chunkcache.variants import (
    ChunkKV,
    ContextHash,
    SegmentHash,
    compute_chunk_kv,
    context_hash,
    segment_hash,
)

__all__ = [
    "RANKERS",
    "Assembled",
    "ChunkKV",
    "ContextHash",
    "Continuation",
    "LayerKV",
    "RankInput",
    "RopeSpec",
    "SegmentHash",
    "Selection",
    "assemble",
    "beta_prime",
    "blend_prefill",
    "cfo",
    "cfo_counts",
    "compute_chunk_kv",
    "context_hash",
    "continue_greedy",
    "continue_greedy_batch",
    "fixed_counts",
    "from_hf_cache",
    "full_prefill",
    "get_ranker",
    "kendall_distance",
    "load_model",
    "rerotate_keys",
    "rope_of",
    "run_layers",
    "segment_hash",
    "select_tokens",
    "select_top",
    "to_hf_cache",
]
