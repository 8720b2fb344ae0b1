"""Out-of-memory back-off: a batch that does not fit is split and retried, never lost.

Why: the memory planner predicts, it does not guarantee (fragmentation, other processes, a prompt
longer than planned). `run_in_chunks(fn, n)` calls `fn(i, j)` over [0, n); when
`torch.OutOfMemoryError` is raised:

1. the memory the failed attempt held is released (the exception and its frames are dropped first,
   then `torch.cuda.empty_cache()`),
2. the remaining items are retried in chunks of half the size, down to 1,
3. at size 1 the caller's fallbacks run in order (e.g. VAE tiling), each followed by a retry,
4. only then a `GenerationOutOfMemory` (a RuntimeError naming what was tried) is raised.

The pipelines run their denoise core through it with the noise of the whole batch already drawn
(`pipeline/base.py`), so a split changes nothing but the batch size, and every chunk that succeeded
is kept. All of it is per call: nothing is switched on for later calls.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence

import torch

from ..errors import GenerationOutOfMemory

__all__ = ["GenerationOutOfMemory", "is_oom", "run_in_chunks", "vae_decode"]

log = logging.getLogger("qwenfast")


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_in_chunks(
    fn: Callable[[int, int], object],
    n: int,
    *,
    start: int | None = None,
    fallbacks: Sequence[tuple[str, Callable[[], None]]] = (),
    what: str = "batch",
    events: list | None = None,
) -> list:
    """Call fn(i, j) over [0, n) in chunks, halving the chunk on OOM, then trying `fallbacks`.

    Returns the chunk results in order. `events` (if given) receives one line per back-off step.
    """
    size = max(1, min(start or n, n))
    todo = list(fallbacks)
    events = [] if events is None else events
    out, i = [], 0
    while i < n:
        k = min(size, n - i)
        err = None
        try:
            out.append(fn(i, i + k))
            i += k
            continue
        except Exception as e:  # noqa: BLE001 - only OOM is handled; everything else is re-raised below
            if not is_oom(e):
                raise
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # the exception (and the frames holding the failed attempt's tensors) is gone here
        free_memory()
        if k > 1:
            size = max(1, (k + 1) // 2)
            events.append(f"{what} of {k} ran out of memory; retrying in chunks of {size}")
        elif todo:
            name, enable = todo.pop(0)
            enable()
            events.append(f"{what} of 1 ran out of memory; retrying with {name}")
        else:
            tried = "; ".join(events) or "nothing else to try"
            raise GenerationOutOfMemory(
                f"CUDA out of memory at {what} size 1 after every fallback ({tried}). Last error: {err}. "
                "Use a smaller image, offload='blocks', or a GPU with more memory."
            )
        if events:
            log.warning("%s", events[-1])
    return out


def vae_decode(vae: torch.nn.Module, z: torch.Tensor, events: list | None = None) -> torch.Tensor:
    """`vae.decode(z)` that splits the batch on OOM, then falls back to tiling. (B, z, h, w) -> (B, 3, 8h, 8w)."""
    saved = vae.tiling

    def tiles():
        vae.tiling = True
        if saved == "auto":  # later decodes this large tile without trying (an OOM costs a collection)
            px = z.shape[-2] * z.shape[-1] * vae.spatial_compression_ratio**2
            vae.untiled_oom = min(px, getattr(vae, "untiled_oom", None) or px)

    try:
        parts = run_in_chunks(
            lambda i, j: vae.decode(z[i:j]),
            z.shape[0],
            fallbacks=[("VAE tiling", tiles)],
            what="VAE decode batch",
            events=events,
        )
    finally:
        vae.tiling = saved
    return parts[0] if len(parts) == 1 else torch.cat(parts)
