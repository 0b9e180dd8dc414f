"""NodeWithScore <-> craft_rag Chunk: which nodes CRAFT may reorder, and under which key.

A node is *plannable* when it is text-only and its LLM-visible text is non-empty:

* ``TextNode`` (and ``IndexNode``) but not ``ImageNode``;
* the newer ``Node``/``Document`` when it has a text resource and no image, audio or video.

Everything else (images, media, empty text) is *passed through*: returned untouched, after the
planned nodes, in its original relative order, and reported. A node is never lost.

The chunk text is ``node.get_content(metadata_mode=MetadataMode.LLM)``: exactly what a
LlamaIndex synthesizer would show the LLM, so the CRAFT prompt and a default prompt agree on
what a chunk is. Keys come from ``node.node_id`` or a sha256 of that text
(:func:`default_key_source`: the hash when the planner shares a store with other workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llama_index.core.schema import (
    BaseNode,
    ImageNode,
    MetadataMode,
    Node,
    NodeWithScore,
    TextNode,
)

from craft_rag import Chunk, ChunkKey, CraftPlanner, check_text, content_key, make_chunk
from craft_rag import validate_conversation_id as validate_conversation_id

KeySource = Literal["node_id", "content_hash"]
KEY_SOURCES: tuple[KeySource, ...] = ("node_id", "content_hash")


@dataclass(frozen=True, slots=True)
class SplitNodes:
    """Input nodes split into plannable chunks and pass-through nodes.

    ``chunks[i]`` was built from ``plannable[i]``; ``passthrough`` keeps input order. Every input
    node is in exactly one of ``plannable`` and ``passthrough``; ``passthrough_reasons`` is
    parallel to ``passthrough``.
    """

    chunks: tuple[Chunk, ...]
    plannable: tuple[NodeWithScore, ...]
    passthrough: tuple[NodeWithScore, ...]
    passthrough_reasons: tuple[str, ...]


def unplannable_reason(node: BaseNode) -> str | None:
    """Why ``node`` cannot be reordered as a text chunk, or ``None`` when it can. O(len(text))."""
    if isinstance(node, ImageNode):
        return f"{type(node).__name__} is not a text node"
    if isinstance(node, Node):
        if node.image_resource or node.audio_resource or node.video_resource:
            return f"{type(node).__name__} carries image/audio/video content"
    elif not isinstance(node, TextNode):
        return f"{type(node).__name__} is not a text node"
    if not node.get_content(metadata_mode=MetadataMode.NONE).strip():
        return "node has no text"
    return None


def node_text(node: BaseNode) -> str:
    """The text a LlamaIndex synthesizer would show the LLM for ``node``."""
    return node.get_content(metadata_mode=MetadataMode.LLM)


def default_key_source(planner: CraftPlanner | None) -> KeySource:
    """The key source when none is given: ``"content_hash"`` when ``planner`` shares its state
    through a store (other workers build their nodes with other random ids:
    ``VectorStoreIndex.from_documents`` gives every process new ones, so keyed by node id the
    same passage would be a new chunk on each worker, re-sent and never shared), else
    ``"node_id"`` (no hashing). O(1)."""
    return "content_hash" if planner is not None and planner.store is not None else "node_id"


def node_key(node: BaseNode, key_source: KeySource) -> str | None:
    """The chunk id for ``node``: its node id, or ``None`` to key by content hash."""
    if key_source == "node_id":
        return node.node_id
    if key_source == "content_hash":
        return None
    msg = f"unknown key_source {key_source!r}; choose one of {list(KEY_SOURCES)}"
    raise ValueError(msg)


def split_nodes(nodes: Sequence[NodeWithScore], key_source: KeySource) -> SplitNodes:
    """Build a chunk for each plannable node; set the others aside. O(total text).

    Nothing is merged that the caller passed as distinct: with ``key_source="content_hash"``
    two nodes with equal text but different node ids get distinct keys (``<hash>#2``...);
    only the same node id with the same text is one chunk (an exact duplicate, reported by
    the planner). Raises ``ValueError`` when an item is not a ``NodeWithScore``, for text that
    is not valid Unicode (naming the node), or when two nodes share a node id but differ in
    text (keyed by node id they would be one chunk and one text would be lost; give them
    distinct ids or use ``key_source="content_hash"``).
    """
    chunks: list[Chunk] = []
    plannable: list[NodeWithScore] = []
    passthrough: list[NodeWithScore] = []
    reasons: list[str] = []
    seen_text: dict[ChunkKey, str] = {}
    same_text: dict[str, list[str]] = {}
    for i, nws in enumerate(nodes):
        if not isinstance(nws, NodeWithScore):
            msg = (
                f"nodes[{i}] is a {type(nws).__name__}, not a NodeWithScore; wrap nodes as "
                "NodeWithScore(node=..., score=...)"
            )
            raise ValueError(msg)
        reason = unplannable_reason(nws.node)
        if reason is not None:
            passthrough.append(nws)
            reasons.append(reason)
            continue
        text = check_text(node_text(nws.node), f"nodes[{i}] ({nws.node.node_id!r}) text")
        key = node_key(nws.node, key_source)
        if key is None:
            base = content_key(text)
            ids = same_text.setdefault(base, [])
            if nws.node.node_id not in ids:
                ids.append(nws.node.node_id)
            n = ids.index(nws.node.node_id)
            key = base if n == 0 else f"{base}#{n + 1}"
        chunk = make_chunk(text, id=key, score=nws.score)
        previous = seen_text.setdefault(chunk.key, text)
        if previous != text:
            msg = (
                f"two nodes share node id {chunk.key!r} but have different text; give them "
                "distinct node ids or use key_source='content_hash'"
            )
            raise ValueError(msg)
        chunks.append(chunk)
        plannable.append(nws)
    return SplitNodes(tuple(chunks), tuple(plannable), tuple(passthrough), tuple(reasons))


def chunk_for_node(nws: NodeWithScore, key_source: KeySource) -> Chunk:
    """The chunk of one plannable node (``ValueError`` naming the reason when it is not)."""
    reason = unplannable_reason(nws.node)
    if reason is not None:
        msg = f"node {nws.node.node_id!r} cannot be sent as a text chunk: {reason}"
        raise ValueError(msg)
    return make_chunk(node_text(nws.node), id=node_key(nws.node, key_source), score=nws.score)
