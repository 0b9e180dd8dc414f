"""Read a GGUF file's tensors without parsing its vocabulary (for the Gemma 3 conversion).

``gguf.GGUFReader`` (and transformers' loader built on it) turns every metadata value into
numpy views; for Gemma 3's 262,144-token vocabulary that alone took 50-100 s on a loaded
2-core machine, and transformers parses the file once for the config, once for the tokenizer
and once for the weights. This reader skips the metadata (strings and arrays are stepped
over by their lengths), reads the tensor table, and dequantizes each tensor with the public
``gguf.dequantize``: ~10 s for the whole 270M model.

For Gemma 3 it also maps llama.cpp's tensor names to transformers' ``Gemma3ForCausalLM``
names and undoes llama.cpp's ``+1`` on RMSNorm weights (Gemma's norm multiplies by
``1 + weight``; llama.cpp stores ``weight + 1``). The result was checked tensor by tensor
against ``Gemma3ForCausalLM.from_pretrained(gguf_file=...)``: identical in bf16.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8: string, 9: array are handled apart).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
           10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """A little-endian reader over a memory-mapped file; ``ValueError`` past its end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            msg = "truncated GGUF header"
            raise ValueError(msg)
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            msg = "truncated GGUF string"
            raise ValueError(msg)
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        """A scalar or string value; an array is skipped and stands as its length."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.unpack("IQ")
            if item == _STRING:
                for _ in range(n):
                    (length,) = self.unpack("Q")
                    self.pos += length
            elif item in _SCALAR:
                self.pos += struct.calcsize("<" + _SCALAR[item]) * n
            else:
                msg = f"unsupported GGUF array item type {item}"
                raise ValueError(msg)
            return n
        if kind not in _SCALAR:
            msg = f"unsupported GGUF value type {kind}"
            raise ValueError(msg)
        return self.unpack(_SCALAR[kind])[0]


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], Iterator[tuple[str, Any]]]:
    """``(scalar metadata, iterator of (gguf tensor name, float32 numpy array))``.

    Arrays in the metadata (vocabulary, scores) appear as their lengths. Tensors come in file
    order with torch's shape (GGUF lists dimensions fastest-first). ``ValueError`` for a file
    that is not GGUF v2/v3 or is truncated. Memory: one dequantized tensor at a time.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(blob))  # type: ignore[arg-type]  # an ndarray is a buffer
    if bytes(cur.buf[:4]) != _MAGIC:
        msg = f"{path} is not a GGUF file"
        raise ValueError(msg)
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("IQQ")
    if version not in (2, 3):
        msg = f"{path}: GGUF version {version} is not supported (2 or 3)"
        raise ValueError(msg)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        (kind,) = cur.unpack("I")
        meta[key] = cur.value(kind)
    table: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        dims = cur.unpack(f"{n_dims}Q")
        qtype, offset = cur.unpack("IQ")
        table.append((name, tuple(int(d) for d in dims), int(qtype), int(offset)))
    alignment = int(meta.get("general.alignment", 32))
    start = (cur.pos + alignment - 1) // alignment * alignment

    def tensors() -> Iterator[tuple[str, Any]]:
        for name, dims, qtype, offset in table:
            kind = GGMLQuantizationType(qtype)
            block, type_size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims))
            nbytes = count // block * type_size
            if start + offset + nbytes > len(blob):
                msg = f"{path}: tensor {name} lies past the end of the file (truncated?)"
                raise ValueError(msg)
            raw = np.asarray(blob[start + offset : start + offset + nbytes])
            rows = count // dims[0]
            values = dequantize(raw.reshape(rows, nbytes // rows), kind)
            yield name, values.reshape(tuple(reversed(dims)))

    return meta, tensors()


_GEMMA3_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA3_TOP = {"token_embd.weight": "model.embed_tokens.weight",
               "output_norm.weight": "model.norm.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gemma3_hf_name(gguf_name: str) -> str:
    """transformers' ``Gemma3ForCausalLM`` parameter name of a llama.cpp ``gemma3`` tensor;
    ``ValueError`` for a name this mapping does not know."""
    if gguf_name in _GEMMA3_TOP:
        return _GEMMA3_TOP[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match[2] not in _GEMMA3_LAYER:
        msg = f"unexpected tensor {gguf_name!r} in a gemma3 GGUF"
        raise ValueError(msg)
    return f"model.layers.{match[1]}.{_GEMMA3_LAYER[match[2]]}.weight"


def gemma3_state_dict(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(scalar metadata, {transformers name: bf16 torch tensor})`` of a llama.cpp ``gemma3``
    GGUF (norm weights shifted back by -1). ~10 s and ~0.6 GB for Gemma 3 270M."""
    import torch

    meta, tensors = read_gguf_tensors(path)
    if meta.get("general.architecture") != "gemma3":
        msg = f"{path} is a {meta.get('general.architecture')!r} GGUF, not gemma3"
        raise ValueError(msg)
    state: dict[str, Any] = {}
    for name, values in tensors:
        hf_name = gemma3_hf_name(name)
        tensor = torch.from_numpy(values.copy())
        if hf_name.endswith("norm.weight"):
            tensor = tensor - 1
        state[hf_name] = tensor.to(torch.bfloat16)
    return meta, state
