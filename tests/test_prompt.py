"""Token-exact prompt assembly: per-segment tokenization, spans, append-only turns."""

from __future__ import annotations

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.prompt import AssembledPrompt, PromptAssembler, PromptFormat
from craft_rag.tokenizer import HashingTokenizer


class CountingTokenizer:
    """HashingTokenizer that counts encode() calls."""

    name = "counting"

    def __init__(self) -> None:
        self.inner = HashingTokenizer()
        self.calls: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.calls.append(text)
        return self.inner.encode(text)


def make_chunks(*names: str) -> list[Chunk]:
    return [make_chunk(f"Passage {n} says something about {n}.", id=n) for n in names]


def enc(text: str) -> list[int]:
    return HashingTokenizer().encode(text)


FMT = PromptFormat(head="Use the documents.\n", chunk="Doc: {text}\n", question="Q: {question}\n",
                   tail="A:", answer=" {answer}\n")


def test_single_turn_is_the_concatenation_of_separately_tokenized_segments() -> None:
    asm = PromptAssembler(HashingTokenizer(), FMT)
    chunks = make_chunks("C1", "C2")
    prompt = asm.single_turn(chunks, "Who?")
    expected = (
        enc("Use the documents.\n")
        + enc(f"Doc: {chunks[0].text}\n")
        + enc(f"Doc: {chunks[1].text}\n")
        + enc("Q: Who?\nA:")
    )
    assert list(prompt.token_ids) == expected
    assert prompt.num_tokens == len(expected)
    assert prompt.chunk_keys == ("C1", "C2")
    head = len(enc("Use the documents.\n"))
    first = len(enc(f"Doc: {chunks[0].text}\n"))
    second = len(enc(f"Doc: {chunks[1].text}\n"))
    assert prompt.prefix_tokens == head == len(asm.head_ids)
    assert prompt.chunk_spans == ((head, head + first), (head + first, head + first + second))


def test_a_chunk_prefix_has_the_same_tokens_whatever_follows() -> None:
    asm = PromptAssembler(HashingTokenizer(), FMT)
    a = asm.single_turn(make_chunks("C1", "C2", "C3"), "first question?")
    b = asm.single_turn(make_chunks("C1", "C2", "C9"), "a different question")
    end = a.chunk_spans[1][1]
    assert b.chunk_spans[1][1] == end
    assert a.token_ids[:end] == b.token_ids[:end]
    third_a, third_b = (slice(*p.chunk_spans[2]) for p in (a, b))
    assert a.token_ids[third_a] != b.token_ids[third_b]


def test_spans_are_contiguous_from_the_prefix() -> None:
    asm = PromptAssembler(HashingTokenizer())
    prompt = asm.single_turn(make_chunks("a", "b", "c", "d"), "q")
    spans = prompt.chunk_spans
    assert spans[0][0] == prompt.prefix_tokens
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert all(start < end for start, end in spans)
    for key, (start, end) in zip(prompt.chunk_keys, spans, strict=True):
        chunk = next(c for c in make_chunks("a", "b", "c", "d") if c.key == key)
        assert list(prompt.token_ids[start:end]) == list(asm.chunk_ids(chunk))


def test_no_chunks() -> None:
    asm = PromptAssembler(HashingTokenizer(), FMT)
    prompt = asm.single_turn([], "Why?")
    assert list(prompt.token_ids) == enc("Use the documents.\n") + enc("Q: Why?\nA:")
    assert prompt.chunk_spans == () and prompt.chunks_fully_within(10**6) == 0


