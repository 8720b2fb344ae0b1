"""Q, K, V -> e4m3 with scales computed on the GPU, for the 8-bit attention backend ("fp8").

Why: FP8 attention kernels (cuDNN's FP8 SDPA, FlashAttention-3's FP8 forward) run both attention
GEMMs on Hopper's FP8 tensor cores, at up to twice the bf16 rate, but take e4m3 inputs plus the
fp32 factors that undo their scaling ("descales"). This op makes those inputs from the bf16 Q, K, V
the model wrote, without a host sync (so it can sit inside a CUDA graph):

1. amax: one Triton program per (block of tokens, batch x head) takes max |x| of its tile and
   `atomic_max`es it into an fp32 (B, H) buffer;
2. quantise: descale = max(amax / 448, 1e-12) (per (batch, head), or the max over all heads and
   the batch with `per_head=False`, the only form cuDNN's FP8 SDPA takes: one scalar per tensor),
   q8 = clamp(x / descale, +-448) in e4m3; the program of the first token block also writes the
   descale.

An all-zero tensor gets descale 1e-12 (q8 = 0, never 0/0); a row of 1e4s only moves the descale.
Since e4m3 is a floating-point format (3 mantissa bits, 2^-9..448), one scale per tensor keeps
~4 % relative precision for every element within ~2^15 of the tensor's largest; smaller ones lose
bits or flush to zero (a tensor with one huge outlier row quantises the rest coarsely).

Layout: inputs are (B, H, S, D) views with a contiguous last dim (the model's (B, S, H, D) buffers
transposed, or contiguous (B, H, S, D)); outputs are (B, H, S, D) views of (B, S, H, D)-contiguous
e4m3 storage: the BSHD layout both FP8 kernels read. Descales: fp32 (3, B, H) for Q, K, V.

Cost (bandwidth bound): reads Q, K, V twice (bf16) and writes them once (e4m3): ~195 MB at 4224
tokens x 24 heads x 128, ~55 us on an H200, which the bench reports beside the kernel time.
`quantize_heads` is the same for one tensor: a block's joint attention needs it for V alone (its Q
and K come out of the QK-norm kernel in e4m3 already, see `qk_norm_rope`): 26 us per layer at 1024².
"""

from __future__ import annotations

import torch

from . import _on_device, triton_available, use_triton
from .fp8_rows import FP8, FP8_MAX, codes_ref

__all__ = [
    "quantize_qkv",
    "quantize_qkv_ref",
    "quantize_heads",
    "quantize_heads_ref",
    "dequantize",
    "descale_rows",
    "FP8",
    "FP8_MAX",
    "MIN_DESCALE",
]

MIN_DESCALE = 1e-12  # an all-zero tensor: a tiny descale, never a division by zero


