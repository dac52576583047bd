"""vLLM-style entry points (`python -m pagedserve.entrypoints.openai.api_server`)."""
