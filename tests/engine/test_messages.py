"""Chat message lists rendered token-exactly: one segment per message, prefix-stable ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from craft_rag.engine.chat_format import jinja_renderer, model_renderer
from craft_rag.engine.messages import MessageRenderer
from craft_rag.testing import CHATML
from craft_rag.tokenizer import HashingTokenizer, HFTokenizer

CHAT = [
    ("system", "Be brief."),
    ("user", "Where is the Loire?"),
    ("assistant", "In France."),
    ("user", "And its length?"),
]


def test_segments_split_at_message_boundaries_and_join_to_the_template() -> None:
    render = jinja_renderer(CHATML)
    renderer = MessageRenderer(render, HashingTokenizer())
    segments = renderer.segments(CHAT)
    dicts = [{"role": r, "content": t} for r, t in CHAT]
    assert "".join(segments) == render(dicts, True)
    assert segments == [
        "<|im_start|>system\nBe brief.<|im_end|>\n",
        "<|im_start|>user\nWhere is the Loire?<|im_end|>\n",
        "<|im_start|>assistant\nIn France.<|im_end|>\n",
        "<|im_start|>user\nAnd its length?<|im_end|>\n",
        "<|im_start|>assistant\n",
    ]
    assert renderer.segments(CHAT, add_generation_prompt=False) == segments[:-1]


def test_ids_of_earlier_messages_do_not_depend_on_later_ones() -> None:
    renderer = MessageRenderer(jinja_renderer(CHATML), HashingTokenizer())
    short = renderer.token_ids(CHAT[:2], add_generation_prompt=False)
    assert renderer.token_ids(CHAT)[: len(short)] == short


def test_a_template_that_rewrites_history_is_rendered_whole() -> None:
    # Drops earlier assistant messages once a later user message follows.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "[{{ m['role'] }}]{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    render = jinja_renderer(template)
    renderer = MessageRenderer(render, HashingTokenizer())
    dicts = [{"role": r, "content": t} for r, t in CHAT]
    assert renderer.segments(CHAT) == [render(dicts, True)]


def test_bad_messages_are_clear_errors() -> None:
    renderer = MessageRenderer(jinja_renderer(CHATML), HashingTokenizer())
    for bad in ([], "hello", [("user",)], [("", "hi")], [("user", 3)], [{"role": "user"}]):
        with pytest.raises(ValueError, match="messages"):
            renderer.token_ids(bad)  # type: ignore[arg-type]


def test_segment_cache_is_bounded() -> None:
    renderer = MessageRenderer(jinja_renderer(CHATML), HashingTokenizer(), cache_size=3)
    renderer.token_ids(CHAT)
    assert len(renderer._cache) == 3


def test_model_ids_decode_to_the_chat_templates_text(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    render = model_renderer(model_dir)
    ids = MessageRenderer(render, tokenizer).token_ids(CHAT[1:])
    dicts = [{"role": r, "content": t} for r, t in CHAT[1:]]
    assert tokenizer._tok.decode(list(ids), skip_special_tokens=False) == render(dicts, True)
    # For this ChatML template the per-message split is also what whole-text BPE gives.
    assert list(ids) == tokenizer.encode_template(render(dicts, True))
