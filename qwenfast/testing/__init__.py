"""Test helpers: tiny random Qwen-Image pipelines built offline (imported only by tests and tools)."""
