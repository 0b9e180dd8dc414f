"""craft-rag-bench: the evaluation harness of craft-rag, kept out of the library.

Datasets (:mod:`craft_rag_bench.datasets`), workload traces (:mod:`craft_rag_bench.corpus`,
:mod:`craft_rag_bench.workloads`), dense retrieval (:mod:`craft_rag_bench.retrieval`), the demo
and the benchmark suites (:mod:`craft_rag_bench.bench`). It adds the ``craft-rag demo``,
``craft-rag bench`` and ``craft-rag trace`` subcommands through the ``craft_rag.commands``
entry-point group; ``pip install craft-rag`` alone installs none of it.
"""
