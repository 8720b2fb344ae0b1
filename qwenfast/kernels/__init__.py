"""Fused kernels for the transformer's memory-bound glue, and the ONE switch that picks them.

Every op lives in its own module as three things: a Triton kernel, a Python launcher, and an
`<op>_ref` written in plain torch that is numerically what `qwenfast.models.transformer` does
today. A launcher runs the Triton kernel only when

- `backend()` is "triton",
- triton imports, and
- the tensors are on CUDA (or `TRITON_INTERPRET=1` is set, which runs the kernel on CPU tensors in
  Triton's interpreter: slow, for checking kernel logic only),

and the layout is one the kernel handles; in every other case it returns the reference result (no
error). Choose the backend with the environment variable `QWENFAST_KERNELS` (auto|triton|torch,
read once, on the first call of `backend()`; auto = "triton" when triton imports and CUDA is
available), or from code with `set_backend(name)` / `with use_backend(name): ...`.

Ops:
- `adaln.layernorm_modulate`: LayerNorm (no affine) then x*(1+scale)+shift, one pass.
- `gated_residual.gated_residual_layernorm_modulate`: x + gate*y, then the next LayerNorm and
  modulation, one pass; `gated_residual.gated_residual` alone.
- `qk_norm_rope.qk_norm_rope`: per-head RMSNorm of Q and K, RoPE, and the scatter of Q/K/V
  into the joint (B, H, S, Dh) attention buffers, one pass over the fused QKV projection.
- `gelu.linear_gelu_tanh`: the MLP's first Linear with GELU(tanh) in the cuBLASLt epilogue.
- `attn_quant.quantize_qkv`: Q, K, V -> e4m3 + descales (amax on the GPU) for 8-bit attention.
- `rmsnorm_silu.rmsnorm_silu` (VAE): channel RMSNorm (+ the previous conv's bias) and SiLU, one pass.
- `bias_residual.bias_residual` (VAE): a conv's bias plus the residual (and its bias), one pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache

import torch

__all__ = [
    "BACKENDS",
    "backend",
    "set_backend",
    "use_backend",
    "triton_available",
    "interpreting",
    "use_triton",
]

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "QWENFAST_KERNELS"

_backend: str | None = None  # resolved name ("triton" | "torch"); None = not chosen yet


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `import triton` works (checked once)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _resolve(name: str) -> str:
    name = (name or "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        return "triton" if triton_available() and torch.cuda.is_available() else "torch"
    return name


def backend() -> str:
    """The active kernel backend: "triton" or "torch" (chosen once from $QWENFAST_KERNELS)."""
    global _backend
    if _backend is None:
        _backend = _resolve(os.environ.get(ENV_VAR, "auto"))
    return _backend


def set_backend(name: str | None) -> str:
    """Switch backend for the whole process ("auto", "triton" or "torch"; None = re-read the env).

    Returns the resolved name. "triton" is accepted even where triton is missing: launchers then
    still fall back to the reference.
    """
    global _backend
    _backend = _resolve(os.environ.get(ENV_VAR, "auto") if name is None else name)
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Temporarily switch backend: `with use_backend("torch"): ...` (restores the previous one)."""
    global _backend
    previous = _backend
    try:
        yield set_backend(name)
    finally:
        _backend = previous


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a launcher should run its Triton kernel on these tensors (not the layout checks).

    Never while autograd records: the kernels have no backward, and running them would silently cut
    the gradient (training would leave the modulation weights untouched), so training gets the
    differentiable references.
    """
    if backend() != "triton" or not triton_available():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if interpreting():
        return all(t.device.type == "cpu" for t in tensors)
    return all(t.is_cuda for t in tensors) and len({t.device for t in tensors}) == 1


def _on_device(t: torch.Tensor) -> AbstractContextManager:
    """Triton launches on the current CUDA device: switch to `t`'s device when it is another one."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return nullcontext()


def _num_warps(block: int) -> int:
    """Warps for a one-row program of `block` elements: one per 1024 elements, 1..8.

    Measured on H200 (bf16, 4096 x 3072 rows, block 4096): 4 warps beat 8 by ~10% for the
    LayerNorm kernels and 16 was slowest; the gated residual was flat.
    """
    return max(1, min(8, block // 1024))


def _tl_dtype(dtype: torch.dtype):
    """The triton.language dtype for a supported torch dtype, else None."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype)


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
