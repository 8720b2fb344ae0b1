"""Every error qwenfast raises on purpose, in one place (the lowest layer: imports nothing).

Each is a subclass of a builtin (`ValueError`, `RuntimeError`) so code written against the builtin
keeps working; the CLI prints these as one `error:` line, the server maps them to 4xx answers.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint config asks for something qwenfast does not support (or is malformed)."""


class CheckpointError(ValueError):
    """A checkpoint file or folder is missing, unreadable or does not match the model."""


class LoraError(ValueError):
    """A LoRA file or state dict cannot be used with this model (nothing was modified)."""


class OptionsError(ValueError):
    """An `EngineOptions` value or change is impossible (the message says what to do instead)."""


class ConfigureError(RuntimeError):
    """`pipe.configure(...)` asked for a change a loaded pipeline cannot make (e.g. FP8 back to bf16)."""


class ParallelError(RuntimeError):
    """A multi-process run (`--parallel`) failed on one of its ranks; the message names the rank."""


class GenerationOutOfMemory(RuntimeError):
    """CUDA out of memory even at batch size 1 with every fallback; the message says what was tried."""