def test_paper_request_dedup_example_is_append_only() -> None:
    # [C1..C5, Turn1_Query, Turn1_Response, C6, C7, C8, Turn2_Query]: turn 2 starts with turn 1's
    # prompt and answer, token for token, and carries only the new chunks.
    asm = PromptAssembler(HashingTokenizer(), FMT)
    turn1_chunks = make_chunks("C1", "C2", "C3", "C4", "C5")
    turn1 = asm.single_turn(turn1_chunks, "Turn 1 query")
    history = turn1.token_ids + asm.answer_ids("Turn 1 response")
    turn2 = asm.next_turn(history, make_chunks("C6", "C7", "C8"), "Turn 2 query")
    expected = enc("Use the documents.\n")
    for c in turn1_chunks:
        expected += enc(f"Doc: {c.text}\n")
    expected += enc("Q: Turn 1 query\nA:") + enc(" Turn 1 response\n")
    for c in make_chunks("C6", "C7", "C8"):
        expected += enc(f"Doc: {c.text}\n")
    expected += enc("Q: Turn 2 query\nA:")
    assert list(turn2.token_ids) == expected
    assert turn2.token_ids[: turn1.num_tokens] == turn1.token_ids
    assert turn2.prefix_tokens == len(history)
    assert turn2.chunk_keys == ("C6", "C7", "C8")
    assert turn2.chunk_spans[0][0] == len(history)


def test_chunks_fully_within() -> None:
    prompt = AssembledPrompt(
        token_ids=tuple(range(30)),
        chunk_keys=("a", "b", "c"),
        chunk_spans=((5, 10), (10, 20), (20, 25)),
        prefix_tokens=5,
    )
    assert prompt.chunks_fully_within(0) == 0
    assert prompt.chunks_fully_within(9) == 0
    assert prompt.chunks_fully_within(10) == 1
    assert prompt.chunks_fully_within(24) == 2
    assert prompt.chunks_fully_within(100) == 3


def test_chunk_token_cache_is_lru_and_keyed_by_key_and_text() -> None:
    tok = CountingTokenizer()
    asm = PromptAssembler(tok, FMT, cache_size=2)
    a, b, c = make_chunks("a", "b", "c")
    tok.calls.clear()
    asm.chunk_ids(a)
    asm.chunk_ids(b)
    asm.chunk_ids(a)  # cached
    assert len(tok.calls) == 2
    asm.chunk_ids(c)  # evicts b (a was used more recently)
    asm.chunk_ids(a)
    assert len(tok.calls) == 3
    asm.chunk_ids(b)
    assert len(tok.calls) == 4
    same_key_new_text = make_chunk("entirely different", id="a")
    assert asm.chunk_ids(same_key_new_text) != asm.chunk_ids(a)


def test_unicode_text() -> None:
    asm = PromptAssembler(HashingTokenizer())
    chunk = make_chunk("東京は日本の首都です。🗼 Ünïcödé", id="文書:0")
    prompt = asm.single_turn([chunk], "首都は？")
    start, end = prompt.chunk_spans[0]
    assert end > start
    assert list(prompt.token_ids[start:end]) == list(asm.chunk_ids(chunk))


@pytest.mark.parametrize(
    ("field", "value"),
    [("chunk", "Doc: {txt}"), ("question", "Q:"), ("answer", "no placeholder")],
)
def test_prompt_format_requires_its_placeholders(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"PromptFormat.{field}"):
        PromptFormat(**{field: value})


def test_default_format_renders() -> None:
    asm = PromptAssembler(HashingTokenizer())
    prompt = asm.single_turn(make_chunks("x"), "q")
    assert prompt.prefix_tokens == len(enc(PromptFormat().head)) > 0


def test_a_later_turn_without_chunks_renders_the_no_documents_text() -> None:
    tok = HashingTokenizer()
    none_ids = tuple(tok.encode("(none)"))
    asm = PromptAssembler(tok, PromptFormat(no_documents="(none)"))
    first = asm.single_turn([], "q1")
    assert first.token_ids == (*asm.head_ids, *none_ids, *asm.question_ids("q1"))
    history = (*first.token_ids, *asm.answer_ids("a1"))
    later = asm.next_turn(history, [], "q2")
    assert later.token_ids == (*history, *none_ids, *asm.question_ids("q2"))
    with_chunks = asm.next_turn(history, make_chunks("x"), "q2")
    assert with_chunks.token_ids[len(history) : len(history) + len(none_ids)] != none_ids
    plain = PromptAssembler(tok, PromptFormat())  # default: nothing rendered
    base = (*plain.single_turn([], "q1").token_ids, *plain.answer_ids("a1"))
    assert plain.next_turn(base, [], "q2").token_ids == (*base, *plain.question_ids("q2"))
