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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from craft_rag.engine.chat_format import Message, RenderFn
from craft_rag.tokenizer import Tokenizer

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
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # owner: _lock

    def segments(
        self, messages: Sequence[ChatTurn], *, add_generation_prompt: bool = True
    ) -> list[str]:
        """The rendered text split at message boundaries (last: the generation prompt, when
        asked). One element when the template is not append-only. ``ValueError`` for an empty
        list or a message that is not a ``(role, text)`` pair of strings."""
        dicts = _as_dicts(messages)
        full = self._render(dicts, add_generation_prompt)
        try:
            texts = [self._render(dicts[:i], False) for i in range(1, len(dicts))]
        except Exception:  # a template may refuse a prefix (e.g. one ending with assistant)
            return [full]
        if add_generation_prompt:
            texts.append(self._render(dicts, False))
        texts.append(full)
        pieces: list[str] = []
        previous = ""
        for text in texts:
            if not text.startswith(previous):
                return [full]
            pieces.append(text[len(previous) :])
            previous = text
        return [p for p in pieces if p]

    def token_ids(
        self, messages: Sequence[ChatTurn], *, add_generation_prompt: bool = True
    ) -> tuple[int, ...]:
        """The prompt's token ids: each segment tokenized on its own, concatenated."""
        ids: list[int] = []
        for segment in self.segments(messages, add_generation_prompt=add_generation_prompt):
            ids.extend(self._segment_ids(segment))
        return tuple(ids)

    def _segment_ids(self, segment: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._cache.get(segment)
            if ids is not None:
                self._cache.move_to_end(segment)
                return ids
        ids = tuple(self._tokenizer.encode(segment))
        with self._lock:
            self._cache[segment] = ids
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ids


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
        out.append({"role": message[0], "content": message[1]})
    return out
