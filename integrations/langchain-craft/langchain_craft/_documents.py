"""LangChain documents <-> craft-rag chunks, the planned-documents list, conversation ids.

Identity: a document's chunk key is ``Document.id`` when set, else ``metadata[id_key]`` when that
is a non-empty string, else the sha256 of ``page_content`` (:func:`craft_rag.content_key`). Keys
must be stable across requests, or CRAFT cannot see that two requests share a chunk; vector
stores that fill ``Document.id`` (FAISS, Chroma, InMemoryVectorStore...) give that for free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from langchain_core.documents import Document
from langchain_core.runnables import RunnableConfig

from craft_rag import Chunk, Plan, make_chunk

DEFAULT_CONVERSATION_KEYS: tuple[str, ...] = ("conversation_id", "session_id", "thread_id")
"""Keys of ``config["configurable"]`` read, in this order, as the conversation id."""

CRAFT_PLAN_EVENT = "craft_plan"
"""Name of the custom callback event carrying :func:`plan_summary` for every planned request."""


class CraftDocuments(list[Document]):
    """The documents to render, in CRAFT order, plus what the plan left out.

    A plain ``list`` for every LangChain consumer; the extra attributes say what happened:
    ``plan`` (``None`` for an empty input), ``removed_duplicates`` (sent in an earlier turn of
    the conversation), ``repeated_in_request`` (same key twice in this request; the first one is
    kept), ``committed`` (whether the planner already recorded this request) and ``planner``
    (the planner that made the plan). Every input
    document is in exactly one of the list, ``removed_duplicates`` and ``repeated_in_request``.
    """

    __slots__ = ("committed", "plan", "planner", "removed_duplicates", "repeated_in_request")

    def __init__(
        self,
        documents: Sequence[Document] = (),
        *,
        plan: Plan | None = None,
        removed_duplicates: Sequence[Document] = (),
        repeated_in_request: Sequence[Document] = (),
        committed: bool = False,
        planner: object | None = None,
    ) -> None:
        super().__init__(documents)
        self.plan = plan
        self.planner = planner
        self.removed_duplicates: tuple[Document, ...] = tuple(removed_duplicates)
        self.repeated_in_request: tuple[Document, ...] = tuple(repeated_in_request)
        self.committed = committed


def document_key(doc: Document, id_key: str | None) -> str | None:
    """The caller id of ``doc`` (``Document.id``, then ``metadata[id_key]``), or ``None``."""
    if doc.id:
        return str(doc.id)
    if id_key is not None:
        value = doc.metadata.get(id_key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return None


def documents_to_chunks(documents: Sequence[Any], id_key: str | None) -> list[Chunk]:
    """One chunk per document, in input order. O(total text) for content hashing.

    Raises ``ValueError`` for an item that is not a ``Document`` or whose ``page_content`` is not
    a string, and for two documents with the same id but different text (CRAFT would render only
    one of them; give them distinct ids). Same id and same text is a plain duplicate: the planner
    keeps the first and reports the rest in ``repeated_in_request``.
    """
    if isinstance(documents, str | bytes | Document):
        msg = (
            f"expected a sequence of Documents, got a single {type(documents).__name__}; "
            "wrap it in a list"
        )
        raise ValueError(msg)
    chunks: list[Chunk] = []
    texts: dict[str, str] = {}
    for i, doc in enumerate(documents):
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
        key = document_key(doc, id_key)
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
    return chunks


def apply_plan(
    documents: Sequence[Document],
    chunks: Sequence[Chunk],
    plan: Plan,
    *,
    committed: bool,
    planner: object | None = None,
) -> CraftDocuments:
    """Map a plan over ``chunks`` (built from ``documents``, same order) back to the documents.

    The plan holds the very chunk objects it was given, so identity maps them back: metadata,
    ids and any subclass of each document are kept as they were. O(k).
    """
    by_chunk = {id(c): d for c, d in zip(chunks, documents, strict=True)}
    return CraftDocuments(
        [by_chunk[id(c)] for c in plan.ordered],
        plan=plan,
        removed_duplicates=[by_chunk[id(c)] for c in plan.removed_duplicates],
        repeated_in_request=[by_chunk[id(c)] for c in plan.repeated_in_request],
        committed=committed,
        planner=planner,
    )


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
    """The first of ``keys`` set in ``config["configurable"]``, as a string; else ``None``.

    ``str``, ``int`` and ``UUID`` values are accepted (LangGraph thread ids are often UUIDs);
    anything else, or an empty string, raises ``ValueError`` naming the key.
    """
    if not config:
        return None
    configurable = config.get("configurable") or {}
    for key in keys:
        value = configurable.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | UUID) or value == "":
            msg = (
                f'config["configurable"][{key!r}] must be a non-empty str, int or UUID '
                f"conversation id, got {value!r}"
            )
            raise ValueError(msg)
        return str(value)
    return None
