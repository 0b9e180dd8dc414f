"""Selective recomputation (the reference, in plain torch): a prompt's KV assembled from an exact
head, chunk-caches moved to new positions, and a few recomputed tokens.

:func:`blend_prefill` places the chunks one after the other after the head, re-rotates their keys
to the new positions, then runs every layer for the selected tokens only
(:func:`craft_rag.chunkcache.layers.run_layers`): their new K/V replace the cached K/V in place
and their queries attend over the assembled K/V with the causal rule. Unselected tokens keep
their cached K/V in every layer. Invariants (tested on the real model):

* every token selected: the result equals :func:`full_prefill` of the same tokens;
* no token selected: the result equals :func:`assemble` (naive reuse).

Cost of :func:`blend_prefill`: O(L x (n_sel x T x hidden + n_sel x layer parameters)) with
``n_sel`` selected tokens, ``T`` span tokens and ``L`` layers, plus O(T x kv size) to move keys;
a full prefill is the same with ``n_sel = T``.

After the span, :func:`continue_greedy` prefills the question on top with the HF model and
decodes greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.chunkcache.layers import (
    AttentionObserver,
    LayerKV,
    device_of,
    embed,
    rope_of,
    run_layers,
)
from craft_rag.chunkcache.selection import Selection
from craft_rag.chunkcache.variants import ChunkKV

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Assembled:
    """A span's token ids and KV, with each chunk's ``[start, end)`` slots in it. Invariant:
    ``kv.positions == range(len(token_ids))``."""

    token_ids: tuple[int, ...]
    kv: LayerKV
    spans: tuple[tuple[int, int], ...]
    recomputed: int = 0


def full_prefill(model: Any, token_ids: Sequence[int]) -> LayerKV:
    """The reference: HF's own forward over ``token_ids`` from position 0, its cache as a
    :class:`LayerKV`. Cost: one prefill."""
    import torch

    dev = device_of(model)
    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=dev)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return from_hf_cache(out.past_key_values, torch.arange(len(token_ids), device=dev))


def from_hf_cache(cache: Any, positions: torch.Tensor) -> LayerKV:
    """A batch-1 HF cache (``DynamicCache``) as a :class:`LayerKV` (views, no copy)."""
    layers = cache.layers
    return LayerKV(tuple(layer.keys[0] for layer in layers),
                   tuple(layer.values[0] for layer in layers), positions)


def to_hf_cache(kv: LayerKV) -> Any:
    """A fresh ``DynamicCache`` holding ``kv`` (batch 1), for HF's forward / generate."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
        cache.update(k[None].clone(), v[None].clone(), i)
    return cache


def assemble(model: Any, head_ids: Sequence[int], head_kv: LayerKV,
             chunks: Sequence[ChunkKV]) -> Assembled:
    """Naive reuse: the head's exact KV, then each chunk's cached KV moved to its new
    position, nothing recomputed. ``ValueError`` if ``head_kv`` does not cover ``head_ids``
    from position 0 or a chunk comes from another model shape."""
    import torch

    if head_kv.num_tokens != len(head_ids) or not torch.equal(
            head_kv.positions.cpu(), torch.arange(len(head_ids))):
        msg = "head_kv must hold exactly the head's tokens at positions 0..len(head_ids)-1"
        raise ValueError(msg)
    rope = rope_of(model)
    parts = [head_kv]
    spans: list[tuple[int, int]] = []
    start = len(head_ids)
    ids = list(head_ids)
    for c in chunks:
        if len(c.kv.keys) != len(head_kv.keys) or c.kv.keys[0].shape[::2] != \
                head_kv.keys[0].shape[::2]:
            msg = f"chunk-cache {c.chunk_hash[:12]} has another KV shape: wrong model?"
            raise ValueError(msg)
        parts.append(c.kv.moved_to(start, rope))
        spans.append((start, start + c.num_tokens))
        ids.extend(c.token_ids)
        start += c.num_tokens
    return Assembled(tuple(ids), LayerKV.concat(parts), tuple(spans))


