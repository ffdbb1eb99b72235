"""Reusable Lightning callbacks. Importing this package never imports transformers, vLLM or lit_gmc.module."""
