"""Engine side of craft-rag: an in-process vLLM engine that serves CRAFT-ordered prompts."""