def blend_prefill(model: Any, head_ids: Sequence[int], head_kv: LayerKV,
                  chunks: Sequence[ChunkKV], selection: Selection, *,
                  observer: AttentionObserver | None = None) -> Assembled:
    """:func:`assemble`, then recompute ``selection``'s tokens through every layer against the
    assembled KV. ``observer`` sees each layer's attention of the selected tokens (rows in
    chunk order, then index order; :data:`~craft_rag.chunkcache.layers.AttentionObserver`).
    ``ValueError`` when the selection does not fit the chunks. Cost: see the module
    docstring."""
    import torch

    if len(selection.per_chunk) != len(chunks):
        msg = f"selection has {len(selection.per_chunk)} chunks, the prompt {len(chunks)}"
        raise ValueError(msg)
    base = assemble(model, head_ids, head_kv, chunks)
    slots: list[int] = []
    for (start, end), picked in zip(base.spans, selection.per_chunk, strict=True):
        if any(not 0 <= i < end - start for i in picked):
            msg = f"selected token index out of range for a chunk of {end - start} tokens"
            raise ValueError(msg)
        slots.extend(start + i for i in picked)
    if not slots:
        return base
    dev = device_of(model)
    sel = torch.tensor(slots, dtype=torch.int64, device=dev)
    ids = torch.tensor([base.token_ids[i] for i in slots], dtype=torch.int64, device=dev)
    with torch.no_grad():
        _, kv = run_layers(model, embed(model, ids), sel, base.kv, observer=observer)
    return Assembled(base.token_ids, kv, base.spans, recomputed=len(slots))


@dataclass(frozen=True, slots=True)
class Continuation:
    """The next-token logits after the prompt (``[vocab]``, fp32) and the greedy tokens."""

    first_logits: torch.Tensor
    tokens: tuple[int, ...]


def continue_greedy(model: Any, kv: LayerKV, tail_ids: Sequence[int], max_new_tokens: int,
                    *, eos_ids: frozenset[int] = frozenset()) -> Continuation:
    """Prefill ``tail_ids`` (the question) on top of the span ``kv`` with the HF model, then
    decode greedily up to ``max_new_tokens`` tokens (stopping after an ``eos_ids`` token).
    ``kv`` is not modified. Cost: one prefill of the tail plus one step per token."""
    return continue_greedy_batch(model, [kv], tail_ids, max_new_tokens, eos_ids=eos_ids)[0]


def continue_greedy_batch(model: Any, kvs: Sequence[LayerKV], tail_ids: Sequence[int],
                          max_new_tokens: int, *, eos_ids: frozenset[int] = frozenset()
                          ) -> list[Continuation]:
    """:func:`continue_greedy` for several spans of the same length at once (one batch: the
    variants of one prompt). Each result is cut after its first ``eos_ids`` token; the batch
    runs until every row stopped or ``max_new_tokens``. ``ValueError`` for spans of different
    lengths or an empty tail. Cost: one batched tail prefill plus one batched step per token."""
    import torch

    if not tail_ids:
        msg = "tail_ids is empty: the question must add at least one token"
        raise ValueError(msg)
    if not kvs or len({kv.num_tokens for kv in kvs}) != 1:
        msg = "continue_greedy_batch needs one or more spans of the same length"
        raise ValueError(msg)
    from transformers import DynamicCache

    dev = device_of(model)
    batch = len(kvs)
    cache = DynamicCache()
    for i in range(len(kvs[0].keys)):
        cache.update(torch.stack([kv.keys[i] for kv in kvs]),
                     torch.stack([kv.values[i] for kv in kvs]), i)
    pos = kvs[0].num_tokens
    ids = torch.tensor([list(tail_ids)] * batch, dtype=torch.int64, device=dev)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    first: torch.Tensor | None = None
    with torch.no_grad():
        for _ in range(max(1, max_new_tokens)):
            position_ids = torch.arange(pos, pos + ids.shape[1], device=dev)[None].expand(
                batch, -1)
            out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache,
                        use_cache=True)
            logits = out.logits[:, -1].to(torch.float32)
            if first is None:
                first = logits
            pos += int(ids.shape[1])
            nxt = logits.argmax(dim=-1)
            for b, t in enumerate(nxt.tolist()):
                if not done[b]:
                    tokens[b].append(int(t))
                    done[b] = int(t) in eos_ids or len(tokens[b]) >= max_new_tokens
            if all(done):
                break
            ids = nxt[:, None]
    assert first is not None
    return [Continuation(first[b], tuple(tokens[b])) for b in range(batch)]
