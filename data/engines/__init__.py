"""Rollout engines: transformers (here or in its own process), vLLM in-process, ``vllm serve``, weight transfer."""
