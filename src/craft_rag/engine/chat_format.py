"""Derive a token-exact :class:`craft_rag.prompt.PromptFormat` from a model's chat template.

The chat template is rendered once with sentinel strings for the message contents; the text
around the sentinels gives the constant pieces:

* ``head``: everything before the first user message's content (system turn and user opening)
  followed by the instructions;
* ``tail``: the end of the user turn plus the assistant opening (the generation prompt);
* ``answer``: ``{answer}`` followed by the end of the assistant turn and the next user opening,
  so turn 2's chunks follow it directly;
* ``question`` (default, ``question_message=False``): ``Question: {question}`` closing the
  documents' user message. ``question_message=True``: the end of the documents' user
  message plus the opening of a new user message, then ``{question}``: the question is its own
  user message. On MTRAG chat this made the 135M model answer rather than copy a passage
  (+0.025 F1, +0.138 MiniLM over 75 paired turns; docs/benchmarks.md) for 3 more prompt tokens
  per question with SmolLM2, but on single-turn SQuAD it cost F1 (-0.05 to -0.07), and some
  templates refuse two user messages in a row. So the function's default stays ``False``, and
  :class:`~craft_rag.engine.engine.CraftEngine` chooses per path: single requests ``False``,
  conversation turns ``True`` where the template accepts it
  (:func:`craft_rag.engine.wiring.conversation_format`).

:func:`derive_chat_format` checks that the template is *append-only*: the rendering of a
two-turn conversation must equal the one-turn rendering plus the answer piece plus turn 2's
user content plus the tail (and, with question messages, two user messages in a row must
render as the pieces say, turn after turn). Templates that rewrite earlier turns (e.g. strip
reasoning) fail that check with a ``ValueError``; pass a hand-written ``PromptFormat`` for those.

Token exactness comes from :class:`craft_rag.prompt.PromptAssembler` (each segment tokenized on
its own); :func:`chat_format_matches_template` checks that the assembled ids decode to exactly
the text the chat template renders.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptFormat
from craft_rag.tokenizer import check_text

# Sentinels: plain ASCII words that no template rewrites and no tokenizer special-cases.
_USER_1 = "CRAFTUSERONESENTINEL"
_ANSWER_1 = "CRAFTANSWERONESENTINEL"
_USER_2 = "CRAFTUSERTWOSENTINEL"
_SYSTEM = "CRAFTSYSTEMSENTINEL"
_QUESTION_1 = "CRAFTQUESTIONONESENTINEL"
_QUESTION_2 = "CRAFTQUESTIONTWOSENTINEL"

NO_DOCUMENTS = "(No new documents for this question.)"
"""The documents' message of a conversation turn that has no chunks (question as its own
message): some templates refuse or drop an empty user message, and an empty one reads as noise."""

Message = Mapping[str, str]
RenderFn = Callable[[Sequence[Message], bool], str]
"""Renders chat messages to text: ``render(messages, add_generation_prompt)``."""


@dataclass(frozen=True, slots=True)
class ChatPieces:
    """The constant text pieces of a chat template (see the module docstring)."""

    user_open: str
    """Everything before the first user content (system turn included)."""
    user_close_assistant_open: str
    """End of the user turn plus the assistant opening."""
    assistant_close_user_open: str
    """End of the assistant turn plus the next user opening."""
    user_close_user_open: str | None = None
    """End of a user turn plus the opening of the next user turn (two user messages in a row);
    ``None`` when not extracted (``extract_chat_pieces(..., question_message=False)``)."""


def _escape_format(text: str) -> str:
    """Escape ``{``/``}`` so ``str.format`` leaves template text alone."""
    return text.replace("{", "{{").replace("}", "}}")


def _split_once(text: str, sentinel: str, what: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        msg = (
            f"the chat template rendered the {what} {text.count(sentinel)} times (expected once); "
            "pass a hand-written craft_rag.prompt.PromptFormat for this model"
        )
        raise ValueError(msg)
    before, after = text.split(sentinel)
    return before, after


def extract_chat_pieces(
    render: RenderFn, system_prompt: str | None = None, *, question_message: bool = False
) -> ChatPieces:
    """Render sentinel conversations with ``render`` and cut out the constant pieces.

    ``system_prompt=None`` sends no system message (the template's default system turn, if any,
    stays in). Raises ``ValueError`` when the template is not append-only, and, with
    ``question_message=True``, when it refuses, merges or rewrites two user messages
    in a row (the error names ``question_message=False``). Cost: 2 renders (4 with
    ``question_message``).
    """
    _check_bool(question_message)
    system: list[Message] = (
        [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    )
    one = render([*system, {"role": "user", "content": _USER_1}], True)
    user_open, user_close_assistant_open = _split_once(one, _USER_1, "first user message")
    two = render(
        [
            *system,
            {"role": "user", "content": _USER_1},
            {"role": "assistant", "content": _ANSWER_1},
            {"role": "user", "content": _USER_2},
        ],
        True,
    )
    before_answer, after_answer = _split_once(two, _ANSWER_1, "assistant message")
    between, after_user_2 = _split_once(after_answer, _USER_2, "second user message")
    pieces = ChatPieces(
        user_open=user_open,
        user_close_assistant_open=user_close_assistant_open,
        assistant_close_user_open=between,
    )
    if before_answer != one or after_user_2 != user_close_assistant_open:
        msg = (
            "the chat template is not append-only (turn 1 renders differently once turn 2 "
            "follows), so multi-turn prompts cannot reuse earlier turns' KV; pass a "
            "hand-written craft_rag.prompt.PromptFormat for this model"
        )
        raise ValueError(msg)
    if not question_message:
        return pieces
    return replace(pieces, user_close_user_open=_user_close_user_open(render, system, pieces))


def _check_bool(question_message: object) -> None:
    if not isinstance(question_message, bool):
        msg = (
            f"question_message must be True or False, got {question_message!r}: True renders "
            "the question as its own user message, False inside the documents' message"
        )
        raise ValueError(msg)


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n :]


def _user_close_user_open(
    render: RenderFn, system: Sequence[Message], pieces: ChatPieces
) -> str:
    """The text between two consecutive user messages' contents, checked append-only over two
    turns (``[docs][question][answer][docs][question]``). ``ValueError`` naming
    ``question_message=False`` when the template refuses, merges or rewrites them."""
    fix = (
        "; pass question_message=False (the question then closes the documents' message) or a "
        "hand-written craft_rag.prompt.PromptFormat for this model"
    )
    try:
        pair = render([*system, {"role": "user", "content": _USER_1},
                       {"role": "user", "content": _QUESTION_1}], True)
    except Exception as exc:  # templates refuse with raise_exception (jinja2 TemplateError)
        msg = f"the chat template refuses two user messages in a row ({exc})" + fix
        raise ValueError(msg) from exc
    before, after = _split_once(pair, _USER_1, "first of two user messages")
    between, after_question = _split_once(after, _QUESTION_1, "second of two user messages")
    # The user opening: what precedes a user content both at the start and after an answer.
    opening = _common_suffix(pieces.user_open, pieces.assistant_close_user_open)
    if not opening.strip() or not between.endswith(opening):
        msg = (
            "the chat template merges two user messages in a row into one turn (no user "
            f"opening between them: {between!r})" + fix
        )
        raise ValueError(msg)
    if before != pieces.user_open or after_question != pieces.user_close_assistant_open:
        msg = "the chat template renders two user messages in a row not append-only" + fix
        raise ValueError(msg)
    two_turns = render(
        [
            *system,
            {"role": "user", "content": _USER_1},
            {"role": "user", "content": _QUESTION_1},
            {"role": "assistant", "content": _ANSWER_1},
            {"role": "user", "content": _USER_2},
            {"role": "user", "content": _QUESTION_2},
        ],
        True,
    )
    expected = (
        pieces.user_open + _USER_1 + between + _QUESTION_1 + pieces.user_close_assistant_open
        + _ANSWER_1 + pieces.assistant_close_user_open + _USER_2 + between + _QUESTION_2
        + pieces.user_close_assistant_open
    )
    if two_turns != expected:
        msg = (
            "the chat template is not append-only with the question as its own user message "
            "(turn 1 renders differently once turn 2 follows)" + fix
        )
        raise ValueError(msg)
    return between


def format_from_pieces(
    pieces: ChatPieces,
    *,
    instructions: str = DEFAULT_INSTRUCTIONS,
    chunk: str = "Document: {text}\n\n",
    question: str | None = None,
    question_message: bool = False,
) -> PromptFormat:
    """A :class:`PromptFormat` whose prompts render exactly as the chat template would for one
    user message ``instructions + chunks + question`` per turn (and, for later turns, the
    assistant reply followed by a user message ``chunks + question``); ``question`` defaults to
    ``"Question: {question}"``.

    ``question_message=True`` (the engine's conversation default): a user message
    ``instructions + chunks`` followed by a user message ``question`` (``question`` defaulting
    to ``"{question}"``); a turn without chunks renders :data:`NO_DOCUMENTS` as its
    documents' message (never an empty message). ``ValueError`` when it is set but ``pieces``
    has no ``user_close_user_open``.
    """
    _check_bool(question_message)
    if question_message:
        if pieces.user_close_user_open is None:
            msg = (
                "pieces has no user_close_user_open: extract them with question_message=True, "
                "or pass question_message=False"
            )
            raise ValueError(msg)
        question_text = _escape_format(pieces.user_close_user_open) + (
            "{question}" if question is None else question
        )
        no_documents = NO_DOCUMENTS
    else:
        question_text = "Question: {question}" if question is None else question
        no_documents = ""
    return PromptFormat(
        head=pieces.user_open + instructions,
        chunk=chunk,
        question=question_text,
        tail=pieces.user_close_assistant_open,
        answer="{answer}" + _escape_format(pieces.assistant_close_user_open),
        no_documents=no_documents,
    )


def load_chat_template(model_dir: Path) -> str:
    """The chat template of a local HF folder: ``chat_template.jinja`` or the
    ``chat_template`` field of ``tokenizer_config.json``. ``FileNotFoundError`` naming both
    when neither exists."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        import json

        data = json.loads(config.read_text(encoding="utf-8"))
        template = data.get("chat_template")
        if isinstance(template, str) and template:
            return template
    msg = (
        f"{model_dir} has no chat template (neither chat_template.jinja nor a chat_template in "
        "tokenizer_config.json); pass prompt_format=craft_rag.prompt.PromptFormat(...) instead"
    )
    raise FileNotFoundError(msg)


def jinja_renderer(template: str, special_tokens: Mapping[str, str] | None = None) -> RenderFn:
    """Render ``template`` the way transformers does (sandboxed jinja2, ``trim_blocks``,
    ``lstrip_blocks``, ``raise_exception``), without loading a tokenizer. Cost: one template
    compile; each render is microseconds."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # jinja2 comes with transformers and vllm
        msg = "rendering a chat template needs jinja2: pip install jinja2"
        raise ImportError(msg) from exc

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    extra: dict[str, Any] = dict(special_tokens or {})

    def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return str(
            compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        )

    return render


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """``bos_token``/``eos_token``... strings from tokenizer_config.json, for templates that
    reference them."""
    import json

    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return {}
    data = json.loads(config.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = data.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _control_strings(model_dir: Path) -> tuple[str, ...]:
    """The special added-token strings of ``model_dir/tokenizer.json`` (none without the
    file). Non-special added tokens (SentencePiece pieces such as Gemma's ``"\n"``) are
    ordinary text, as in :class:`craft_rag.tokenizer.HFTokenizer`."""
    import json

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ()
    data = json.loads(path.read_text(encoding="utf-8"))
    tokens = data.get("added_tokens") or []
    return tuple(
        t["content"]
        for t in tokens
        if isinstance(t, dict) and t.get("content") and t.get("special", True)
    )


def model_renderer(model_dir: str | os.PathLike[str]) -> RenderFn:
    """A :data:`RenderFn` for the chat template of the local model folder ``model_dir`` (its
    special-token strings included). ``FileNotFoundError`` when it has no template."""
    folder = Path(model_dir)
    return jinja_renderer(load_chat_template(folder), _special_tokens(folder))


def derive_chat_format(
    model_dir: str | os.PathLike[str],
    *,
    system_prompt: str | None = None,
    instructions: str = DEFAULT_INSTRUCTIONS,
    chunk: str = "Document: {text}\n\n",
    question: str | None = None,
    question_message: bool = False,
) -> PromptFormat:
    """The chat-correct :class:`PromptFormat` of the model in ``model_dir``.

    By default the question closes the documents' user message; ``question_message=True``
    (better MTRAG chat answers from the 135M model, worse single-turn SQuAD ones: the engine's
    conversation default) sends it as its own user message (see :func:`format_from_pieces`).

    ``system_prompt``, ``instructions``, ``chunk`` and ``question`` are trusted format text
    (tokenized with the template's control tokens), so they may not spell a control token of
    the model's tokenizer (``ValueError`` naming them; likewise for lone surrogates).

    Reads the folder's chat template (no tokenizer or model is loaded). ``FileNotFoundError``
    when there is none, ``ValueError`` when it is not append-only. Cost: milliseconds.
    """
    controls = _control_strings(Path(model_dir))
    checked = (("system_prompt", system_prompt), ("instructions", instructions),
               ("chunk", chunk), ("question", question))
    for name, text in checked:
        if text is None:
            continue
        check_text(text, name)
        spelled = [c for c in controls if c in text]
        if spelled:
            msg = (
                f"{name} spells the control token {spelled[0]!r}; it is rendered as the "
                "prompt's trusted text, so remove control-token strings from it"
            )
            raise ValueError(msg)
    pieces = extract_chat_pieces(
        model_renderer(model_dir), system_prompt, question_message=question_message
    )
    return format_from_pieces(
        pieces,
        instructions=instructions,
        chunk=chunk,
        question=question,
        question_message=question_message,
    )


def render_reference(
    render: RenderFn,
    fmt: PromptFormat,
    turns: Sequence[tuple[Sequence[str], str, str | None]],
    *,
    system_prompt: str | None = None,
) -> str:
    """What the chat template itself renders for ``turns`` = ``[(chunk texts, question,
    answer or None), ...]`` (only the last turn may lack an answer) using ``fmt``'s chunk and
    question pieces as user content. When ``fmt.question`` opens with the template's text
    between two user messages (a ``question_message`` format), the question is sent as its
    own user message after the chunks' one. Used to check that assembled prompts are
    chat-correct."""
    system: list[Message] = (
        [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    )
    try:
        pieces = extract_chat_pieces(render, system_prompt, question_message=True)
        separator = pieces.user_close_user_open
    except ValueError:  # no (append-only) consecutive user messages: fmt cannot use them
        separator = None
    messages = list(system)
    for i, (texts, question, answer) in enumerate(turns):
        body = "".join(fmt.chunk.format(text=t) for t in texts)
        if not texts:
            body = fmt.no_documents
        asked = fmt.question.format(question=question)
        marker = "\x00" if i == 0 else ""
        if separator is not None and asked.startswith(separator):
            messages.append({"role": "user", "content": marker + body})
            messages.append({"role": "user", "content": asked[len(separator) :]})
        else:
            messages.append({"role": "user", "content": marker + body + asked})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    rendered = render(messages, True)
    # The first user message's content begins with the instructions, which live in fmt.head
    # after the user opening: put them in place of the marker.
    opening, _, rest = rendered.partition("\x00")
    if not rest:
        msg = "the chat template dropped the first user message"
        raise ValueError(msg)
    if not fmt.head.startswith(opening):
        msg = "fmt.head does not start with the template's user opening; fmt was not derived here"
        raise ValueError(msg)
    return fmt.head + rest
