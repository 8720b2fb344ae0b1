"""FP8 (e4m3) GEMMs for the transformer blocks' Linears: rowwise-scaled `torch._scaled_mm`.

Why: at 1024² the bf16 GEMMs alone take ~85 ms of a forward, more than our target for a whole forward; the
FP8 tensor cores run the same shapes at 1.8-1.9x (measured on H200: 1408-1488 TFLOP/s vs 809).

Scheme (the one that keeps quality on DiTs, and the one Hopper runs fastest):
- weights: quantised once, per output channel (row of W): w ≈ w8 * sw, sw = amax(|row|) / 448;
- activations: quantised per token (row of x) on every call, x ≈ x8 * sx: by the kernel that produced
  x when it can (LayerNorm + modulation, the gated residual's LayerNorm, the MLP's GELU hand over
  `QuantizedRows`, see `fp8_rows.py`: no bf16 write + re-read), else by one Triton pass here
  (`quantize_rows`) that reads the row, takes its amax and writes e4m3 plus the fp32 scale;
- `torch._scaled_mm(x8, w8ᵀ, sx, swᵀ, bias, out_dtype=bf16, use_fast_accum=True)`.
The error is that of rounding both operands to 3 mantissa bits (rel. ~3-4% per GEMM output): not
diffusers' image bit for bit, so it is OFF by default and measured in the benchmark (speed and
relative error) and by the demo model's quality score.

CPU and unsupported GPUs (no sm_89+) run `fp8_linear_ref`: the same quantisation, dequantised and
multiplied in fp32, so tests can check the GPU path against it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn

from ..runtime.arch import arch
from . import _on_device, interpreting, triton_available, use_triton
from .fp8_lora_gemm import fp8_lora_gemm
from .fp8_rows import (
    FP8,
    FP8_MAX,
    MIN_ROWS,
    MIN_SCALE,
    QuantizedRows,
    empty_rows,
    fp8_fusion,
    gemm_rows,
    quantize_rows_ref,
)
from .lowbit import LowBitLinear, replace_layers
from .row_lora import RowLora

if triton_available():
    from .fp8_rows import _quant_rows_kernel

__all__ = [
    "FP8",
    "FP8_MAX",
    "MIN_ROWS",
    "MIN_SCALE",
    "QuantizedRows",
    "fp8_consumer",
    "quantize_activation",
    "FP8Linear",
    "quantize_rows",
    "quantize_rows_ref",
    "fp8_linear_ref",
    "quantize_model",
    "fp8_supported",
]

_REFUSED: set[tuple] = set()  # (rows, K, N, device) that cuBLASLt refused: the dequantised fallback runs


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs on `device` (the arch table: sm_89 and newer)."""
    return device.type == "cuda" and arch(device).fp8_gemm


