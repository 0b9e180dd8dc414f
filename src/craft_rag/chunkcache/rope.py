"""Moving cached keys to another position: RoPE is a rotation, so K at p+d = R(d) K at p.

A Llama key is rotated by the angle ``position * inv_freq`` in each of ``head_dim / 2`` planes
(HF's "rotate_half" pairing: dimension ``i`` with ``i + head_dim/2``). Rotations in a plane
compose by adding angles, so a key computed at position ``p`` is moved to ``p + d`` by rotating
it by ``d * inv_freq`` alone; no token or hidden state is needed. Values carry no position and
are reused unchanged.

The move is exact only for RoPE variants whose frequencies do not depend on the sequence
length: ``default``, ``linear``, ``llama3`` and ``yarn`` (yarn also scales cos/sin by a
constant, which was applied once when the key was computed and must not be applied again).
``dynamic`` and ``longrope`` change ``inv_freq`` with the length; :meth:`RopeSpec.from_config`
refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE types whose rotation angle is ``position * inv_freq`` with a fixed ``inv_freq``."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The rotation frequencies of one model. Invariant: ``inv_freq`` is 1-D, fp32, with
    ``head_dim / 2`` entries (one per rotation plane)."""

    inv_freq: torch.Tensor
    rope_type: str
    attention_scaling: float = 1.0
    """Constant factor on cos/sin when a key is first computed (yarn); never re-applied by
    :func:`rerotate_keys`."""

    @property
    def head_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    @classmethod
    def from_config(cls, config: Any) -> RopeSpec:
        """Frequencies of an HF Llama-family ``config`` (``rope_theta`` and ``rope_scaling`` /
        ``rope_parameters`` included), computed by transformers' own RoPE initialisers so they
        match the model bit for bit. ``ValueError`` naming the supported types otherwise."""
        import torch

        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
        if rope_type not in EXACT_ROPE_TYPES:
            msg = (f"RoPE type {rope_type!r} changes its frequencies with the sequence length, "
                   f"so cached keys cannot be moved exactly; supported: {list(EXACT_ROPE_TYPES)}")
            raise ValueError(msg)
        if rope_type == "default":
            base = float((params or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0)))
            dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads)
            # transformers' own fp32 arithmetic, so the angles match the model's exactly.
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            return cls(inv_freq=inv_freq, rope_type=rope_type)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return cls(inv_freq=inv_freq.to(torch.float32), rope_type=rope_type,
                   attention_scaling=float(scaling))

    def cos_sin(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles ``delta * inv_freq`` as ``[len(delta), head_dim]`` (fp32),
        in HF's layout (the half-size angle vector repeated twice). Cost O(len(delta) x d)."""
        import torch

        angles = delta.to(torch.float32)[:, None] * self.inv_freq.to(delta.device)[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Keys ``[..., tokens, head_dim]`` computed at positions ``p`` as they would be at
    ``p + delta``: ``k cos(d w) + rotate_half(k) sin(d w)``. ``delta`` is one shift for every
    token or one per token (``[tokens]``); negative shifts move keys earlier. Returns a new
    tensor in the keys' dtype (the arithmetic runs in fp32). Cost O(keys.numel()).

    ``ValueError`` when the last dimension is not the spec's ``head_dim``."""
    import torch

    if keys.shape[-1] != rope.head_dim:
        msg = f"keys have head_dim {keys.shape[-1]}, the RoPE spec {rope.head_dim}: wrong model?"
        raise ValueError(msg)
    tokens = keys.shape[-2]
    shift = (torch.full((tokens,), int(delta), dtype=torch.int64) if isinstance(delta, int)
             else delta.to(torch.int64).reshape(-1))
    if shift.shape[0] != tokens:
        msg = f"delta has {shift.shape[0]} entries for {tokens} tokens; give one or one per token"
        raise ValueError(msg)
    cos, sin = rope.cos_sin(shift.to(keys.device))
    k = keys.to(torch.float32)
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)
