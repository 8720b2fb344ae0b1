"""Out-of-memory back-off: a batch that does not fit is split and retried, never lost.

Why: the memory planner predicts, it does not guarantee (fragmentation, other processes, a prompt
longer than planned). When `torch.OutOfMemoryError` is raised during a batch:

1. the memory the failed attempt held is released (the exception and its frames are dropped first,
   then `torch.cuda.empty_cache()`),
2. the remaining items are retried in chunks of half the size, down to 1,
3. at size 1 the fallbacks run in order (VAE tiling, offload "model", offload "blocks"), each
   followed by a retry,
4. only then a `GenerationOutOfMemory` (a RuntimeError naming what was tried) is raised.

Images are equal to the unsplit batch because the initial noise of the WHOLE batch is drawn once,
from the caller's generator(s) exactly as the pipeline would, before any split (generator states are
saved before the first attempt and restored before the split), and each chunk gets its slice.
Every chunk that succeeded is kept.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["GenerationOutOfMemory", "is_oom", "run_in_chunks", "vae_decode", "with_oom_backoff"]

log = logging.getLogger("qwenfast")


class GenerationOutOfMemory(RuntimeError):
    """CUDA out of memory even at batch size 1 with every fallback; the message says what was tried."""


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_in_chunks(fn: Callable[[int, int], object], n: int, *, start: int | None = None,
                  fallbacks: Sequence[tuple[str, Callable[[], None]]] = (), what: str = "batch",
                  events: list | None = None) -> list:  # fmt: skip
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


def vae_decode(vae, z: torch.Tensor, events: list | None = None) -> torch.Tensor:
    """`vae.decode(z)` that splits the batch on OOM, then falls back to tiling. (B, z, h, w) -> (B, 3, 8h, 8w)."""
    saved = vae.tiling

    def tiles():
        vae.tiling = True

    try:
        parts = run_in_chunks(lambda i, j: vae.decode(z[i:j]), z.shape[0], fallbacks=[("VAE tiling", tiles)],
                              what="VAE decode batch", events=events)  # fmt: skip
    finally:
        vae.tiling = saved
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _generators(g) -> list[torch.Generator]:
    if g is None:
        return []
    return list(g) if isinstance(g, (list, tuple)) else [g]


def _merge(parts: list, output_type: str):
    if output_type == "pil":
        return [im for p in parts for im in p]
    if output_type == "np":
        return np.concatenate(parts)
    return torch.cat(parts)


def with_oom_backoff(call):
    """Decorator for a pipeline's `__call__`: on OOM, split the batch (see the module docstring).

    Active when `self.oom_backoff` is true (the default of `QwenImagePipeline`). The first attempt is
    the plain call, untouched; only an OOM takes the split path.
    """
    sig = inspect.signature(call)

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        if not getattr(self, "oom_backoff", False) or getattr(self, "_in_backoff", False):
            return call(self, *args, **kwargs)
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.pop("self")
        gens = _generators(a.get("generator"))
        states = [g.get_state() for g in gens]
        try:
            return call(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            first = f"{type(e).__name__}"
        free_memory()
        for g, s in zip(gens, states):
            g.set_state(s)
        return _split_call(self, call, a, first)

    return wrapper


def _split_call(pipe, call, a: dict, first_error: str):
    from ..pipeline import scheduler as S
    from ..pipeline.text_to_image import QwenImageOutput, _as_prompt_list, randn_tensor

    n = a["num_images_per_prompt"]
    prompts = [p for p in _as_prompt_list(a["prompt"], "prompt") for _ in range(n)]
    negs = None
    if a.get("negative_prompt") is not None:
        neg = _as_prompt_list(a["negative_prompt"], "negative_prompt")
        neg = neg * (len(prompts) // n) if len(neg) == 1 else neg
        negs = [p for p in neg for _ in range(n)]
    B = len(prompts)
    x = a.get("latents")
    if x is None:  # the whole batch's noise, drawn exactly as the unsplit call would draw it
        height, width = pipe.output_size(a)
        h, w = S.latent_hw(height, width, pipe.vae_scale_factor)
        noise = randn_tensor((B, 1, 16, h, w), a.get("generator"), pipe.device, pipe.dtype)
        x = S.pack_latents(noise[:, 0])
    events = [f"batch of {B} ran out of memory ({first_error})"]
    log.warning("%s; splitting", events[0])
    saved_tiling = pipe.vae.tiling

    def chunk(i, j):
        kw = dict(a, prompt=prompts[i:j], negative_prompt=None if negs is None else negs[i:j],
                  num_images_per_prompt=1, latents=x[i:j], generator=None)  # fmt: skip
        pipe._in_backoff = True
        try:
            return call(pipe, **kw).images
        finally:
            pipe._in_backoff = False

    fallbacks = [("VAE tiling", lambda: setattr(pipe.vae, "tiling", True))]
    if hasattr(pipe, "enable_offload"):
        mode = getattr(pipe, "offload", "none")
        if mode == "none":
            fallbacks.append(("offload='model'", lambda: pipe.enable_offload("model")))
        if mode in ("none", "model") and pipe.device.type == "cuda":
            fallbacks.append(("offload='blocks'", lambda: pipe.enable_offload("blocks")))
    try:
        parts = run_in_chunks(
            chunk, B, start=max(1, (B + 1) // 2), fallbacks=fallbacks if B >= 1 else (), events=events
        )
    finally:
        pipe.vae.tiling = saved_tiling
    return QwenImageOutput(images=_merge(parts, a["output_type"]), info={"oom_backoff": events})
