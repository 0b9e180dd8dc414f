"""Corpus hubness as a predictor of chunk recurrence (issue 16 item 2 study).

Usage::

    python benchmarks/craft-rag-bench/scripts/corpus_hubness.py DATASET CORPUS TRACE OUT.json

Writes ``{passage id: k-occurrence}`` (how many passages of the corpus list it among their 10
nearest neighbours, MiniLM cosine, exact search) to ``OUT.json`` for the ``hub_*`` variants of
``order_variants.py`` (``CRAFT_HUB=OUT.json``), and prints, for the chunks of ``TRACE`` at
their first retrieval, how often they are retrieved again later, by hubness quintile. Hubness
is a property of the corpus alone, known before any request: no lookahead on the requests.
Cost: one exact 10-NN search over the corpus (~15,000 passages: seconds; embeddings cached).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np

from craft_rag.files import write_atomic
from craft_rag.trace import read_trace
from craft_rag_bench.datasets import load_dataset
from craft_rag_bench.retrieval.retriever import Retriever
from craft_rag_bench.workloads import TraceConfig, _corpus_for

NEIGHBOURS = 10


def main() -> None:
    dataset, corpus, trace_path, out = sys.argv[1:5]
    import faiss

    config = TraceConfig(dataset=dataset, corpus=corpus)
    passages = _corpus_for(config, load_dataset(dataset, None), None)
    vectors = Retriever.build(passages, kind="flat", show_progress=False).embeddings
    vectors = np.ascontiguousarray(vectors, dtype="float32")
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    _, nearest = index.search(vectors, NEIGHBOURS + 1)
    hub = np.bincount(nearest[:, 1:].ravel(), minlength=len(passages))
    by_id = {p.id: int(h) for p, h in zip(passages, hub, strict=True)}
    write_atomic(out, json.dumps(by_id))

    trace = read_trace(trace_path)
    later = Counter(c.key for r in trace for c in r.chunks)
    seen: set[str] = set()
    rows: list[tuple[int, bool]] = []
    for request in trace:
        for chunk in request.chunks:
            later[chunk.key] -= 1
            if chunk.key not in seen:
                seen.add(chunk.key)
                rows.append((by_id.get(chunk.key, 0), later[chunk.key] > 0))
    hubs = np.array([h for h, _ in rows], dtype=float)
    recur = np.array([r for _, r in rows], dtype=float)
    bins = np.digitize(hubs, np.quantile(hubs, [0.2, 0.4, 0.6, 0.8]))
    print(f"{trace_path}: {len(rows)} first-seen chunks, {recur.mean():.3f} retrieved again")
    for q in range(5):
        m = bins == q
        if m.any():
            print(f"  hubness quintile {q + 1}: {int(m.sum())} chunks, hubness "
                  f"{hubs[m].min():.0f}-{hubs[m].max():.0f}, retrieved again {recur[m].mean():.3f}")


if __name__ == "__main__":
    main()
