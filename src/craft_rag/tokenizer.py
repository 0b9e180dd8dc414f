"""Tokenizers for prompt assembly and the replay simulator.

The embedded model's own tokenizer (``tokenizer.json`` of the prepared SmolLM2 folder, loaded
with the ``tokenizers`` library) is used when available. Otherwise the documented fallback,
:class:`HashingTokenizer`, splits text into words and punctuation (regex ``\\w+|[^\\w\\s]``) and
maps each piece to a stable 31-bit id; it over-counts tokens by ~10-30% versus BPE but keeps
segment boundaries exact, which is what prefix-reuse accounting needs.

Security rule: caller text (chunks, questions, chat messages, answers) is always tokenized as
plain text. Only trusted template text (a chat template's scaffolding, a prompt format's fixed
pieces) may produce control-token ids such as ``<|im_start|>``; :func:`encode_pieces` mixes
the two without changing how BPE merges benign text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from craft_rag.paths import default_model_dir


class Tokenizer(Protocol):
    """Anything that turns text into token ids without adding special tokens.

    ``encode`` must treat its text as plain text: a control-token string inside it (e.g.
    ``<|im_start|>``) is spelled out with ordinary tokens, never mapped to the control id. Text
    that may hold the template's own control tokens goes through :func:`encode_pieces`.
    """

    name: str

    def encode(self, text: str) -> list[int]: ...


TextPiece = tuple[str, bool]
"""``(text, trusted)``: trusted text (a chat template's scaffolding, a prompt format's fixed
pieces) may produce control-token ids; untrusted text (chunks, questions, messages, answers)
never does."""

_PIECE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def check_text(value: object, field: str) -> str:
    """``value`` if it is a string that can be tokenized, else ``ValueError`` naming ``field``.

    Refuses non-strings and lone surrogates (``"\\ud800"``: not valid Unicode, cannot be
    encoded as UTF-8, and the HF tokenizer would fail with ``TypeError``). O(len(value)).
    """
    if not isinstance(value, str):
        msg = f"{field} must be a string, got {type(value).__name__}"
        raise ValueError(msg)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            msg = (
                f"{field} holds a lone surrogate {value[exc.start]!r} at index {exc.start}, "
                "which is not valid Unicode text; decode the source with errors='replace' "
                "(or strip the surrogates) before passing it"
            )
            raise ValueError(msg) from None
    return value


class HashingTokenizer:
    """Fallback tokenizer: regex pieces -> blake2b-derived ids. Deterministic across runs.

    It has no control tokens, so every text is plain text."""

    name = "hashing-fallback"

    def encode(self, text: str) -> list[int]:
        check_text(text, "text")
        return [
            int.from_bytes(hashlib.blake2b(p.encode("utf-8"), digest_size=4).digest(), "big")
            & 0x7FFFFFFF
            for p in _PIECE.findall(text)
        ]


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no special tokens added).

    Two views of one vocabulary: :meth:`encode` tokenizes *plain text* with a copy of the
    tokenizer whose added-token list keeps only the non-special entries, so a document or
    question that spells ``<|im_end|>`` or ``<start_of_turn>`` gets ordinary tokens, never a
    control id (for text without special-token strings the ids are identical to the full
    tokenizer's: added tokens only ever split the input). :meth:`encode_template` parses
    added tokens (trusted template text only) and :meth:`encode_pieces` mixes both.
    Invariant: :meth:`encode` output holds no id of :attr:`control_ids`.

    Control tokens are the added tokens marked ``special``. SentencePiece vocabularies also
    add *non-special* tokens that are ordinary text: Gemma 3's ``"\n"``, ``"\n\n"``, tab
    runs and HTML tags such as ``<table>`` (llama.cpp's user-defined pieces). The model's own
    tokenizer produces them from plain text, so :meth:`encode` does too (anything else
    would not be token-exact, and a newline could not be tokenized at all). Byte-level BPE
    models such as SmolLM2 mark every added token special, so nothing changes for them.
    """

    def __init__(self, path: Path) -> None:
        import json

        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        data = json.loads(path.read_text(encoding="utf-8"))
        data["added_tokens"] = [t for t in data.get("added_tokens") or [] if not t["special"]]
        self._plain = _Tokenizer.from_str(json.dumps(data))
        special = {i: t for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.control_ids: frozenset[int] = frozenset(special)
        """Ids of the special added tokens: only trusted text may produce them."""
        self.control_strings: tuple[str, ...] = tuple(
            sorted({t.content for t in special.values() if t.content}, key=len, reverse=True)
        )
        self._controls = (
            re.compile("|".join(re.escape(s) for s in self.control_strings))
            if self.control_strings
            else None
        )
        self.name = f"hf:{path.parent.name}"

    def encode(self, text: str) -> list[int]:
        """Plain-text ids: control-token strings in ``text`` are spelled out. O(len(text))."""
        check_text(text, "text")
        ids = list(self._plain.encode(text, add_special_tokens=False).ids)
        if self.control_ids.isdisjoint(ids):
            return ids
        return self._spell_out(text)

    def _spell_out(self, text: str) -> list[int]:
        """Rare path: the plain BPE merged some text into a control id (its string is in the
        model vocabulary). Encode character by character instead, which no merge can reach;
        ``RuntimeError`` if even a single character maps to a control id."""
        ids: list[int] = []
        for char in text:
            piece = list(self._plain.encode(char, add_special_tokens=False).ids)
            if not self.control_ids.isdisjoint(piece):
                msg = f"the tokenizer maps the character {char!r} to a control token"
                raise RuntimeError(msg)
            ids.extend(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with control tokens spelled as their strings (the prompt as
        the model sees it; what the integrations report as the prompt sent). O(len(ids))."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def encode_template(self, text: str) -> list[int]:
        """Ids of trusted template text: added-token strings become their control ids (what
        ``tokenizers`` does by default). Never pass caller text here."""
        check_text(text, "template text")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_pieces(self, pieces: Sequence[TextPiece]) -> list[int]:
        """Ids of the concatenated pieces: control ids only where a *trusted* piece spells a
        control token; every stretch between them is tokenized as one plain string, so BPE
        merges across piece boundaries exactly as for the whole text. For text without
        control strings in untrusted pieces this equals :meth:`encode_template` of the
        concatenation. O(total length)."""
        ids: list[int] = []
        stretch: list[str] = []
        for text, trusted in pieces:
            if not trusted or self._controls is None or not self._controls.search(text):
                stretch.append(text)
                continue
            enc = self._tok.encode(text, add_special_tokens=False)
            start = 0
            for token_id, (begin, end) in zip(enc.ids, enc.offsets, strict=True):
                if token_id in self.control_ids:
                    stretch.append(text[start:begin])
                    ids.extend(self._flush(stretch))
                    ids.append(token_id)
                    start = end
            stretch.append(text[start:])
        ids.extend(self._flush(stretch))
        return ids

    def _flush(self, stretch: list[str]) -> list[int]:
        text = "".join(stretch)
        stretch.clear()
        return self.encode(text) if text else []


def encode_pieces(tokenizer: Tokenizer, pieces: Sequence[TextPiece]) -> list[int]:
    """``tokenizer.encode_pieces(pieces)`` when it has one (:class:`HFTokenizer`), else
    ``tokenizer.encode`` of the concatenation (a tokenizer without control tokens, such as
    :class:`HashingTokenizer`)."""
    mixed = getattr(tokenizer, "encode_pieces", None)
    if mixed is not None:
        return list(mixed(pieces))
    return tokenizer.encode("".join(text for text, _ in pieces))


def format_pieces(template: str, field: str, value: str) -> list[TextPiece]:
    """``template.format(**{field: value})`` as pieces: the template's literal text trusted,
    the value untrusted (``{{``/``}}`` escapes resolved). ``ValueError`` for any other
    placeholder. O(len(template) + len(value))."""
    import string

    pieces: list[TextPiece] = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if literal:
            pieces.append((literal, True))
        if name is None:
            continue
        if name != field or spec or conversion:
            msg = f"template {template!r} may only hold the placeholder {{{field}}}"
            raise ValueError(msg)
        pieces.append((value, False))
    return pieces


def load_tokenizer(model_dir: Path | None = None, *, fallback: bool = True) -> Tokenizer:
    """The tokenizer of ``model_dir`` (default: the prepared embedded model), or the hashing
    fallback when that folder has no ``tokenizer.json`` and ``fallback`` is true."""
    folder = model_dir if model_dir is not None else default_model_dir()
    path = folder / "tokenizer.json"
    if path.is_file():
        try:
            return HFTokenizer(path)
        except ImportError:
            if not fallback:
                raise
    if not fallback:
        msg = f"no tokenizer.json in {folder}; run `craft-rag model prepare` first"
        raise FileNotFoundError(msg)
    return HashingTokenizer()
