"""Peer chunk orders for the side-by-side suites: what users would run instead of CRAFT.

- ``contextpilot_online``: ContextPilot 0.5.0 (PyPI ``contextpilot``, MLSys 2026) the way its
  stateful server runs it: ONE ``ContextPilot`` instance, each request's chunk ids passed alone,
  in arrival order, to ``reorder(...)``. It sees only the past.
- ``contextpilot_offline``: its offline batch mode, ``reorder(all requests)`` in one call. It
  SEES THE FUTURE (every request of the trace before the first is served); it also proposes an
  execution order, which is not used: requests keep their arrival order (conversations must).
- ``long_context_reorder``: LangChain's / LlamaIndex's ``LongContextReorder`` ("lost in the
  middle": most relevant first and last, least relevant in the middle), the real
  ``langchain_community`` class when importable, else the LlamaIndex postprocessor, else its
  documented rule.

Every order is a permutation of each request's chunks; the suites serve it with the
``retriever`` planner (which keeps the given order) on the same simulator or engine as CRAFT.
Peers get no conversation dedup (it is CRAFT's, not theirs).

ContextPilot 0.5.0 workaround: once a tree level has >= 1,000 children, its online search
(``compute_distances_batch``) sends a nested function to a ``multiprocessing.Pool`` and raises
"Can't pickle local object". :func:`_serial_distances` is the serial branch the same function
runs for small inputs (same ``compute_distance_single``), patched in for the duration of a run
only. Its progress prints (stdout and stderr) are silenced.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.trace import TraceRequest

CONTEXTPILOT_VERSION = "0.5.0"
PEER_ORDERS: tuple[str, ...] = (
    "contextpilot_online", "contextpilot_offline", "long_context_reorder",
)
SEES_FUTURE: frozenset[str] = frozenset({"contextpilot_offline"})
"""Peers that read the whole trace before ordering its first request."""

_INSTALL_HINT = (
    "the ContextPilot peer needs contextpilot; run "
    f"`.venv/bin/pip install --no-deps contextpilot=={CONTEXTPILOT_VERSION}` "
    "(or `pip install 'craft-rag-bench[peers]'`)"
)


def available(name: str) -> bool:
    """True when the peer ``name`` can run here (ContextPilot is an optional dependency)."""
    if name not in PEER_ORDERS:
        return False
    if name.startswith("contextpilot"):
        try:
            import contextpilot.server.live_index  # noqa: F401
        except ImportError:
            return False
    return True


def available_peers() -> tuple[str, ...]:
    """The peers that can run in this environment, in :data:`PEER_ORDERS` order."""
    return tuple(p for p in PEER_ORDERS if available(p))


def peer_orders(name: str, requests: Sequence[Sequence[Chunk]]) -> list[list[Chunk]]:
    """Each request's chunks in the order the peer ``name`` gives them (arrival order kept).

    ``ValueError`` names the valid peers; ``ImportError`` says how to install ContextPilot.
    Cost: ContextPilot online is one hierarchical search + insert per request; offline one
    clustering of the whole batch (O(n^2) distances); LongContextReorder O(k) per request.
    """
    if name not in PEER_ORDERS:
        msg = f"unknown peer order {name!r}; choose one of {list(PEER_ORDERS)}"
        raise ValueError(msg)
    if name == "long_context_reorder":
        return [long_context_reorder(r) for r in requests]
    return _contextpilot(requests, online=name == "contextpilot_online")


def peer_trace(name: str, trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """``trace`` with each request's chunks in the peer's order (see :func:`peer_orders`)."""
    orders = peer_orders(name, [r.chunks for r in trace])
    return [replace(r, chunks=tuple(o)) for r, o in zip(trace, orders, strict=True)]


# ---- LongContextReorder ---------------------------------------------------------------------


def _litm_rule(items: list[Any]) -> list[Any]:
    """The documented rule (langchain_community ``_litm_reordering``), on retriever order."""
    items = list(reversed(items))
    out: list[Any] = []
    for i, value in enumerate(items):
        if i % 2 == 1:
            out.append(value)
        else:
            out.insert(0, value)
    return out


def long_context_reorder(chunks: Sequence[Chunk]) -> list[Chunk]:
    """``LongContextReorder`` on chunks in retriever order (most relevant first). Uses the
    real LangChain class, else LlamaIndex's (scores = minus retriever rank, so its sort by
    score sees the retriever order), else :func:`_litm_rule`. O(k^2) for the list inserts."""
    if len(chunks) < 2:
        return list(chunks)
    by_key: dict[str, Chunk] = {str(c.key): c for c in chunks}
    keys = _litm_langchain([c.key for c in chunks])
    if keys is None:
        keys = _litm_llama_index([c.key for c in chunks])
    if keys is None:
        keys = _litm_rule([c.key for c in chunks])
    return [by_key[k] for k in keys]


def _litm_langchain(keys: list[str]) -> list[str] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # langchain-community's sunset notice
            from langchain_community.document_transformers import LongContextReorder
            from langchain_core.documents import Document
    except ImportError:
        return None
    docs = [Document(page_content="", metadata={"key": k}) for k in keys]
    out = LongContextReorder().transform_documents(docs)
    return [str(d.metadata["key"]) for d in out]


def _litm_llama_index(keys: list[str]) -> list[str] | None:
    try:
        from llama_index.core.postprocessor import LongContextReorder
        from llama_index.core.schema import NodeWithScore, TextNode
    except ImportError:
        return None
    nodes = [NodeWithScore(node=TextNode(id_=k, text=""), score=-float(i))
             for i, k in enumerate(keys)]
    out = LongContextReorder().postprocess_nodes(nodes)
    return [n.node.node_id for n in out]


# ---- ContextPilot ---------------------------------------------------------------------------


def _serial_distances(
    queries: list[list[int]], targets: list[list[int]], alpha: float = 0.001,
    num_workers: int | None = None,
) -> Any:
    """ContextPilot's ``compute_distances_batch`` small-input branch for every size (the
    parallel branch of 0.5.0 cannot pickle its nested worker). Same distance function."""
    import numpy as np
    from contextpilot.context_index.compute_distance_cpu import compute_distance_single

    out = np.ones((len(queries), len(targets)), dtype=np.float32)
    for i, query in enumerate(queries):
        for j, target in enumerate(targets):
            out[i, j] = compute_distance_single(query, target, alpha)
    return out


@contextlib.contextmanager
def _quiet_serial() -> Iterator[None]:
    """Silence ContextPilot's prints/logs/warnings and patch in the serial distance branch,
    restoring everything on exit."""
    try:
        import contextpilot.server.live_index as live
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    saved: Callable[..., Any] = live.compute_distances_batch
    logger = logging.getLogger("contextpilot")
    level = logger.level
    live.compute_distances_batch = _serial_distances
    logger.setLevel(logging.ERROR)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        live.compute_distances_batch = saved
        logger.setLevel(level)


def _contextpilot(requests: Sequence[Sequence[Chunk]], *, online: bool) -> list[list[Chunk]]:
    out: list[list[Chunk]] = []
    with _quiet_serial():
        from contextpilot.server.live_index import ContextPilot

        pilot = ContextPilot(use_gpu=False)
        if online:
            for chunks in requests:
                if not chunks:
                    out.append([])
                    continue
                reordered, _ = pilot.reorder([str(c.key) for c in chunks])
                out.append(_apply(chunks, reordered[0]))
            return out
        batch = [[str(c.key) for c in chunks] for chunks in requests]
        reordered, indices = pilot.reorder(batch)
    # reordered[i] is the order for input request indices[i] (its proposed schedule).
    by_request: dict[int, list[str]] = {int(j): list(r) for r, j in zip(reordered, indices,
                                                                         strict=True)}
    return [_apply(chunks, by_request.get(i, [])) for i, chunks in enumerate(requests)]


def _apply(chunks: Sequence[Chunk], keys: Sequence[str]) -> list[Chunk]:
    """``chunks`` in the order of ``keys``; any chunk the peer dropped keeps its retriever
    place at the end, so the result is always a permutation of ``chunks``."""
    by_key = {str(c.key): c for c in chunks}
    out: list[Chunk] = []
    for key in keys:
        chunk = by_key.pop(str(key), None)
        if chunk is not None:
            out.append(chunk)
    out.extend(c for c in chunks if str(c.key) in by_key)
    return out
