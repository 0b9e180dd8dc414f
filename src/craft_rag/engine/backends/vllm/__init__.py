"""The in-process vLLM backend: :mod:`.backend` (settings, start-up, token-id requests, delta
outputs) and :mod:`.logs` (quiet start-up). vLLM itself is imported only when an engine starts.
"""
