"""Asynchronous RL post-training of LLMs on stale rollouts (GMC-GRPO and its baselines), in Lightning."""

__version__ = "0.1.0"
