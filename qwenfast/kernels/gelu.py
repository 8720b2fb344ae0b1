"""The MLP's `GELU_tanh(x @ W^T + b)`: bias and GELU ride in the GEMM epilogue, no Triton kernel.

Why no Triton kernel here: a separate bias+GELU kernel would still cost one write of the (B, L, 4D)
GEMM output, one read and one write again (the biggest activation of the block: 4x the model
width). `torch._addmm_activation(bias, x, W^T, use_gelu=True)` on CUDA folds bias and GELU into
cuBLASLt's `CUBLASLT_EPILOGUE_GELU_BIAS`, so the hidden activation is written once, in its final
form: zero extra passes, which no standalone kernel can beat.

Which GELU (checked in PyTorch's aten/src/ATen/native/cuda/Blas.cpp, `addmm_out_cuda_impl`):
- the cuBLASLt path (bias 1-D, result 2-D contiguous, beta 1: our call) uses the epilogue, whose
  GELU is the tanh approximation; when the Lt path cannot be used (or `DISABLE_ADDMM_CUDA_LT=1`),
  torch runs the GEMM and then `at::gelu_(result, "tanh")` — also tanh. The model's
  `F.gelu(..., approximate="tanh")` is therefore the same function.
- on CPU, `addmm_activation_out_cpu` calls `at::gelu_(result)`: the EXACT erf GELU. So the fused
  call is only used on CUDA; CPU tensors (and the Triton interpreter) take the reference.

Checked on H200 (torch 2.11, fp32, TF32 off): `_addmm_activation(..., use_gelu=True)` differs from
`F.gelu(F.linear(...), approximate="tanh")` by 5e-6 and from the erf GELU by 5e-4: it is tanh.

Numerics: the epilogue applies GELU to the fp32 accumulator + bias and rounds once; the model rounds
the Linear output to bf16 first, then rounds the GELU again. In bf16 ~66% of the elements match the
reference bit for bit and the rest differ by one ulp (tested with the bf16 tolerance).
Measured on H200 (bf16, 4096 x 3072 -> 12288): 445 us vs 491 us for linear + gelu (1.1x).

FP8 MLPs (`gelu_tanh_fp8`): `torch._scaled_mm` has no GELU epilogue, so the first FP8 GEMM writes
its bf16 output h and a pass applies the GELU; that pass also quantises the result per row for the
second `FP8Linear` (`QuantizedRows`) instead of writing it in bf16 for a separate quantisation pass
to read again. The row's scale needs its amax before any code is written: GELU rises monotonically
above x = -0.75 and |GELU| < 0.17 below, so the amax is GELU(max h) whenever that is >= 0.171, and a
first pass over the row needs only max(h) (loads, no tanh); rows whose maximum is smaller take a
second pass over the GELU itself. The last pass evaluates the GELU once per element and writes the
e4m3 codes. Rows go in chunks (any width). In fp32 the GELU is torch's CUDA formula op for op (`0.5 * x *
(1 + tanh(kBeta * (x + kKappa * x^3)))`, tanh from libdevice like CUDA's `tanhf`); for bf16 / fp16 rows
(the model's) it is the same function as `x / (1 + exp2(-2 log2(e) * u))` (`CONFIG["sigmoid"]`): one
exp2 and one division instead of tanhf's two branches, which both run where a warp's lanes straddle
|u| = 0.6 (compiled for sm_90a, the loop that writes the codes takes ~21 instructions an element
instead of ~38, without a branch). Either way the value is rounded to the activation dtype, so the
e4m3 bytes are those of `quantize_rows(F.gelu(h))` except where a last-bit fp32 difference (the other
formula, FMA contraction, or the interpreter's exp-based tanh) flips the rounding of a GELU value:
that element then moves by at most one e4m3 step (or, if it was the row's amax, the scale moves by
one bf16 ulp). `gelu_tanh_fp8_ref` is the unfused pair in torch.
Measured on H200 (1024², bench/results/gelu_fp8.jsonl): the FP8 forward 85.52 -> 84.67 ms with the tanhf
form (an earlier kernel holding a whole row per program was slower than the two passes: 9.8 ms per
forward); 0 codes differ. The exp2 form, same H200 run (bench/results/profile_forward.jsonl lines 11-12,
`python bench/profile_forward.py --gelu tanhf|sigmoid`): this kernel's time per forward 6.04 -> 4.28 ms,
the forward 82.92 -> 81.02 ms; the demo's FP8 gate with it: -0.83 text-to-image, +0.84 edits
(bench/results/quality.jsonl, `qwenfast bench quality --paths --path fp8 [--model edit]`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import FLOAT_DTYPES, _on_device, _tl_dtype, backend, interpreting, triton_available, use_triton
from .fp8_linear import quantize_activation
from .fp8_rows import QuantizedRows, empty_rows, quantize_rows_ref_padded

__all__ = ["linear_gelu_tanh", "linear_gelu_tanh_ref", "gelu_tanh_fp8", "gelu_tanh_fp8_ref"]

MAX_N = 65536  # longer rows take the unfused pair (the kernel itself walks any row in chunks)
CONFIG = {
    "chunk": 2048,
    "warps": 8,
    "sigmoid": True,
}  # the kernel's chunk of a row, its warps and GELU form (module state: benchmark sweeps, tests)

if triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .adaln import _cast, _round
    from .fp8_rows import _codes, _row_scale

    _EXP_TANH = tl.constexpr(1 if interpreting() else 0)  # the interpreter has no libdevice

    @triton.jit
    def _tanh(v):
        if _EXP_TANH == 1:
            r = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(v, 20.0)) + 1.0)
        else:
            r = libdevice.tanh(v)
        return r

    @triton.jit
    def _gelu(x, DT: tl.constexpr, SIGMOID: tl.constexpr):
        """aten's GeluCUDAKernel (tanh) in fp32, rounded to DT as torch stores it. SIGMOID (bf16 / fp16
        only): the same function as x / (1 + 2^(-2 log2(e) u)), since (1 + tanh u) / 2 = sigmoid(2u): one
        exp2 and one division, no branch, against libdevice's tanhf, whose two branches (|u| < 0.6 or
        not) both run when a warp's lanes fall on both sides; it differs from tanhf in the last fp32
        bits, which the rounding to DT hides but for a rare one-ulp flip."""
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))  # kBeta, kKappa
        if SIGMOID and DT != tl.float32:
            g = x / (1.0 + tl.exp2(-2.8853900817779268 * inner))
        else:
            g = 0.5 * x * (1.0 + _tanh(inner))
        return _round(g, DT)

    @triton.jit
    def _gelu_fp8_kernel(
        h_ptr,
        g_ptr,
        q_ptr,
        qs_ptr,
        N,
        s_h,
        s_g,
        CH: tl.constexpr,
        DT: tl.constexpr,
        STORE: tl.constexpr,
        SIGMOID: tl.constexpr,
    ):
        """One row in chunks of CH. Pass 1 reads h only: its max. GELU rises monotonically above
        x = -0.75 and |GELU| < 0.17 below, so when GELU(max h) >= 0.171 it is the row's amax (the
        rounding to DT is monotonic too); otherwise (rare: rows with no value above ~0.3) pass 1b
        takes the amax of GELU itself. Pass 2: GELU (tanh once per element), e4m3 (row stride N),
        and with STORE g in DT."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CH)
        hi = tl.full([CH], float("-inf"), dtype=tl.float32)
        for c in range(0, N, CH):
            m = c + offs < N
            hi = tl.maximum(
                hi, tl.load(h_ptr + row * s_h + c + offs, mask=m, other=float("-inf")).to(tl.float32)
            )
        amax = _gelu(tl.max(hi, axis=0), DT, SIGMOID)
        if amax < 0.171:
            acc = tl.zeros([CH], dtype=tl.float32)
            for c in range(0, N, CH):
                m = c + offs < N
                g = _gelu(
                    tl.load(h_ptr + row * s_h + c + offs, mask=m, other=0.0).to(tl.float32), DT, SIGMOID
                )
                acc = tl.maximum(acc, tl.where(m, tl.abs(g), 0.0))
            amax = tl.max(acc, axis=0)
        scale = _row_scale(amax)
        tl.store(qs_ptr + row, scale)
        for c in range(0, N, CH):
            m = c + offs < N
            g = _gelu(tl.load(h_ptr + row * s_h + c + offs, mask=m, other=0.0).to(tl.float32), DT, SIGMOID)
            if STORE:
                tl.store(g_ptr + row * s_g + c + offs, _cast(g, DT), mask=m)
            tl.store(q_ptr + row * N + c + offs, _codes(g, scale), mask=m)