def quantize_rows(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation of a 2-D tensor; one Triton program per row on CUDA.

    `rows` > M pads the outputs with zero rows (scale 1) written at allocation, for GEMMs that need
    M to be a multiple of 16.
    """
    M, K = x.shape if x.dim() == 2 else (0, 0)
    rows = M if rows is None else rows
    if rows < M:
        raise ValueError(f"rows ({rows}) must be >= the {M} rows of x")
    if x.dim() != 2 or x.stride(-1) != 1 or not use_triton(x) or x.shape[0] == 0:
        q, s = quantize_rows_ref(x)
        if rows > M:
            q = torch.cat([q, torch.zeros(rows - M, K, dtype=FP8, device=x.device)])
            s = torch.cat([s, torch.ones(rows - M, 1, dtype=s.dtype, device=x.device)])
        return q, s
    q, s = empty_rows(M, K, x.device, rows)
    block = min(4096, max(128, 1 << (K - 1).bit_length()))
    with _on_device(x):
        _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block, num_warps=4)
    return q, s


def quantize_activation(
    x: torch.Tensor, keep: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> QuantizedRows:
    """An (..., K) activation -> `QuantizedRows` by the separate pass (`quantize_rows`, padded to
    `gemm_rows`): what a fused producer's fallback returns; `keep` keeps `x` for a LoRA; `out`:
    (q, scale) buffers to copy the result into."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows(x2 if x2.stride(-1) == 1 else x2.contiguous(), rows=gemm_rows(x2.shape[0]))
    if out is not None:
        q, s = empty_rows(x2.shape[0], x2.shape[1], x.device, out=out)[0].copy_(q), out[1].copy_(s)
    return QuantizedRows(q, s, x.shape, x.dtype, x if keep else None)


def fp8_linear_ref(
    x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """What the FP8 GEMM computes, in fp32 on any device: dequantised operands, exact products."""
    x8, sx = quantize_rows_ref(x.reshape(-1, x.shape[-1]))
    y = (x8.float() * sx) @ (w8.float() * sw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).view(*x.shape[:-1], w8.shape[0])


class FP8Linear(LowBitLinear):
    """Drop-in for an `nn.Linear` with e4m3 weights and per-channel scales (bias kept in bf16)."""

    ROW_LORA_READS_CODES = True  # per-row LoRAs read the producer's e4m3 rows (kernels/lora_rows.py)

    def __init__(
        self,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ):
        super().__init__()
        self.register_buffer("weight_fp8", weight_fp8)  # (N, K) e4m3
        self.register_buffer("weight_scale", weight_scale)  # (N, 1) fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype
        self.in_features, self.out_features = weight_fp8.shape[1], weight_fp8.shape[0]
        # Unmerged LoRA: (down (R, K), up (N, R)) in out_dtype, y += (x @ downᵀ) @ upᵀ, or None. Owned by
        # loading.lora_manager.LoraManager (strengths and scales are folded into `up`; R is padded to a bucket
        # and the tensors are rewritten in place on a switch, so captured CUDA graphs stay valid).
        # Plain attributes, not buffers: not part of the checkpoint's state dict.
        self.lora: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> FP8Linear:
        w8, sw = quantize_rows_ref(lin.weight.detach())
        bias = None if lin.bias is None else lin.bias.detach()
        return cls(w8, sw, bias, lin.weight.dtype)

    @classmethod
    def empty_like(cls, lin: nn.Linear, dtype: torch.dtype | None = None) -> FP8Linear:
        """An FP8 layer of `lin`'s shape with uninitialised storage on `lin`'s device (meta while a model
        is being built, so that a loader can stream FP8 weights straight into it); `dtype`: its
        activations' dtype (default `lin`'s)."""
        N, K = lin.weight.shape
        dev = lin.weight.device
        bias = None if lin.bias is None else torch.empty_like(lin.bias)
        return cls(
            torch.empty(N, K, dtype=FP8, device=dev),
            torch.empty(N, 1, dtype=torch.float32, device=dev),
            bias,
            dtype or lin.weight.dtype,
        )

    @property
    def weight_device(self) -> torch.device:
        return self.weight_fp8.device

    def _fast(self, x: torch.Tensor | QuantizedRows) -> bool:
        """Whether `_scaled_mm` runs for this input (else the fp32 dequantised reference)."""
        return (
            x.device.type == "cuda"
            and fp8_supported(x.device)
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
        )

    def takes_rows(self, x: torch.Tensor) -> bool:
        """Whether the kernel producing this layer's input `x`-like activation should hand it over as
        `QuantizedRows` (the fusion is on and the FP8 GEMM runs: on an FP8 GPU, or any device under
        the Triton interpreter, where the dequantised reference multiplies the same rows)."""
        return fp8_fusion() and use_triton(x) and (self._fast(x) or interpreting())

    def _weight_only(self, x: torch.Tensor | QuantizedRows) -> bool:
        """A CUDA GPU without FP8 GEMMs (runtime/arch.py: Ampere): FP8 files still load as stored (half
        the memory of bf16), and each call dequantises the weight to the activations' dtype and runs a
        plain GEMM there, activations unquantised (weight-only)."""
        return not isinstance(x, QuantizedRows) and x.is_cuda and not arch(x.device).fp8_gemm

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x (..., K) -> (..., N). `x` may arrive already quantised (`QuantizedRows` from a fused
        producer): then no quantisation pass runs here; an unmerged LoRA reads `x.x`."""
        K, N = self.in_features, self.out_features
        if self._weight_only(x):
            # (N, K) in the activations' dtype: widened (exact) then scaled in place, no fp32 copy of the layer
            w = self.weight_fp8.to(self.out_dtype).mul_(self.weight_scale.to(self.out_dtype))
            y = torch.nn.functional.linear(
                x.to(self.out_dtype), w, None if self.bias is None else self.bias.to(self.out_dtype)
            )
            return y if self.lora is None else self.add_lora(x.reshape(-1, K), y.reshape(-1, N)).view(y.shape)
        if isinstance(x, QuantizedRows):
            rows, shape, M = x, x.shape, x.rows
            x2 = None if x.x is None else x.x.reshape(-1, K)
            if self.lora_reads_input() and x2 is None:
                raise RuntimeError(
                    "FP8Linear with a LoRA got QuantizedRows without the activation (x=None): "
                    "the producer must keep it (keep=True) while a LoRA is active"
                )
            if not self._fast(x):
                y = (rows.q[:M].float() * rows.scale[:M]) @ (self.weight_fp8.float() * self.weight_scale).t()
                if self.bias is not None:
                    y = y + self.bias.float()
                y = y.to(self.out_dtype)  # == fp8_linear_ref of the activation these rows quantise
                if self.lora is not None:
                    y = self.add_lora(x2, y, (rows.q[:M], rows.scale[:M]))
                return y.view(*shape[:-1], N)
            x8, sx = rows.q, rows.scale
        else:
            if not self._fast(x):
                y = fp8_linear_ref(x, self.weight_fp8, self.weight_scale, self.bias, self.out_dtype)
                if self.lora is not None:
                    y = self.add_lora(x.reshape(-1, K), y.reshape(-1, N)).view(y.shape)
                return y
            shape, x2 = x.shape, x.reshape(-1, K)
            if x2.stride(-1) != 1 or x2.stride(0) != K:
                x2 = x2.contiguous()
            M = x2.shape[0]
            # cuBLASLt (rowwise scales) refuses short text streams with CUBLAS_STATUS_NOT_SUPPORTED: seen on
            # an H200 for 2 <= M <= 32 at full width, while 1 and >= 40 ran. Quantise into a buffer of at
            # least MIN_ROWS rows (a multiple of 16; the extra rows are zeros), multiply, keep the first M.
            x8, sx = quantize_rows(x2, rows=gemm_rows(M))
        return self._gemm(x8, sx, M, x2, x.device).view(*shape[:-1], N)

    def _gemm(
        self, x8: torch.Tensor, sx: torch.Tensor, M: int, x2: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """(M, N) = rows [0, M) of x8 (Mp, K) · sx times the FP8 weight, + bias (+ LoRA on x2)."""
        bias = None if self.bias is None else self.bias.to(self.out_dtype)
        lora = self.lora.fused(x8[:M], sx[:M]) if isinstance(self.lora, RowLora) else None
        if lora is not None:  # per-row LoRAs in the GEMM's epilogue (kernels/fp8_lora_gemm.py)
            return fp8_lora_gemm(x8, sx, self.weight_fp8, self.weight_scale, bias, M, lora, self.out_dtype)
        key = (x8.shape[0], self.in_features, self.out_features, device.index)
        if key not in _REFUSED:
            try:
                y = torch._scaled_mm(
                    x8,
                    self.weight_fp8.t(),
                    scale_a=sx,
                    scale_b=self.weight_scale.t(),
                    bias=bias,
                    out_dtype=self.out_dtype,
                    use_fast_accum=True,
                )[:M]
                return y if self.lora is None else self.add_lora(x2, y, (x8[:M], sx[:M]))
            except RuntimeError as e:  # the heuristic query fails on the host, before any launch
                if "NOT_SUPPORTED" not in str(e):
                    raise
                _REFUSED.add(key)
                warnings.warn(
                    f"FP8 GEMM {key[:3]} refused by cuBLASLt ({str(e).splitlines()[0][:60]}); "
                    "this shape runs as a dequantised bf16 GEMM",
                    stacklevel=3,
                )
        # the same operands, dequantised: exact FP8 products, bf16 GEMM (small M only in practice)
        y = (x8[:M].to(self.out_dtype) * sx[:M].to(self.out_dtype)) @ (
            self.weight_fp8.to(self.out_dtype) * self.weight_scale.to(self.out_dtype)
        ).t()
        if bias is not None:
            y = y + bias
        return y if self.lora is None else self.add_lora(x2, y, (x8[:M], sx[:M]))

    def extra_repr(self) -> str:
        lo = self.lora
        r = (
            ""
            if lo is None
            else f", lora_rank={(lo.down.shape[1] if hasattr(lo, 'down') else lo[0].shape[0])}"
        )
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 rowwise{r}"


def fp8_consumer(layer: nn.Module, x: torch.Tensor) -> FP8Linear | None:
    """`layer` when it is an `FP8Linear` that takes an activation like `x` pre-quantised
    (`FP8Linear.takes_rows`), else None: tells a fused producer to write `QuantizedRows`."""
    return layer if isinstance(layer, FP8Linear) and layer.takes_rows(x) else None


def quantize_model(
    model: nn.Module,
    names: Sequence[str] | None = None,
    empty: bool = False,
    dtype: torch.dtype | None = None,
) -> int:
    """Replace the Linears the model names (`names`, else `model.fp8_linears()`: module names, see
    `runtime.contract.BlockModel`) with `FP8Linear` in place; returns how many were replaced.

    The model decides which layers are worth 3 mantissa bits (its big block GEMMs) and which are not
    (the modulation, embedders, output projection); this walker knows no model's layout. Layers that
    are not `nn.Linear` (already FP8) are left as they are. The bf16 weights of replaced layers are
    freed. `empty`: uninitialised FP8 layers computing in `dtype` (a model on meta that a loader fills).
    """

    def make(lin: nn.Module) -> nn.Module | None:
        if not isinstance(lin, nn.Linear):
            return None
        return FP8Linear.empty_like(lin, dtype) if empty else FP8Linear.from_linear(lin)

    return replace_layers(model, names, make)
