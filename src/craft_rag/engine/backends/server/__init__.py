"""The server backend: a vLLM OpenAI-compatible server over HTTP.

:mod:`.settings` (where the server is, its errors), :mod:`.answers` (bounded, checked reads of
what it answers), :mod:`.transport` (one connection, retries), :mod:`.backend` (the requests),
:mod:`.driver` (requests in flight, one thread each) and :mod:`.serve` (``craft-rag serve``:
starting such a server).
"""
