"""Per-row (per-token) e4m3 quantisation shared by `FP8Linear` and the kernels that feed it.

Why this module: an FP8 GEMM input used to be written in bf16 by the kernel that produced it, then
read again and written once more in e4m3 by a separate pass (`fp8_linear.quantize_rows`). The
producers that hold a whole row in registers anyway (LayerNorm + modulation, the gated residual's
LayerNorm, the MLP's GELU) now also take the row's amax and write e4m3 + the fp32 scale themselves
(`QuantizedRows`), and `FP8Linear` skips its own pass. This file holds what they share:

- the row layout `FP8Linear` multiplies: (Mp, K) e4m3 + (Mp, 1) fp32 scales, Mp = `gemm_rows(M)`
  (cuBLASLt refuses 2 <= M <= 32 with rowwise scales, see `FP8Linear.forward`: the rows past M are
  zeros with scale 1, written by the launcher);
- `quantize_rows_ref`, the torch definition every kernel is checked against;
- Triton helpers `_e4m3` (fp32 -> e4m3 as torch rounds, also under the CPU interpreter, whose own
  cast mis-rounds when the mantissa carries into the exponent: 31.97 -> 16 instead of 32 in
  triton 3.7), `_row_scale` / `_codes` (the scale of an amax, the codes of values at a scale: the
  one formula every quantising kernel uses) and `_quant_row` (amax, scale, store of one row already
  in registers).

The quantisation is `quantize_rows_ref`'s: scale = max(amax(|row|) / 448, 1e-12), q = e4m3(clamp(
row / scale, ±448)), computed on the row *as the producer would have stored it* (rounded to the
activation dtype first), so a fused producer writes the same bytes as the unfused
`quantize_rows(producer(x))` (same fp32 division on the same values).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import interpreting, triton_available

__all__ = [
    "FP8",
    "FP8_MAX",
    "MIN_SCALE",
    "MIN_ROWS",
    "QuantizedRows",
    "gemm_rows",
    "empty_rows",
    "quantize_rows_ref",
    "quantize_rows_ref_padded",
    "fp8_fusion",
    "set_fp8_fusion",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row gets a tiny scale, not a division by zero
MIN_ROWS = 64  # GEMM rows are padded to at least this (see FP8Linear.forward)

# The producers quantise for their FP8Linear consumers (on by default; QWENFAST_FP8_FUSE=0 or
# `set_fp8_fusion(False)` restores one separate quantisation pass per GEMM, for A/B measurements;
# QWENFAST_FP8_FUSE=norm fuses the LayerNorm producers only, not the MLP's GELU pass).
# Read when a block runs: CUDA graphs captured under one setting keep it until recaptured.
_MODE = os.environ.get("QWENFAST_FP8_FUSE", "1").strip().lower()
_FUSE = _MODE not in ("0", "false", "off")
# The GELU pass as a producer (`gelu_tanh_fp8`): its first kernel (one program per row holding the
# whole row) took 9.83 ms per forward against 3.70 + ~2.9 for torch's GELU and the separate pass; the
# chunked kernel that takes the amax from max(h) (GELU is monotonic where it matters) measured
# 84.67 vs 85.52 ms per FP8 forward at 1024² (H200, bench/results/gelu_fp8.jsonl), so it is on by default.
_FUSE_GELU = _MODE != "norm"


def fp8_fusion() -> bool:
    """Whether kernels that produce an FP8 GEMM's input quantise it themselves."""
    return _FUSE


def fp8_gelu_fusion() -> bool:
    """Whether the MLP's GELU pass also writes its FP8 rows (on unless QWENFAST_FP8_FUSE=norm or 0)."""
    return _FUSE and _FUSE_GELU


def set_fp8_fusion(on: bool, gelu: bool | None = None) -> tuple[bool, bool]:
    """Switch the producer-side quantisation for the whole process (`gelu`: the GELU pass too; None
    keeps its setting); returns the previous (on, gelu)."""
    global _FUSE, _FUSE_GELU
    previous = (_FUSE, _FUSE_GELU)
    _FUSE = bool(on)
    if gelu is not None:
        _FUSE_GELU = bool(gelu)
    return previous


