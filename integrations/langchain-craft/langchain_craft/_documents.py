"""LangChain documents <-> craft-rag chunks, the planned-documents list, conversation ids.

Identity: a document's chunk key is ``Document.id`` when set, else ``metadata[id_key]`` when that
is a non-empty string, else the sha256 of ``page_content`` (:func:`craft_rag.content_key`). Keys
must be stable across requests, or CRAFT cannot see that two requests share a chunk; vector
stores that fill ``Document.id`` (FAISS, Chroma, InMemoryVectorStore...) give that for free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.documents import Document
from langchain_core.runnables import RunnableConfig

from craft_rag import Chunk, Plan, check_text, content_key, make_chunk
from craft_rag import validate_conversation_id as validate_conversation_id

DEFAULT_CONVERSATION_KEYS: tuple[str, ...] = ("conversation_id", "session_id", "thread_id")
"""Keys of ``config["configurable"]`` read, in this order, as the conversation id."""

CRAFT_PLAN_EVENT = "craft_plan"
"""Name of the custom callback event carrying :func:`plan_summary` for every planned request."""


class CraftDocuments(list[Document]):
    """The documents to render, in CRAFT order, plus what the plan left out.

    A plain ``list`` for every LangChain consumer; the extra attributes say what happened:
    ``plan`` (``None`` when no document had text), ``removed_duplicates`` (sent in an earlier
    turn of a conversation whose prompt keeps them), ``repeated_in_request`` (exact duplicates:
    same id and same text, the first one is kept), ``passthrough`` (documents without text:
    returned after the planned ones, in input order, never planned), ``committed`` (whether the
    planner already recorded this request; the plan's ``ref`` names the planner).
    Invariant: every input document is in exactly one of the list, ``removed_duplicates`` and
    ``repeated_in_request``; ``passthrough`` documents are in the list.
    """

    __slots__ = (
        "committed",
        "passthrough",
        "plan",
        "removed_duplicates",
        "repeated_in_request",
    )

    def __init__(
        self,
        documents: Sequence[Document] = (),
        *,
        plan: Plan | None = None,
        removed_duplicates: Sequence[Document] = (),
        repeated_in_request: Sequence[Document] = (),
        passthrough: Sequence[Document] = (),
        committed: bool = False,
    ) -> None:
        super().__init__(documents)
        self.plan = plan
        self.removed_duplicates: tuple[Document, ...] = tuple(removed_duplicates)
        self.repeated_in_request: tuple[Document, ...] = tuple(repeated_in_request)
        self.passthrough: tuple[Document, ...] = tuple(passthrough)
        self.committed = committed


@dataclass(frozen=True, slots=True)
class SplitDocuments:
    """Input documents split into plannable ones (``chunks[i]`` built from ``plannable[i]``)
    and ``passthrough`` ones (no text). ``documents`` is the materialised input."""

    documents: tuple[Document, ...]
    chunks: tuple[Chunk, ...]
    plannable: tuple[Document, ...]
    passthrough: tuple[Document, ...]


def document_key(doc: Document, id_key: str | None) -> str | None:
    """The caller id of ``doc`` (``Document.id``, then ``metadata[id_key]``), or ``None``."""
    if doc.id:
        return str(doc.id)
    if id_key is not None:
        value = doc.metadata.get(id_key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return None


def materialise(documents: object) -> tuple[Any, ...]:
    """``documents`` as a tuple, read once (a generator is consumed here, before any planner
    state changes). ``ValueError`` for a single document, a string, a mapping or a
    non-iterable."""
    if isinstance(documents, str | bytes | Document | Mapping) or not isinstance(
        documents, Iterable
    ):
        msg = (
            f"expected a sequence of Documents, got a single {type(documents).__name__}; "
            "wrap it in a list"
        )
        raise ValueError(msg)
    return tuple(documents)


def split_documents(documents: object, id_key: str | None) -> SplitDocuments:
    """One chunk per document with text, in input order; documents without text set aside.
    O(total text) for content hashing.

    Identity: the caller's id (:func:`document_key`), else the text's content hash. Two
    documents without ids and with equal text are one item only when they are equal in full
    (metadata too): an exact duplicate, reported by the planner in ``repeated_in_request``;
    otherwise the later one gets its own key (``<hash>#2``...) and is kept. Raises
    ``ValueError`` for an item that is not a ``Document``, a ``page_content`` that is not
    valid text, and two documents with the same id but different text (CRAFT would render
    only one of them; give them distinct ids).
    """
    docs = materialise(documents)
    chunks: list[Chunk] = []
    plannable: list[Document] = []
    passthrough: list[Document] = []
    texts: dict[str, str] = {}
    anonymous: dict[str, list[Document]] = {}
    for i, doc in enumerate(docs):
        if not isinstance(doc, Document):
            msg = (
                f"documents[{i}] is a {type(doc).__name__}, not a langchain_core Document; "
                "wrap text as Document(page_content=text, id=...)"
            )
            raise ValueError(msg)
        text = doc.page_content
        if not isinstance(text, str):
            msg = (
                f"documents[{i}] has no string page_content (got {type(text).__name__}); "
                "set page_content to the passage text"
            )
            raise ValueError(msg)
        check_text(text, f"documents[{i}].page_content")
        if not text.strip():
            passthrough.append(doc)
            continue
        key = document_key(doc, id_key)
        if key is None:
            base = content_key(text)
            same = anonymous.setdefault(base, [])
            match = next((n for n, other in enumerate(same) if other == doc), None)
            if match is None:
                same.append(doc)
                match = len(same) - 1
            key = base if match == 0 else f"{base}#{match + 1}"
        chunk = make_chunk(text, id=key)
        seen = texts.setdefault(chunk.key, text)
        if seen != text:
            msg = (
                f"documents[{i}] has id {chunk.key!r} like an earlier document but different "
                "text; CRAFT identifies chunks by id, so give distinct passages distinct ids "
                "(or set id_key=None and clear Document.id to key by content)"
            )
            raise ValueError(msg)
        chunks.append(chunk)
        plannable.append(doc)
    return SplitDocuments(docs, tuple(chunks), tuple(plannable), tuple(passthrough))


def documents_to_chunks(documents: object, id_key: str | None) -> list[Chunk]:
    """The chunks of :func:`split_documents` (documents without text have none)."""
    return list(split_documents(documents, id_key).chunks)


def apply_plan(
    split: SplitDocuments,
    plan: Plan,
    *,
    committed: bool,
) -> CraftDocuments:
    """Map a plan over ``split.chunks`` back to the documents; pass-through documents follow
    the planned ones in input order.

    The plan holds the very chunk objects it was given, so identity maps them back: metadata,
    ids and any subclass of each document are kept as they were. O(k).
    """
    by_chunk = {id(c): d for c, d in zip(split.chunks, split.plannable, strict=True)}
    out = CraftDocuments(
        [*(by_chunk[id(c)] for c in plan.ordered), *split.passthrough],
        plan=plan,
        removed_duplicates=[by_chunk[id(c)] for c in plan.removed_duplicates],
        repeated_in_request=[by_chunk[id(c)] for c in plan.repeated_in_request],
        passthrough=split.passthrough,
        committed=committed,
    )
    lost = len(split.documents) - len(out) - len(out.removed_duplicates)
    assert lost == len(out.repeated_in_request), "a document was lost"
    return out


def plan_summary(plan: Plan, *, committed: bool) -> dict[str, Any]:
    """JSON-ready summary of a plan: the payload of the ``craft_plan`` callback event."""
    return {
        "plan_id": plan.plan_id,
        "conversation_id": plan.conversation_id,
        "turn": plan.turn,
        "policy": plan.policy,
        "order": list(plan.keys),
        "removed_duplicates": [c.key for c in plan.removed_duplicates],
        "repeated_in_request": [c.key for c in plan.repeated_in_request],
        "matched_chunks": plan.matched_chunks,
        "matched_tokens": plan.matched_tokens,
        "committed": committed,
    }


def conversation_id_from_config(
    config: RunnableConfig | Mapping[str, Any] | None, keys: Sequence[str]
) -> str | None:
    """The first of ``keys`` set (not ``None``) in ``config["configurable"]``, as the core's
    conversation id (:func:`craft_rag.validation.validate_conversation_id`: a non-empty
    string); else ``None``. A LangGraph/LangChain thread or session id that is a ``UUID`` or an
    ``int`` is the framework's own id type and becomes its string (``0`` -> ``"0"``); anything
    else that is not a non-empty string raises ``ValueError`` naming the key."""
    if not config:
        return None
    configurable = config.get("configurable") or {}
    for key in keys:
        value = configurable.get(key)
        if value is None:
            continue
        if isinstance(value, UUID) or (isinstance(value, int) and not isinstance(value, bool)):
            value = str(value)
        return validate_conversation_id(value, f'config["configurable"][{key!r}]')
    return None
