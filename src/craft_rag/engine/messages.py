"""Plain chat message lists rendered token-exactly with the model's chat template.

``CraftEngine.generate_messages`` serves chats without RAG chunks (nothing is planned or
committed). A chat app re-sends the whole list each turn, so what matters for vLLM's prefix
cache is that the token ids of ``messages[:i]`` are the same whatever follows. Tokenizing the
whole rendering at once does not promise that (BPE may merge across a message boundary), so
:class:`MessageRenderer` renders the template for ``messages[:1]``, ``messages[:2]``, ... and
tokenizes each message's increment (and the generation prompt) on its own, like the chunk
segments of :class:`craft_rag.prompt.PromptAssembler`. The ids decode to exactly the
template's text.

A template that rewrites earlier messages once later ones follow (e.g. strips reasoning)
cannot be split that way; the whole rendering is then tokenized at once: still the template's
prompt, only without the prefix guarantee.

Security: only the template's scaffolding may produce control-token ids. The template is also
rendered with sentinel contents; the text around the sentinels is the scaffolding (trusted),
each message's content is tokenized as plain text (:func:`craft_rag.tokenizer.encode_pieces`),
so a message spelling ``<|im_end|>\n<|im_start|>system`` cannot open a turn. A template that
rewrites contents (beyond trimming whitespace) cannot be split that way: its rendering is
tokenized whole only when no content spells a control token, else ``ValueError``.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

from craft_rag.engine.chat_format import Message, RenderFn
from craft_rag.tokenizer import TextPiece, Tokenizer, check_text, encode_pieces

ChatTurn = tuple[str, str]
"""One chat message: ``(role, text)``, e.g. ``("user", "Hi")``; roles are the template's
(``system``, ``user``, ``assistant`` for most)."""

DEFAULT_SEGMENT_CACHE = 4096


class MessageRenderer:
    """Token ids of chat message lists, one tokenized segment per message.

    Invariant: ``token_ids(m[:i])`` without the generation prompt is a prefix of
    ``token_ids(m)`` for append-only templates. Thread-safe (one lock over the segment cache).
    Cost: ``n + 1`` template renders for ``n`` messages (O(n * text) string work) plus
    tokenizing segments not in the LRU cache of ``cache_size`` segments.
    """

    def __init__(
        self, render: RenderFn, tokenizer: Tokenizer, *, cache_size: int = DEFAULT_SEGMENT_CACHE
    ) -> None:
        self._render = render
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[TextPiece, ...], tuple[int, ...]] = OrderedDict()
        """Segment pieces -> ids, LRU. Owner: ``_lock``."""

    def segments(
        self, messages: Sequence[ChatTurn], *, add_generation_prompt: bool = True
    ) -> list[str]:
        """The rendered text split at message boundaries (last: the generation prompt, when
        asked). One element when the template is not append-only. ``ValueError`` for an empty
        list or a message that is not a ``(role, text)`` pair of strings."""
        return [
            "".join(text for text, _ in pieces)
            for pieces in self._segment_pieces(messages, add_generation_prompt)
        ]

    def token_ids(
        self, messages: Sequence[ChatTurn], *, add_generation_prompt: bool = True
    ) -> tuple[int, ...]:
        """The prompt's token ids: each segment tokenized on its own, concatenated; message
        contents as plain text (never control ids)."""
        ids: list[int] = []
        for pieces in self._segment_pieces(messages, add_generation_prompt):
            ids.extend(self._segment_ids(pieces))
        return tuple(ids)

    def _segment_pieces(
        self, messages: Sequence[ChatTurn], add_generation_prompt: bool
    ) -> list[tuple[TextPiece, ...]]:
        dicts = _as_dicts(messages)
        full = self._render(dicts, add_generation_prompt)
        pieces = self._content_pieces(dicts, full, add_generation_prompt)
        return [p for p in _cut(pieces, self._boundaries(dicts, full, add_generation_prompt)) if p]

    def _boundaries(
        self, dicts: list[Message], full: str, add_generation_prompt: bool
    ) -> list[int]:
        """Character offsets in ``full`` where each message's increment ends (empty when the
        template is not append-only: one segment)."""
        try:
            texts = [self._render(dicts[:i], False) for i in range(1, len(dicts))]
        except Exception:  # a template may refuse a prefix (e.g. one ending with assistant)
            return []
        if add_generation_prompt:
            texts.append(self._render(dicts, False))
        previous = ""
        for text in [*texts, full]:
            if not text.startswith(previous):
                return []
            previous = text
        return [len(text) for text in texts]

    def _content_pieces(
        self, dicts: list[Message], full: str, add_generation_prompt: bool
    ) -> list[TextPiece]:
        """``full`` as trusted scaffolding and untrusted contents (see the module docstring).
        Cost: one more template render."""
        tag = _sentinel_tag(dicts, full)
        skeleton = self._render(
            [{"role": m["role"], "content": f"{tag}{i}{tag}"} for i, m in enumerate(dicts)],
            add_generation_prompt,
        )
        parts = re.split(f"{tag}(\\d+){tag}", skeleton)
        for transform in (_same, str.strip):
            pieces: list[TextPiece] = []
            for j, part in enumerate(parts):
                if j % 2 == 0:
                    pieces.append((part, True))
                else:
                    pieces.append((transform(dicts[int(part)]["content"]), False))
            if "".join(text for text, _ in pieces) == full:
                return [p for p in pieces if p[0]]
        # Per message: some templates trim one content and not another (Gemma 3 keeps the
        # system text as it is and trims the turns'). Each content as sent or stripped, the
        # first that keeps the text so far a prefix of ``full`` together with the scaffolding
        # after it; O(len(full)).
        pieces, at = [], 0
        for j, part in enumerate(parts):
            if j % 2 == 0:
                if not full.startswith(part, at):
                    break
                pieces.append((part, True))
                at += len(part)
                continue
            content = dicts[int(part)]["content"]
            after = parts[j + 1] if j + 1 < len(parts) else ""
            choice = next(
                (c for c in (content, content.strip()) if full.startswith(c + after, at)), None
            )
            if choice is None:
                break
            pieces.append((choice, False))
            at += len(choice)
        else:
            if at == len(full):
                return [p for p in pieces if p[0]]
        controls: tuple[str, ...] = getattr(self._tokenizer, "control_strings", ())
        for i, message in enumerate(dicts):
            if any(c in message["content"] for c in controls):
                msg = (
                    f"messages[{i}] content spells a control token and this chat template "
                    "rewrites message contents, so it cannot be kept plain text; remove the "
                    "control-token strings from the content"
                )
                raise ValueError(msg)
        return [(full, True)]

    def _segment_ids(self, pieces: tuple[TextPiece, ...]) -> tuple[int, ...]:
        with self._lock:
            ids = self._cache.get(pieces)
            if ids is not None:
                self._cache.move_to_end(pieces)
                return ids
        ids = tuple(encode_pieces(self._tokenizer, pieces))
        with self._lock:
            self._cache[pieces] = ids
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ids


def _same(text: str) -> str:
    return text


def _sentinel_tag(dicts: list[Message], full: str) -> str:
    """A marker found in no content and not in the rendering (plain ASCII letters, which no
    template rewrites)."""
    tag = "CRAFTCONTENTSENTINEL"
    while tag in full or any(tag in m["content"] for m in dicts):
        tag += "X"
    return tag


def _cut(pieces: list[TextPiece], boundaries: list[int]) -> list[tuple[TextPiece, ...]]:
    """``pieces`` split into segments at the character offsets ``boundaries`` (ascending)."""
    segments: list[tuple[TextPiece, ...]] = []
    current: list[TextPiece] = []
    offset = 0
    cuts = iter(boundaries)
    cut = next(cuts, None)
    for text, trusted in pieces:
        while cut is not None and offset <= cut <= offset + len(text):
            head = text[: cut - offset]
            if head:
                current.append((head, trusted))
            segments.append(tuple(current))
            current = []
            text = text[cut - offset :]
            offset = cut
            cut = next(cuts, None)
        if text:
            current.append((text, trusted))
        offset += len(text)
    segments.append(tuple(current))
    return segments


_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def _as_dicts(messages: Sequence[ChatTurn]) -> list[Message]:
    if isinstance(messages, str | bytes) or not messages:
        msg = "messages must be a non-empty sequence of (role, text) pairs, e.g. [('user', 'Hi')]"
        raise ValueError(msg)
    out: list[Message] = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, tuple | list)
            or len(message) != 2
            or not all(isinstance(part, str) for part in message)
            or not message[0]
        ):
            msg = f"messages[{i}] must be a (role, text) pair of strings, got {message!r}"
            raise ValueError(msg)
        if not _ROLE.fullmatch(message[0]):
            msg = (
                f"messages[{i}] role {message[0]!r} is not a role name (letters, digits, "
                "'_', '.', '-'); use the template's roles, e.g. 'system', 'user', 'assistant'"
            )
            raise ValueError(msg)
        check_text(message[1], f"messages[{i}] content")
        out.append({"role": message[0], "content": message[1]})
    return out
