"""Reference models shared by tests, benchmarks and the demo."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