def _amax_ref(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """(B, H, S, D) -> fp32 (B, H): max |x| per (batch, head), or the tensor's max broadcast."""
    a = x.detach().float().abs().amax(dim=(2, 3))  # (B, H)
    return a if per_head else a.amax().expand_as(a).clone()


def _bshd_empty(x: torch.Tensor) -> torch.Tensor:
    """An e4m3 (B, H, S, D) view of fresh (B, S, H, D)-contiguous storage."""
    B, H, S, D = x.shape
    return torch.empty(B, S, H, D, dtype=FP8, device=x.device).transpose(1, 2)


def quantize_heads_ref(x: torch.Tensor, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One (B, H, S, D) tensor in plain torch: e4m3 (B, H, S, D) BSHD-strided, descale fp32 (B, H)."""
    d = (_amax_ref(x, per_head) / FP8_MAX).clamp_min(MIN_DESCALE)  # (B, H)
    y = _bshd_empty(x)
    y.copy_(codes_ref(x, d[:, :, None, None]))
    return y, d


def quantize_qkv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantisation in plain torch: (q8, k8, v8) e4m3 (B, H, S, D) BSHD-strided, descales fp32 (3, B, H)."""
    (q8, dq), (k8, dk), (v8, dv) = (quantize_heads_ref(x, per_head) for x in (q, k, v))
    return q8, k8, v8, torch.stack([dq, dk, dv])


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """e4m3 (B, H, S, D) and its (B, H) descale -> fp32 values."""
    return x8.float() * descale[:, :, None, None]


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _round_e4m3(y):
        """fp32 |y| <= 448 -> the nearest e4m3 value (ties to even), still fp32, so the cast after it is
        exact: the same bits as torch's `.to(float8_e4m3fn)` on the GPU and in Triton's interpreter
        (whose own fp8 cast halves values that round up to the next power of two)."""
        bits = y.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1  # keep 3 of fp32's 23 mantissa bits
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        a = tl.abs(y)
        sub = (a + 24576.0) - 24576.0  # 1.5 * 2^14: fp32's ulp there is e4m3's subnormal step 2^-9
        return tl.where(a < 0.015625, tl.where(bits < 0, -sub, sub), normal)  # sign kept (also of -0)

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, S, D, H, sb, sh, ss, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < S)[:, None] & (cols < D)[None, :]
        base = x_ptr + b.to(tl.int64) * sb + h.to(tl.int64) * sh
        x = tl.load(base + rows.to(tl.int64)[:, None] * ss + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr + bh, a)  # amax >= 0, so the float max is exact

    @triton.jit
    def _quant_kernel(
        x_ptr,
        y_ptr,
        amax_ptr,
        desc_ptr,
        S,
        D,
        H,
        BH,
        sb,
        sh,
        ss,
        yb,
        yh,
        ys,
        PER_HEAD: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_BH: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        if PER_HEAD:
            amax = tl.load(amax_ptr + bh)
        else:  # one scale for the tensor: the max over every (batch, head)
            offs = tl.arange(0, BLOCK_BH)
            amax = tl.max(tl.load(amax_ptr + offs, mask=offs < BH, other=0.0), axis=0)
        descale = tl.maximum(amax / 448.0, 1e-12)
        if pid_s == 0:
            tl.store(desc_ptr + bh, descale)
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < S)[:, None] & (cols < D)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(
            x_ptr + b.to(tl.int64) * sb + h.to(tl.int64) * sh + r64 * ss + cols[None, :], mask=m, other=0.0
        ).to(tl.float32)
        y = _round_e4m3(tl.clamp(tl.div_rn(x, descale), -448.0, 448.0))  # IEEE division, as torch's
        tl.store(
            y_ptr + b.to(tl.int64) * yb + h.to(tl.int64) * yh + r64 * ys + cols[None, :],
            y.to(tl.float8e4nv),
            mask=m,
        )


def _supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        q.dim() == 4
        and q.shape == k.shape == v.shape
        and q.numel() > 0
        and all(
            t.stride(-1) == 1 and t.dtype in (torch.bfloat16, torch.float16, torch.float32) for t in (q, k, v)
        )
        and q.shape[-1] <= 256
        and q.shape[0] * q.shape[1] <= 65535
    )


def descale_rows(n: int, B: int, H: int, device) -> torch.Tensor:
    """fp32 (n, B*H) descale rows, each padded to 16 bytes: a tensor's descale may be handed on as a
    (1, 1, 1, 1) scalar pointer (cuDNN's FP8 SDPA wants it aligned)."""
    return torch.empty(n, -(-B * H // 4) * 4, dtype=torch.float32, device=device)[:, : B * H]


def quantize_heads(
    x: torch.Tensor, per_head: bool = False, desc: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) x -> (x8, descale (B, H)) with x ≈ x8 * descale; `desc`: a (B*H,) fp32 row to
    write the descales into (else a fresh aligned one). Two Triton passes on CUDA (amax, then
    quantise), no host sync; the reference elsewhere. `per_head=False`: one descale per tensor."""
    B, H, S, D = x.shape
    if not (_supported(x, x, x) and use_triton(x)):
        x8, d = quantize_heads_ref(x, per_head)
        if desc is None:
            return x8, d
        desc.copy_(d.reshape(-1))
        return x8, desc.view(B, H)
    desc = descale_rows(1, B, H, x.device)[0] if desc is None else desc
    amax = torch.zeros(B * H, dtype=torch.float32, device=x.device)
    y = _bshd_empty(x)
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(64, 8192 // block_d))
    grid = (triton.cdiv(S, block_s), B * H)
    with _on_device(x):
        _amax_kernel[grid](
            x,
            amax,
            S,
            D,
            H,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            num_warps=4,
        )
        _quant_kernel[grid](
            x,
            y,
            amax,
            desc,
            S,
            D,
            H,
            B * H,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            y.stride(0),
            y.stride(1),
            y.stride(2),
            PER_HEAD=per_head,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            BLOCK_BH=triton.next_power_of_2(B * H),
            num_warps=4,
        )
    return y, desc.view(B, H)


def quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, S, D) q, k, v -> (q8, k8, v8, descales (3, B, H)) with x ≈ x8 * descale: `quantize_heads`
    of each (`per_head=False`: one descale per tensor, repeated over (B, H), what cuDNN's FP8 SDPA takes)."""
    if not (_supported(q, k, v) and use_triton(q, k, v)):
        return quantize_qkv_ref(q, k, v, per_head)
    B, H = q.shape[:2]
    desc = descale_rows(3, B, H, q.device)
    outs = [quantize_heads(x, per_head, desc[i])[0] for i, x in enumerate((q, k, v))]
    return outs[0], outs[1], outs[2], desc.view(3, B, H)
