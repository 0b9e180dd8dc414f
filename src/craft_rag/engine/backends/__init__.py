"""The engine's two last hops, one package each: :mod:`.vllm` (an in-process vLLM engine stepped
by :class:`craft_rag.engine.driver.EngineDriver`) and :mod:`.server` (a vLLM OpenAI-compatible
server over HTTP). Everything above them (planning, rendering, committing) is shared; what they
share below is the request state in :mod:`craft_rag.engine.driver` and the KV-event sync in
:mod:`craft_rag.engine.kv_events`. Importing this package imports neither vLLM nor httpx.
"""
