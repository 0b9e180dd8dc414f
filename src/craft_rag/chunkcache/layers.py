"""A readable Llama layer loop over a subset of tokens, against an explicit per-layer K/V.

This is the one forward pass the chunk-cache code runs by hand. It computes the layers for the
*selected* tokens only; every other token is represented by its cached K/V. For each layer:

1. the selected tokens' hidden states give new Q/K/V (RoPE at their positions);
2. the new K/V overwrite the cached K/V at those tokens' slots;
3. the selected queries attend over the whole assembled K/V of that layer with the causal rule
   "key position <= query position";
4. attention output, residual, MLP and residual as in ``LlamaDecoderLayer``.

With every token selected and empty caches this is an ordinary prefill (a test checks it
against the HF forward). Cost per layer: O(n_sel x T x hidden) for attention plus
O(n_sel x layer parameters) for the projections and MLP, T = tokens in the span. Memory:
one ``[heads, n_sel, T]`` score matrix at a time.

Model handles come from :func:`load_model` (HF ``LlamaForCausalLM`` in fp32, eager attention);
only the submodules named in ``LlamaDecoderLayer`` are used, so any Llama-shaped model works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from craft_rag.chunkcache.rope import RopeSpec, rerotate_keys

if TYPE_CHECKING:
    import torch

AttentionObserver = Callable[[int, "torch.Tensor"], None]
"""Called as ``observer(layer, probs)`` with the ``[heads, n_sel, T]`` attention probabilities
of each layer (fp32), before they are used. Must not modify ``probs``."""


@dataclass(frozen=True, slots=True)
class LayerKV:
    """Per-layer keys and values of a token span, HF layout without the batch dimension:
    ``keys[l]`` and ``values[l]`` are ``[kv_heads, tokens, head_dim]``. Keys carry RoPE at
    ``positions``. Invariant: every layer has the same token count as ``positions``."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: torch.Tensor

    def __post_init__(self) -> None:
        n = int(self.positions.shape[0])
        assert len(self.keys) == len(self.values)
        assert all(k.shape[-2] == n and v.shape[-2] == n
                   for k, v in zip(self.keys, self.values, strict=True))

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def slice(self, start: int, end: int) -> LayerKV:
        """Tokens ``[start, end)`` (views, no copy)."""
        return LayerKV(tuple(k[:, start:end] for k in self.keys),
                       tuple(v[:, start:end] for v in self.values), self.positions[start:end])

    def moved_to(self, start: int, rope: RopeSpec) -> LayerKV:
        """The same tokens placed contiguously from position ``start`` (keys re-rotated by
        each token's shift; values unchanged). Cost O(total K size)."""
        import torch

        new_pos = torch.arange(start, start + self.num_tokens, dtype=torch.int64,
                               device=self.positions.device)
        delta = new_pos - self.positions
        return LayerKV(tuple(rerotate_keys(k, delta, rope) for k in self.keys), self.values,
                       new_pos)

    @staticmethod
    def concat(parts: Sequence[LayerKV]) -> LayerKV:
        """Spans one after the other (copies)."""
        import torch

        layers = len(parts[0].keys)
        return LayerKV(
            tuple(torch.cat([p.keys[i] for p in parts], dim=1) for i in range(layers)),
            tuple(torch.cat([p.values[i] for p in parts], dim=1) for i in range(layers)),
            torch.cat([p.positions for p in parts]),
        )


def load_model(folder: str | Path) -> Any:
    """An HF causal LM from a local folder in fp32 with eager attention, in eval mode. Reads
    the folder only (no hub). ``RuntimeError`` with an install hint without transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        msg = "chunk-caches need torch and transformers: pip install 'craft-rag[model]'"
        raise RuntimeError(msg) from e
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def rope_of(model: Any) -> RopeSpec:
    """The model's :class:`RopeSpec` (from its config)."""
    return RopeSpec.from_config(model.config)


def device_of(model: Any) -> torch.device:
    """Where the model's weights live; every tensor these modules create goes there."""
    dev: torch.device = next(model.parameters()).device
    return dev


def embed(model: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """Input embeddings ``[n, hidden]`` of 1-D ``token_ids``."""
    out: torch.Tensor = model.model.embed_tokens(token_ids)
    return out


def run_layers(
    model: Any,
    hidden: torch.Tensor,
    selected: torch.Tensor,
    kv: LayerKV,
    *,
    layers: range | None = None,
    observer: AttentionObserver | None = None,
) -> tuple[torch.Tensor, LayerKV]:
    """Run ``layers`` (default: all) for the tokens at slots ``selected`` of the span ``kv``.

    ``hidden`` is ``[n_sel, hidden]`` (the selected tokens' input to the first layer run);
    ``selected`` holds slot indices into ``kv`` (any order, no repeats). Returns the selected
    tokens' output hidden states (before the final norm) and a new :class:`LayerKV` whose run
    layers hold the recomputed K/V at the selected slots and the cached K/V elsewhere; ``kv``
    itself is not modified. Cost: see the module docstring.
    """
    import torch

    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = rope_of(model)
    q_pos = kv.positions[selected]
    cos, sin = rope.cos_sin(q_pos)
    cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
    # Causal rule by position: a query sees every key at its own position or earlier.
    visible = kv.positions[None, :] <= q_pos[:, None]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    mask = mask.masked_fill(~visible, float("-inf"))
    keys = list(kv.keys)
    values = list(kv.values)
    h = hidden
    n = int(selected.shape[0])
    for li in layers if layers is not None else range(len(model.model.layers)):
        layer = model.model.layers[li]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(n, heads, head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(n, kv_heads, head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(n, kv_heads, head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys[li] = keys[li].index_copy(1, selected, k)
        values[li] = values[li].index_copy(1, selected, v)
        group = heads // kv_heads
        k_all = keys[li].repeat_interleave(group, dim=0)
        v_all = values[li].repeat_interleave(group, dim=0)
        scores = (q @ k_all.transpose(1, 2)) * attn.scaling + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if observer is not None:
            observer(li, probs)
        out = (probs @ v_all).transpose(0, 1).reshape(n, heads * head_dim)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, LayerKV(tuple(keys), tuple(values), kv.positions)


def empty_kv(model: Any, positions: torch.Tensor) -> LayerKV:
    """Zero K/V for a span at ``positions`` (every slot to be computed by :func:`run_layers`)."""
    import torch

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_key_value_heads, int(positions.shape[0]), head_dim)
    layers = len(model.model.layers)
    dev = device_of(model)
    return LayerKV(tuple(torch.zeros(shape, device=dev) for _ in range(layers)),
                   tuple(torch.zeros(shape, device=dev) for _ in range(layers)),
                   positions.to(dev))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
