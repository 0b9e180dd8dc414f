"""``craft-rag replay TRACE.jsonl``: replay a trace under one or all ordering policies."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from craft_rag.cli_args import check_input_file, int_range, non_negative_int, positive_int
from craft_rag.ordering import DEFAULT_POLICY, ORDERING_POLICIES
from craft_rag.paths import default_model_dir
from craft_rag.planner import PlannerConfig
from craft_rag.prompt import PromptFormat
from craft_rag.replay.run import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_TOKENS, ReplayResult, replay
from craft_rag.tokenizer import HashingTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from craft_rag.trace import read_trace

_COLUMNS = (
    ("prefix_overlap", "prefix ovl"),
    ("total_overlap", "total ovl"),
    ("reused_chunk_fraction", "reused chunks"),
    ("reused_token_fraction", "reused tokens"),
    ("dedup_removed_fraction", "dedup removed"),
    ("planner_us_p50", "plan p50 us"),
    ("planner_us_p99", "plan p99 us"),
)


def add_replay_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("replay", help="replay a trace through the planner + simulated cache")
    p.add_argument("trace", help="trace file (JSON lines; see docs/configuration.md)")
    p.add_argument(
        "--policy",
        choices=[*sorted(ORDERING_POLICIES), "all"],
        default="all",
        help="ordering policy (default: all, side by side)",
    )
    p.add_argument("--window", type=positive_int, default=1000, help="CA-Table window in requests")
    p.add_argument("--unlimited-window", action="store_true", help="no CA-Table window")
    p.add_argument(
        "--threshold", type=positive_int, default=2, help="CP-Tree promotion threshold T"
    )
    p.add_argument("--promotion", choices=["threshold", "served"], default=None)
    p.add_argument("--no-dedup", action="store_true", help="disable conversation dedup")
    p.add_argument("--block-size", type=int_range(1, 1 << 20), default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--cache-tokens", type=non_negative_int, default=DEFAULT_CACHE_TOKENS)
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="drop oldest conversation turns to fit, as the engine does (engine default 4096)",
    )
    p.add_argument(
        "--max-tokens",
        type=non_negative_int,
        default=16,
        help="reply budget kept free (with --max-model-len)",
    )
    p.add_argument(
        "--tokenizer",
        choices=["auto", "model", "fallback"],
        default="auto",
        help="auto: the embedded model's tokenizer if prepared, else the hashing fallback",
    )
    p.add_argument(
        "--prompt",
        choices=["auto", "chat", "plain"],
        default="auto",
        help="prompt rendering: the embedded model's chat format (as the engine renders it) or "
        "plain text; auto = chat when the model's tokenizer is used",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="keep planner state in a shared store (memory://, sqlite:///path/state.db, "
        "redis://host:6379/0; namespace replay-<policy>): several replays sharing one store "
        "act as workers of one deployment (see docs/deployment.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_replay)


def _tokenizer(choice: str) -> Tokenizer:
    if choice == "fallback":
        return HashingTokenizer()
    return load_tokenizer(fallback=choice == "auto")


def _prompt_format(choice: str, tokenizer: Tokenizer) -> PromptFormat | None:
    use_chat = choice == "chat" or (choice == "auto" and isinstance(tokenizer, HFTokenizer))
    if not use_chat:
        return None
    # Text-only module (jinja2, no vLLM): renders exactly what CraftEngine sends.
    from craft_rag.engine.chat_format import derive_chat_format

    return derive_chat_format(default_model_dir())


def run_replay(args: argparse.Namespace) -> int:
    """Handler of ``craft-rag replay``. Raises ``ValueError`` (exit 2 in :func:`craft_rag.cli.main`)
    for a trace that is missing, not a file, malformed (naming the line) or empty."""
    check_input_file(args.trace, "trace")
    requests = read_trace(args.trace)
    if not requests:
        msg = f"trace {args.trace} holds no requests; pass a trace with at least one JSON line"
        raise ValueError(msg)
    tokenizer = _tokenizer(args.tokenizer)
    prompt_format = _prompt_format(args.prompt, tokenizer)
    policies = sorted(ORDERING_POLICIES) if args.policy == "all" else [args.policy]
    results: list[ReplayResult] = []
    for policy in policies:
        config = PlannerConfig(
            policy=policy,
            window=None if args.unlimited_window else args.window,
            threshold=args.threshold,
            promotion=args.promotion,
            dedup=not args.no_dedup,
        )
        results.append(
            replay(
                requests,
                config,
                tokenizer,
                prompt_format=prompt_format,
                block_size=args.block_size,
                cache_tokens=args.cache_tokens,
                max_model_len=args.max_model_len,
                max_tokens=args.max_tokens,
                store=args.store,
                namespace=f"replay-{policy}",
            )
        )
    if args.json:
        # One policy: its fields at the top level. All policies: the default policy's fields at
        # the top level (so the documented keys are always there) plus every policy by name.
        main = next((r for r in results if r.policy == DEFAULT_POLICY), results[0])
        payload: dict[str, Any] = main.to_json()
        if len(results) > 1:
            payload["policies"] = {r.policy: r.to_json() for r in results}
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(results))
    return 0


def format_table(results: list[ReplayResult]) -> str:
    """A side-by-side text table of replay results, one row per policy."""
    header = ["policy", *(label for _, label in _COLUMNS)]
    rows = [header]
    for r in results:
        values = [float(getattr(r, key)) for key, _ in _COLUMNS]
        rows.append(
            [r.policy]
            + [
                f"{v:.1f}" if key.startswith("planner") else f"{100 * v:.1f}%"
                for (key, _), v in zip(_COLUMNS, values, strict=True)
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    for r in results:
        lines.append(
            f"  {r.policy}: {r.prompt_tokens} prompt tokens, {r.cached_tokens} cached, "
            f"{r.prompt_tokens - r.cached_tokens} computed"
        )
    if results:
        r = results[0]
        lines.append(
            f"({r.requests} requests, {r.chunks_retrieved} chunks retrieved, tokenizer "
            f"{r.tokenizer}, block {r.block_size}, cache {r.cache_tokens} tokens)"
        )
    return "\n".join(lines)
