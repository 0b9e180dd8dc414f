"""Condensing a follow-up into a standalone question, on the conversation's cached prefix.

Chat retrieval with the raw turn text fails on follow-ups ("Who was his mother?"). LlamaIndex's
``CondensePlusContextChatEngine`` and LangChain's history-aware retrievers first ask the LLM to
rewrite the follow-up using the conversation. Their condense prompt is a new text prompt (the
history re-rendered into a template), so none of it is cached. Here the condense request is
``[head][the conversation's stored turns][instruction + follow-up][assistant opener]``
(:meth:`CraftEngine.side_prompt_ids`): everything but the instruction is the conversation's own
prompt, already in vLLM's prefix cache, and the request is not stored in the conversation (the
next turn continues from the same prefix). The instruction is rendered as a chunk-free turn in
the conversation's format (with the question-message default: the no-documents text as the
documents' message, then the instruction as its own user message). It is served as a plain
token request, so its cost is reported on its own :class:`~craft_rag.engine.results.ReuseReport`.

Small models often echo the follow-up unchanged (the embedded SmolLM2-135M mostly does). When
the reply is the follow-up itself and the caller passes the ``previous`` user message, the
question retrieval uses is ``previous + " " + follow-up`` instead (``method="history"``): the
follow-up's missing referent is almost always in the previous question. Small models also
answer the follow-up or invent a statement instead of rewriting it ("Who was his wife?" ->
"His wife was Mary, a singer."), and retrieval would then follow the invention. A reply counts
as a rewrite only when it reads as a question (ends with "?" or starts with a question word),
keeps the follow-up's content words and is not much longer than follow-up plus previous
message (:func:`is_rewrite`); anything else falls back to the ``"history"`` rule. ``method``
says which rule produced the question.

Whether to condense at all: :func:`condense_off_reason` holds the one rule both integrations
use. ``condense=None`` ("auto", their default) condenses unless the engine serves an embedded
model (:data:`~craft_rag.engine.model.EMBEDDED_MODELS`: SmolLM2-135M, Gemma 3 270M base): models
that small answer or invent instead of rewriting, so retrieval with the raw follow-up is
better; the skipped step is reported as ``method="off"`` with that reason.

The follow-up is caller text: it is tokenized as plain text (control-token spellings stay
text) and formatted into the instruction as a value, never as a template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from craft_rag.engine.model import (
    DEFAULT_EMBEDDED,
    EMBEDDED_MODELS,
    embedded_model_dir,
    read_manifest,
)
from craft_rag.engine.results import GenerationResult, ReuseReport, SamplingRequest, TokensRequest

if TYPE_CHECKING:
    from craft_rag.engine.engine import CraftEngine

CONDENSE_INSTRUCTION = (
    "Rewrite the follow-up question below as one standalone question that can be understood "
    "without the conversation above (replace pronouns with the names they refer to). Reply "
    "with the question only.\nFollow-up question: {question}"
)
"""Default instruction; ``{question}`` is replaced by the follow-up (as a value)."""

DEFAULT_CONDENSE_MAX_TOKENS = 40

_PREFIXES = ("standalone question:", "question:", "rewritten question:")

_QUESTION_WORDS = frozenset(
    "who whom whose what which when where why how is are was were do does did can could "  # noqa: SIM905
    "would will should shall may might has have had name list tell give describe explain".split()
)
# Words a rewrite may replace (pronouns, articles, auxiliaries): the follow-up's other words
# must survive the rewrite, or the model answered or changed the question.
_REPLACEABLE = _QUESTION_WORDS | frozenset(
    "he she it they him her them his hers its their theirs this that these those there the a "  # noqa: SIM905
    "an of in on at to for by with and or from about as one ones".split()
)
_MAX_GROWTH_WORDS = 12


@dataclass(frozen=True, slots=True)
class Condensed:
    """The question to retrieve with. ``report`` is the condense request's own reuse report
    (``None`` when nothing was asked: no earlier turn in the engine, or condensing is off)."""

    question: str
    original: str
    report: ReuseReport | None = None
    method: str = "none"
    """``"llm"`` (the model's rewrite), ``"history"`` (previous message + follow-up, when the
    model echoed the follow-up), ``"none"`` (the follow-up as is) or ``"off"`` (condensing
    was skipped: see ``reason``)."""
    reason: str | None = None
    """Why condensing was off (``method="off"``), else ``None``."""

    @classmethod
    def off(cls, question: str, reason: str) -> Condensed:
        """The follow-up as is, with why no condense request was made."""
        return cls(question, question, None, "off", reason)

    @property
    def rewritten(self) -> bool:
        return self.question != self.original


CONDENSE_OFF_BY_CALLER = "condense=False"
EMBEDDED_TOO_SMALL = (
    "the engine serves the embedded {name} model; models this small (135M/270M) answer or "
    "invent instead of rewriting follow-ups, so retrieval uses the raw follow-up "
    "(condense=True forces it)"
)


def embedded_model_name(model: str | Path | None) -> str | None:
    """The :data:`EMBEDDED_MODELS` name ``model`` (an ``EngineSettings.model``) selects, or
    ``None`` for any other model. ``None`` is the embedded default; a folder counts when it is
    an embedded model's default folder or holds craft-rag's preparation manifest (a prepared
    embedded model moved elsewhere). Cost: path comparisons and one small file read."""
    if model is None:
        return DEFAULT_EMBEDDED
    if isinstance(model, str) and model in EMBEDDED_MODELS:
        return model
    folder = Path(model).expanduser().absolute()
    for name in EMBEDDED_MODELS:
        if folder == embedded_model_dir(name).expanduser().absolute():
            return name
    manifest = read_manifest(folder)  # written only when craft-rag prepares an embedded model
    if manifest is None:
        return None
    source = str(manifest.get("source", "")).lower()
    for name in EMBEDDED_MODELS:  # "smollm2-135m" -> "smollm", "gemma3-270m" -> "gemma"
        if name.split("-")[0].rstrip("0123456789") in source:
            return name
    return source or DEFAULT_EMBEDDED


def condense_off_reason(engine: CraftEngine, condense: bool | None) -> str | None:
    """Why a chat turn on ``engine`` should not condense (``None``: condense it). The one rule
    of both integrations: ``True`` always condenses, ``False`` never; ``None`` (auto) condenses
    unless the engine serves an embedded model (too small to rewrite reliably; a fake or
    unknown backend with no model set counts as the embedded default). O(1)."""
    if condense is not None and not isinstance(condense, bool):
        msg = f"condense must be True, False or None (auto), got {condense!r}"
        raise ValueError(msg)
    if condense is True:
        return None
    if condense is False:
        return CONDENSE_OFF_BY_CALLER
    settings = getattr(engine, "settings", None)
    name = embedded_model_name(getattr(settings, "model", None))
    return None if name is None else EMBEDDED_TOO_SMALL.format(name=name)


def condense_ids(
    engine: CraftEngine,
    conversation_id: str | None,
    question: str,
    *,
    cache_salt: str | None = None,
    instruction: str = CONDENSE_INSTRUCTION,
) -> tuple[int, ...] | None:
    """The condense request's token ids, or ``None`` when the engine holds no earlier turn of
    the conversation under ``cache_salt`` (a first turn is its own standalone question).
    ``ValueError`` for an empty question, an instruction without ``{question}`` or a bad salt.
    O(prompt tokens)."""
    if not isinstance(question, str) or not question.strip():
        msg = "question must be a non-empty string"
        raise ValueError(msg)
    if "{question}" not in instruction:
        msg = "the condense instruction must contain '{question}' where the follow-up goes"
        raise ValueError(msg)
    if conversation_id is None or engine.turn_count(conversation_id, cache_salt=cache_salt) == 0:
        return None
    text = instruction.replace("{question}", question)
    return engine.side_prompt_ids(conversation_id, text, cache_salt=cache_salt)


def clean_condensed(text: str, original: str) -> str:
    """The first non-empty line of the model's reply without a "Standalone question:" prefix
    or quotes; ``original`` when nothing usable is left."""
    for line in text.strip().splitlines():
        line = line.strip().strip('"').strip()
        low = line.lower()
        for prefix in _PREFIXES:
            if low.startswith(prefix):
                line = line[len(prefix) :].strip().strip('"').strip()
                break
        if len(line) >= 3:
            return line
    return original


def _words(text: str) -> list[str]:
    return [w.strip(".,;:!?\"'()").casefold() for w in text.split() if w.strip(".,;:!?\"'()")]


def is_rewrite(text: str, question: str, previous: str | None = None) -> bool:
    """Whether ``text`` reads as a standalone rewrite of ``question``: a question (ends with
    "?" or starts with a question word), keeping every word of ``question`` that is not a
    pronoun, article or auxiliary (case-insensitive), at most ``previous`` + ``question`` +
    12 words long. False for answers and invented statements. O(words)."""
    words = _words(text)
    if not words or not (text.rstrip().endswith("?") or words[0] in _QUESTION_WORDS):
        return False
    kept = set(words)
    if any(w not in kept for w in _words(question) if w not in _REPLACEABLE):
        return False
    budget = len(_words(question)) + len(_words(previous or "")) + _MAX_GROWTH_WORDS
    return len(words) <= budget


def _condensed(result: GenerationResult, question: str, previous: str | None) -> Condensed:
    text, report = clean_condensed(result.text, question), result.report
    if _same(text, question) or not is_rewrite(text, question, previous):
        if previous and previous.strip() and not _same(previous, question):
            return Condensed(f"{previous.strip()} {question}", question, report, "history")
        return Condensed(question, question, report, "none")
    return Condensed(text, question, report, "llm")


def _same(a: str, b: str) -> bool:
    return a.strip().strip("?.!").casefold() == b.strip().strip("?.!").casefold()


class CondenseOptions(TypedDict, total=False):
    """The keyword arguments of :func:`condense` and :func:`acondense`: ``cache_salt`` (the
    conversation's), ``max_tokens`` (default :data:`DEFAULT_CONDENSE_MAX_TOKENS`),
    ``instruction`` (default :data:`CONDENSE_INSTRUCTION`), ``previous`` (the previous user
    message: the fallback when the model only echoes the follow-up)."""

    cache_salt: str | None
    max_tokens: int
    instruction: str
    previous: str | None


def condense(
    engine: CraftEngine,
    conversation_id: str | None,
    question: str,
    **options: Unpack[CondenseOptions],
) -> Condensed:
    """Rewrite ``question`` into a standalone question with the conversation's prefix (greedy,
    at most ``max_tokens``); ``previous`` is the fallback when the model only echoes the
    follow-up. Blocks. Cost: the instruction and follow-up (~40-60 uncached tokens) plus up to
    ``max_tokens`` decode steps; nothing without an earlier turn. ``TypeError`` for an unknown
    keyword."""
    request = _condense_request(engine, conversation_id, question, options)
    if request is None:
        return Condensed(question, question)
    return _condensed(engine.submit(request).result(), question, options.get("previous"))


async def acondense(
    engine: CraftEngine,
    conversation_id: str | None,
    question: str,
    **options: Unpack[CondenseOptions],
) -> Condensed:
    """Async :func:`condense` (same arguments; waits on the engine's async stream)."""
    request = _condense_request(engine, conversation_id, question, options)
    if request is None:
        return Condensed(question, question)
    return _condensed(await engine.submit(request).aresult(), question, options.get("previous"))


def _condense_request(
    engine: CraftEngine, conversation_id: str | None, question: str, options: CondenseOptions
) -> TokensRequest | None:
    """The condense request (``None``: nothing to ask, see :func:`condense_ids`)."""
    known = CondenseOptions.__annotations__
    if unknown := sorted(set(options) - set(known)):
        msg = f"unexpected keyword arguments {unknown}; condense takes {sorted(known)}"
        raise TypeError(msg)
    salt = options.get("cache_salt")
    instruction = options.get("instruction", CONDENSE_INSTRUCTION)
    ids = condense_ids(engine, conversation_id, question, cache_salt=salt, instruction=instruction)
    if ids is None:
        return None
    sampling = SamplingRequest(max_tokens=options.get("max_tokens", DEFAULT_CONDENSE_MAX_TOKENS))
    return TokensRequest(ids, salt, sampling)