def gemm_rows(m: int) -> int:
    """Rows of the quantised buffer for an M-row activation: M, or at least MIN_ROWS and a multiple of
    16 when 1 < M (cuBLASLt's rowwise-scaled FP8 GEMM refuses short odd shapes)."""
    return max(MIN_ROWS, -(-m // 16) * 16) if m > 1 else m


def empty_rows(
    m: int,
    k: int,
    device: torch.device,
    rows: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 (rows, k), fp32 (rows, 1)) for a kernel to fill rows [0, m); rows [m, rows) are written
    here: zeros with scale 1. `rows` defaults to `gemm_rows(m)`; `out`: caller's buffers of that
    layout (contiguous) instead of new ones."""
    rows = gemm_rows(m) if rows is None else rows
    if out is None:
        q = torch.empty(rows, k, dtype=FP8, device=device)
        s = torch.empty(rows, 1, dtype=torch.float32, device=device)
    else:
        q, s = out
        if (q.shape, q.dtype, s.shape, s.dtype) != ((rows, k), FP8, (rows, 1), torch.float32) or not (
            q.is_contiguous() and s.is_contiguous() and q.device == s.device == torch.device(device)
        ):
            raise ValueError(
                f"out must be contiguous ({rows}, {k}) float8_e4m3fn and ({rows}, 1) float32 tensors "
                f"on {device}, got {tuple(q.shape)} {q.dtype} and {tuple(s.shape)} {s.dtype}"
            )
    if rows > m:
        q[m:].view(torch.uint8).zero_()
        s[m:].fill_(1.0)
    return q, s


class QuantizedRows(NamedTuple):
    """An activation (..., K) already quantised per row by the kernel that produced it.

    `FP8Linear` multiplies `q`/`scale` directly (no quantisation pass of its own). `shape`, `dtype`
    and `device` are the activation's, so code that only looks at those (buffer sizes in
    `JointAttention.forward_fused`) is unchanged. `x` is the same activation in `dtype` when the
    consumer also needs it (an unmerged LoRA's side GEMM reads the bf16 input), else None.
    """

    q: torch.Tensor  # (Mp, K) e4m3, Mp = gemm_rows(M), rows >= M zero
    scale: torch.Tensor  # (Mp, 1) fp32
    shape: torch.Size  # (..., K), M = prod(shape[:-1])
    dtype: torch.dtype
    x: torch.Tensor | None = None  # (..., K) in dtype, or None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def rows(self) -> int:
        """M: the activation's rows (the buffer may hold more, zero-padded)."""
        n = 1
        for s in self.shape[:-1]:
            n *= s
        return n


def codes_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale, ±448)) in fp32 arithmetic, `scale` broadcast against x: the codes of
    values at a scale, the torch side of `_codes` (every quantising reference uses it)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (e4m3 (M, K), fp32 scale (M, 1)) with x ≈ q * scale, per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return codes_ref(xf, scale), scale


def quantize_rows_ref_padded(x: torch.Tensor, keep: bool = False) -> QuantizedRows:
    """`quantize_rows_ref` of an (..., K) activation into the padded `gemm_rows` layout, in torch."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    q, s = empty_rows(x2.shape[0], K, x.device)
    if x2.shape[0]:
        q[: x2.shape[0]], s[: x2.shape[0]] = quantize_rows_ref(x2)
    return QuantizedRows(q, s, x.shape, x.dtype, x if keep else None)


if triton_available():
    import triton
    import triton.language as tl

    _SOFT_E4M3 = tl.constexpr(1 if interpreting() else 0)

    @triton.jit
    def _e4m3(v):
        """fp32 (|v| <= 448) -> e4m3fn, round to nearest even like torch's `.to(float8_e4m3fn)`.

        On GPUs the hardware cast (`cvt.rn.satfinite`). Under the interpreter the value is first
        rounded to the e4m3 grid in fp32 (3 mantissa bits for normals; steps of 2^-9 below 2^-6, the
        subnormals, by the 1.5 * 2^23 trick on |v|, the sign put back bitwise so -0 stays -0), then
        cast: exact, where the interpreter's own rounding is wrong.
        """
        if _SOFT_E4M3 == 1:
            u = v.to(tl.uint32, bitcast=True)
            normal = (((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
            a = tl.abs(v)
            sub = ((a * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
            sub = (sub.to(tl.uint32, bitcast=True) | (u & 0x80000000)).to(tl.float32, bitcast=True)
            r = tl.where(a < 0.015625, sub, normal).to(tl.float8e4nv)
        else:
            r = v.to(tl.float8e4nv)
        return r

    @triton.jit
    def _row_scale(amax):
        """A row's scale from its amax, as `quantize_rows_ref`: max(amax / 448, 1e-12)."""
        return tl.maximum(amax / 448.0, 1e-12)

    @triton.jit
    def _codes(v, scale):
        """fp32 values of a row -> their e4m3 codes at the row's `scale`, as `quantize_rows_ref`."""
        return _e4m3(tl.clamp(v / scale, -448.0, 448.0))

    @triton.jit
    def _quant_row(y, cols, mask, q_ptr, s_ptr, row, K):
        """Quantise one fp32 row `y` (values already in the activation dtype; masked lanes ignored)
        into q_ptr[row, cols] (row stride K) and s_ptr[row], exactly as `quantize_rows`."""
        scale = _row_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
        tl.store(q_ptr + row * K + cols, _codes(y, scale), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
        """`fp8_linear.quantize_rows`: one program per row, in chunks of BLOCK (any K)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):  # pass 1: amax (the row stays in L2 for pass 2)
            m = k + offs < K
            v = tl.load(x_ptr + row * stride_x + k + offs, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = _row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            m = k + offs < K
            v = tl.load(x_ptr + row * stride_x + k + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + k + offs, _codes(v, scale), mask=m)
