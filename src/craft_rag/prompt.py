"""Token-exact prompt assembly: ``[head][chunk 1]...[chunk k][question + tail]``.

Every segment is tokenized on its own and the token ids are concatenated, so the token ids of a
chunk-prefix are identical whatever follows it (a BPE over the whole string could merge across a
boundary and break prefix-cache reuse). Multi-turn prompts are append-only:
``[head][turn-1 chunks][Q1 tail][A1 sep][turn-2 new chunks][Q2 tail]...`` so each turn's prompt
starts with the previous turn's prompt and answer, token for token.

The format strings are plain text; the engine fills ``head``/``tail``/``turn_separator`` from the
model's chat template (see :mod:`craft_rag.engine.chat_format`).

Security: the format's fixed pieces are trusted (they may hold the template's control tokens);
chunk texts, questions and answers are tokenized as plain text, so a document spelling
``<|im_end|>`` cannot open a new chat turn (:func:`craft_rag.tokenizer.encode_pieces`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from craft_rag.chunk import Chunk
from craft_rag.tokenizer import Tokenizer, check_text, encode_pieces, format_pieces
from craft_rag.types import ChunkKey

DEFAULT_INSTRUCTIONS = (
    "Answer the question using the documents below. Be brief.\n\n"
)


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """Text pieces of a prompt. ``chunk`` must contain ``{text}``; ``question`` must contain
    ``{question}``; ``answer`` must contain ``{answer}`` (it closes the assistant turn and opens
    the next user turn, so turn 2's chunks follow it). ``no_documents`` is rendered in place of
    the chunks of a turn that has none (all sent before, or none retrieved), so a format whose
    documents are a message of their own never renders an empty message (empty: nothing is
    rendered)."""

    head: str = DEFAULT_INSTRUCTIONS
    chunk: str = "Document: {text}\n\n"
    question: str = "Question: {question}\n"
    tail: str = "Answer:"
    answer: str = " {answer}\n\n"
    no_documents: str = ""

    def __post_init__(self) -> None:
        for name, placeholder in (("chunk", "{text}"), ("question", "{question}"),
                                  ("answer", "{answer}")):
            if placeholder not in getattr(self, name):
                msg = f"PromptFormat.{name} must contain {placeholder}"
                raise ValueError(msg)
            format_pieces(getattr(self, name), placeholder[1:-1], "")  # no other placeholder


@dataclass(frozen=True, slots=True)
class AssembledPrompt:
    """Token ids of one prompt plus where this turn's chunks sit in it.

    ``chunk_spans[i]`` is the ``[start, end)`` token span of ``chunk_keys[i]``; spans are
    contiguous and start at ``prefix_tokens`` (everything before this turn's first chunk)."""

    token_ids: tuple[int, ...]
    chunk_keys: tuple[ChunkKey, ...]
    chunk_spans: tuple[tuple[int, int], ...]
    prefix_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunks_fully_within(self, cached_tokens: int) -> int:
        """How many of this turn's chunks lie entirely inside the first ``cached_tokens``."""
        n = 0
        for _, end in self.chunk_spans:
            if end > cached_tokens:
                break
            n += 1
        return n


class PromptAssembler:
    """Builds token-exact prompts; caches each chunk's token ids (LRU, ``cache_size`` chunks).

    Cost: O(tokens of uncached segments) tokenizer work + O(prompt tokens) to concatenate.
    Not thread-safe (the LRU is mutated); give each thread its own or guard it.
    """

    def __init__(
        self, tokenizer: Tokenizer, fmt: PromptFormat | None = None, cache_size: int = 8192
    ) -> None:
        self.tokenizer = tokenizer
        self.format = fmt or PromptFormat()
        self._cache_size = cache_size
        self._chunk_cache: OrderedDict[tuple[ChunkKey, str], tuple[int, ...]] = OrderedDict()
        self._head = tuple(encode_pieces(tokenizer, [(self.format.head, True)]))
        self._no_documents = tuple(
            encode_pieces(tokenizer, [(self.format.no_documents, True)])
            if self.format.no_documents
            else ()
        )

    @property
    def head_ids(self) -> tuple[int, ...]:
        return self._head

    @property
    def no_documents_ids(self) -> tuple[int, ...]:
        """What a turn without chunks renders in their place (``PromptFormat.no_documents``)."""
        return self._no_documents

    def chunk_ids(self, chunk: Chunk) -> tuple[int, ...]:
        """Token ids of one rendered chunk (cached by key and text); the text is plain text.
        ``ValueError`` naming the chunk for text that is not valid Unicode."""
        cache_key = (chunk.key, chunk.text)
        ids = self._chunk_cache.get(cache_key)
        if ids is None:
            text = check_text(chunk.text, f"chunk {chunk.key!r} text")
            ids = tuple(
                encode_pieces(self.tokenizer, format_pieces(self.format.chunk, "text", text))
            )
            self._chunk_cache[cache_key] = ids
            if len(self._chunk_cache) > self._cache_size:
                self._chunk_cache.popitem(last=False)
        else:
            self._chunk_cache.move_to_end(cache_key)
        return ids

    def question_ids(self, question: str) -> tuple[int, ...]:
        """Token ids of the question (plain text) and the tail. ``ValueError`` for a question
        that is not a valid Unicode string."""
        pieces = format_pieces(self.format.question, "question", check_text(question, "question"))
        return tuple(encode_pieces(self.tokenizer, [*pieces, (self.format.tail, True)]))

    def answer_ids(self, answer: str) -> tuple[int, ...]:
        """Token ids appended after a turn's prompt: the reply (plain text), closing and
        next-turn opener. ``ValueError`` for an answer that is not a valid Unicode string."""
        pieces = format_pieces(self.format.answer, "answer", check_text(answer, "answer"))
        return tuple(encode_pieces(self.tokenizer, pieces))

    def single_turn(self, chunks: Sequence[Chunk], question: str) -> AssembledPrompt:
        """``[head][chunks...][question tail]``."""
        return self.next_turn(self._head, chunks, question)

    def next_turn(
        self, history: Sequence[int], chunks: Sequence[Chunk], question: str
    ) -> AssembledPrompt:
        """``history + [chunks...] + [question tail]``; ``history`` is the previous prompt plus
        :meth:`answer_ids` of its reply (or :attr:`head_ids` for a first turn)."""
        ids = list(history)
        spans: list[tuple[int, int]] = []
        if not chunks:
            ids.extend(self._no_documents)
        for chunk in chunks:
            start = len(ids)
            ids.extend(self.chunk_ids(chunk))
            spans.append((start, len(ids)))
        ids.extend(self.question_ids(question))
        return AssembledPrompt(
            token_ids=tuple(ids),
            chunk_keys=tuple(c.key for c in chunks),
            chunk_spans=tuple(spans),
            prefix_tokens=len(history),
        )