def linear_gelu_tanh_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`transformer.GeluProj`: `F.gelu(F.linear(x, weight, bias), approximate="tanh")`."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T + bias (N,), then GELU(tanh); one cuBLASLt call on CUDA.

    Falls back to the reference on CPU (where torch's fused op is the erf GELU), with backend
    "torch", without a bias, or for mixed dtypes.
    """
    ok = (
        backend() == "triton"
        and x.is_cuda
        and bias is not None
        and x.dtype in FLOAT_DTYPES
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))
        and weight.dtype == x.dtype
        and bias.dtype == x.dtype
        and weight.dim() == 2
        and bias.dim() == 1
        and x.shape[-1] == weight.shape[1]
        and bias.shape[0] == weight.shape[0]
        and x.numel() > 0
    )
    if not ok:
        return linear_gelu_tanh_ref(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


def gelu_tanh_fp8_ref(h: torch.Tensor, keep: bool = False) -> QuantizedRows:
    """Plain torch: `F.gelu(h, approximate="tanh")`, then `quantize_rows_ref` of its rows."""
    return quantize_rows_ref_padded(F.gelu(h, approximate="tanh"), keep)


def gelu_tanh_fp8(
    h: torch.Tensor, keep: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> QuantizedRows:
    """GELU(tanh) of h (..., N) as `QuantizedRows` for the MLP's second `FP8Linear`, one kernel; with
    `keep`, the GELU output in h.dtype too (for a LoRA side GEMM). Rows longer than MAX_N, other
    layouts or devices run the unfused pair (`F.gelu`, then the quantisation pass). `out`: (q, scale)
    buffers (see `fp8_rows.empty_rows`)."""
    N = h.shape[-1]
    h2 = h.reshape(-1, N) if h.dim() >= 2 else h
    ok = (
        h.dim() >= 2
        and h.dtype in FLOAT_DTYPES
        and 0 < N <= MAX_N
        and h2.shape[0] > 0
        and h2.stride(-1) == 1
        and use_triton(h)
    )
    if not ok:
        return quantize_activation(F.gelu(h, approximate="tanh"), keep, out)
    M = h2.shape[0]
    q, qs = empty_rows(M, N, h.device, out=out)
    g = torch.empty(M, N, dtype=h.dtype, device=h.device) if keep else h2  # (h2: an unused pointer)
    ch = min(CONFIG["chunk"], triton.next_power_of_2(N))
    with _on_device(h):
        _gelu_fp8_kernel[(M,)](
            h2,
            g,
            q,
            qs,
            N,
            h2.stride(0),
            g.stride(0),
            CH=ch,
            DT=_tl_dtype(h.dtype),
            STORE=keep,
            SIGMOID=CONFIG["sigmoid"],
            num_warps=CONFIG["warps"],
        )
    return QuantizedRows(q, qs, h.shape, h.dtype, g.view(h.shape) if keep else None)
