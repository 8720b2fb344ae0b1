"""8-bit attention that keeps the demo's quality gate: INT8 Q·Kᵀ after K smoothing (Q scaled per token, K
per block of keys), then FP8 (e4m3) P·V — SageAttention 2's recipe, as one Triton kernel (`attention_int8`).

Why not e4m3 for Q and K (what cuDNN's and FA3's FP8 kernels take): e4m3 keeps 3 mantissa bits, so every
product in Q·Kᵀ carries ~6% error whatever the scale, and sharp attention rows move; INT8 keeps 7 bits
relative to its scale's largest value. With each engine's quantisation emulated on the CPU (everything
else fp32), the e4m3 engines lose more than the gate's 2 points on the demo's edits and this scheme does
not: docs/speed.md's 8-bit attention quality table (`QWENFAST_FP8_ATTENTION=int8|auto qwenfast bench
attention quality --device cpu [--model edit]`).

The math (q, k, v: (B, H, S, D); all scales fp32):
- K smoothing: K' = K - mean over tokens of K (per head). Every logit of a query moves by the same q·mean,
  which softmax cancels: exact. It removes the keys' common component, so K' quantises finer.
- Q -> int8 per token, K' -> int8 per block of `QUANT_BLOCK` tokens (per head): scale = amax / 127, round to
  nearest even. (One scale per 64 queries too cost the text-to-image suite one more item of 120.)
  Q·K'ᵀ is exact in int32 (|sum| <= 127² · D); times the query's and the key block's scales and 1/sqrt(D).
- Online softmax in fp32 (exp2). P̃ = exp(S - running max) <= 1 -> e4m3 at scale `P_SCALE` (448, e4m3's
  largest value; folded into the exponent and carried by the row sums too, so the division cancels it);
  V -> e4m3 with one scale per channel (over tokens), applied to the output, which is exact. Each key
  block's P8·V8 comes out of the tensor cores in fp32 and is added to an fp32 accumulator (the two-level
  accumulation that Hopper's reduced-precision FP8 accumulation needs).

The kernel's cost is its per-logit instructions, not its tensor cores: with INT8/FP8 products twice as
fast as bf16 and no warp specialisation (the softmax does not overlap the MMAs), each logit's scalar work
decides the speed. So a key block lies inside one K-scale block (one scale for the block: the logit of
one unit of Q·K'ᵀ is one number per query row), the row max is taken on the raw products and scaled
after (the scales are positive), and each logit costs an integer add, a float add, a max, one FMA and
one exp2; only the last, partial key block carries the padding mask. H200, 2026-11-28, the kernel alone
in one run: 0.54 -> 0.44 ms per layer at 4224 tokens and 6.59 -> 5.39 ms at 16512, against scaling each
logit by its two scales and masking every block. K and Vᵀ come in by TMA (tensor descriptors): no address
arithmetic per element, and 162 registers a thread instead of 222 (ptxas), room for three programs on an
SM where two fitted (H200, same outputs bit for bit: 0.49 -> 0.48 ms at 4224 tokens, 5.70 -> 5.02 ms at 16512).
Folding the int->float offset into the exp2's FMA (one add less per logit, rounding ~1e-5 of a logit
apart) measured within the noise, so the kernel keeps the exact form.

The quantisation is two torch reductions (K's mean, V's channel amax) and one Triton pass per tensor; the
attention kernel reads int8 Q/K and e4m3 Vᵀ. Not fused into the QK-norm + RoPE kernel yet: the engine
takes the bf16 Q, K, V that kernel writes.
No padding mask: the caller (runtime/attention_fp8.py) runs exact attention where there is one; the
reference takes one (a key mask) so the CPU path can run every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _on_device, interpreting, triton_available, use_triton

__all__ = ["attention_int8", "attention_int8_ref", "quantize_int8_attention", "QUANT_BLOCK", "P_SCALE"]

QUANT_BLOCK = 64  # keys per K scale (and the quantisation passes' tile); Q has one scale per token
P_SCALE = 448.0  # P̃ <= 1 times e4m3's largest finite value
PAD = 128  # Q, K, V buffers are padded to a multiple of the largest kernel tile
E4M3 = torch.float8_e4m3fn


@dataclass
class Int8QKV:
    """Quantised attention inputs. q8, k8: (B, H, Sp, D) int8 (padded rows zero); qs: (B, H, Sp) fp32 scales
    (one per token), ks: (B, H, Sp / QUANT_BLOCK) (one per block of keys); v8t: (B, H, D, Sp) e4m3 (V
    transposed: the kernel's P·V operand is then K-major); vs: (B, H, D) fp32 per-channel scales; S: real
    tokens."""

    q8: torch.Tensor
    qs: torch.Tensor
    k8: torch.Tensor
    ks: torch.Tensor
    v8t: torch.Tensor
    vs: torch.Tensor
    S: int


def _int8_blocks(x: torch.Tensor, Sp: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) -> int8 (B, H, Sp, D) and its (B, H, Sp / block) scales (one per `block` tokens)."""
    B, H, S, D = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, Sp - S)).view(B, H, Sp // block, block, D)
    s = xp.abs().amax(dim=(-2, -1)) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block: any scale (its values are 0)
    x8 = torch.round(xp / s[..., None, None]).clamp_(-127, 127).to(torch.int8)
    return x8.view(B, H, Sp, D), s


def quantize_int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    kernels: bool | None = None,
) -> Int8QKV:
    """Q, K, V (B, H, S, D), any float dtype and strides -> `Int8QKV`; `mask` (B, 1, 1, S) bool: the keys
    to keep (the smoothing mean is over those). The per-tensor statistics (K's mean, V's channel amax) are
    torch reductions; the per-block quantisation is one Triton pass per tensor where `kernels` (None: where
    `kernel_runs`), else torch (`_int8_blocks`, the reference: the kernels may differ by one rounding step
    in rare elements, where the GPU's division rounds differently)."""
    B, H, S, D = q.shape
    Sp = -(-S // PAD) * PAD
    if mask is None:
        mean = k.mean(dim=2, keepdim=True, dtype=torch.float32)  # (B, H, 1, D)
    else:
        m = mask.reshape(B, 1, S, 1).to(torch.float32)
        mean = (k.float() * m).sum(dim=2, keepdim=True) / m.sum(dim=2, keepdim=True).clamp_min(1.0)
    # (B, H, D); max |v| as one reduction (v.abs().amax() writes and reads an |v| copy first)
    vs = torch.linalg.vector_norm(v, ord=float("inf"), dim=2).float() / P_SCALE
    vs = torch.where(vs > 0, vs, torch.ones_like(vs))
    if kernels if kernels is not None else kernel_runs(q):
        return _quantize_kernels(q, k, v, mean, vs, Sp)
    q8, qs = _int8_blocks(q, Sp, 1)
    k8, ks = _int8_blocks(k.float() - mean, Sp, QUANT_BLOCK)
    v8 = (v.float() / vs[:, :, None, :]).to(E4M3)
    v8t = torch.nn.functional.pad(v8.view(torch.uint8), (0, 0, 0, Sp - S)).view(E4M3).transpose(2, 3)
    return Int8QKV(q8, qs, k8, ks, v8t.contiguous(), vs, S)


def _rows(s: torch.Tensor, S: int, block: int) -> torch.Tensor:
    """(B, H, Sp / block) scales -> (B, H, S, 1), one per token."""
    return s.repeat_interleave(block, dim=2)[:, :, :S, None]


def attention_int8_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """What the kernel computes, in fp32 torch on q's device: the same quantisation (torch's), exact logits of the quantised Q and
    K', an online softmax over key blocks of `block_n` (None: the kernel's on this device) whose P̃ (against
    the running max, as the kernel rounds it) goes to e4m3 at `P_SCALE`, the quantised V. q, k, v (B, H, S,
    D), mask (B, 1, 1, S) bool (keys to keep) -> (B, H, S, D) in q's dtype."""
    B, H, S, D = q.shape
    bn = block_n or _config(D)[1]
    z = quantize_int8_attention(q, k, v, mask, kernels=False)
    qd = z.q8[:, :, :S].float() * _rows(z.qs, S, 1)
    kd = z.k8[:, :, :S].float() * _rows(z.ks, S, QUANT_BLOCK)
    vd = z.v8t[:, :, :, :S].float().transpose(2, 3)  # (B, H, S, D), unscaled: the scale goes on the output
    s = (qd @ kd.transpose(-1, -2)) / math.sqrt(D)  # (B, H, S, S)
    if mask is not None:
        s = s.masked_fill(~mask.reshape(B, 1, 1, S).bool(), float("-inf"))
    m = torch.full((B, H, S, 1), float("-inf"), device=q.device)
    denom = torch.zeros(B, H, S, 1, device=q.device)
    acc = torch.zeros(B, H, S, D, device=q.device)
    for j in range(0, S, bn):
        blk = s[..., j : j + bn]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row masked so far: 0
        alpha = torch.exp(m - base)
        p = torch.exp(blk - base + math.log(P_SCALE))  # P̃ times P_SCALE: <= P_SCALE
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)  # carries P_SCALE too: the division cancels it
        acc = acc * alpha + p.to(E4M3).float() @ vd[:, :, j : j + bn]
        m = m_new
    out = acc * z.vs[:, :, None, :] / denom
    return out.to(q.dtype)


if triton_available():
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .attn_quant import _round_e4m3

    @triton.jit
    def _load_block(X, S, H, sx_b, sx_h, sx_s, QB: tl.constexpr, D: tl.constexpr):
        """This program's (QB, D) block of tokens of one head, fp32 (rows past S: zeros) -> (x, rows, cols,
        keep, bh)."""
        bh = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * QB + tl.arange(0, QB)
        cols = tl.arange(0, D)
        keep = (rows < S)[:, None]
        src = X + (bh // H) * sx_b + (bh % H) * sx_h + rows.to(tl.int64)[:, None] * sx_s + cols[None, :]
        return tl.load(src, mask=keep, other=0.0).to(tl.float32), rows, cols, keep, bh

    @triton.jit
    def _quant_int8_kernel(
        X,
        Y,
        SC,
        MEAN,
        S,
        Sp,
        H,
        sx_b,
        sx_h,
        sx_s,
        QB: tl.constexpr,
        D: tl.constexpr,
        SMOOTH: tl.constexpr,
        PER_ROW: tl.constexpr,
    ):
        """One (QB, D) block of one head -> int8 (rows past S: zeros) and its scale, or (PER_ROW) one scale
        per row."""
        x, rows, cols, keep, bh = _load_block(X, S, H, sx_b, sx_h, sx_s, QB, D)
        if SMOOTH:
            x = tl.where(keep, x - tl.load(MEAN + bh * D + cols)[None, :], 0.0)
        if PER_ROW:
            amax = tl.max(tl.abs(x), axis=1)
            sc = tl.where(amax > 0, amax / 127.0, 1.0)
            y = x / sc[:, None]
            tl.store(SC + bh * Sp + rows, sc)
        else:
            amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            sc = tl.where(amax > 0, amax / 127.0, 1.0)
            y = x / sc
            tl.store(SC + bh * (Sp // QB) + tl.program_id(0), sc)
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds |y| <= 127 to the nearest even integer
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(Y + bh * Sp * D + rows[:, None] * D + cols[None, :], y.to(tl.int8))

    @triton.jit
    def _quant_v_kernel(
        X, Y, VS, S, Sp, H, sx_b, sx_h, sx_s, QB: tl.constexpr, D: tl.constexpr, INTERP: tl.constexpr
    ):
        """One (QB, D) block of V over its channel scales -> e4m3, stored transposed (D, rows)."""
        x, rows, cols, keep, bh = _load_block(X, S, H, sx_b, sx_h, sx_s, QB, D)
        y = x / tl.load(VS + bh * D + cols)[None, :]
        if INTERP:
            y = _round_e4m3(y)  # (the interpreter's own e4m3 cast is off)
        tl.store(Y + bh * D * Sp + cols[None, :] * Sp + rows[:, None], y.to(tl.float8e4nv))

    @triton.jit
    def _qk(q, KD, krow, start, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
        """Q·Kᵀ of the BLOCK_N keys from row krow + start of KD (a TMA load) -> (BLOCK_M, BLOCK_N) int32."""
        k = KD.load([krow + start, 0])  # (BLOCK_N, D) int8
        if INTERP:  # the interpreter's dot: fp32 is exact for these int8 products and sums (< 2^24)
            return tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee").to(tl.int32)
        return tl.dot(q, tl.trans(k), out_dtype=tl.int32)

    @triton.jit
    def _softmax_pv(
        s,
        qs,
        m_i,
        l_i,
        acc,
        KS,
        VD,
        bh,
        start,
        S,
        Sp,
        log2_p,
        D: tl.constexpr,
        QB: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASK: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """The online softmax of one key block's int32 logits s (inside one K-scale block), then its
        P·V -> (m_i, l_i, acc). MASK: the last block (keys past S are the zero padding: no weight)."""
        offs_n = start + tl.arange(0, BLOCK_N)
        # c: the logit (log2 units) of one unit of s, per query row (the key block's scale is one number)
        c = qs * tl.load(KS + bh * (Sp // QB) + start // QB)
        # s as fp32 without the conversion unit (16 a clock per SM, as exp2): |s| <= 127² * 256 < 2^22, so
        # s + 1.5 * 2^23 read as fp32 bits is that float, exactly; subtract it back (exact)
        sf = (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        if MASK:
            valid = (offs_n < S)[None, :]
            sf = tl.where(valid, sf, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sf, axis=1) * c)  # c > 0: the max of s, scaled, is the logits' max
        alpha = tl.exp2(m_i - m_new)
        x = sf * c[:, None] - (m_new - log2_p)[:, None]  # one FMA: log2 of P̃ times P's scale (<= log2_p)
        p = tl.exp2(x)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = VD.load([(bh * D).to(tl.int32), start])  # (D, BLOCK_N) e4m3 (a TMA load)
        if INTERP:  # exact e4m3 rounding (the interpreter's own cast is off), then an fp32 dot
            pv = tl.dot(_round_e4m3(p), tl.trans(vt.to(tl.float32)), input_precision="ieee")
        else:
            pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        return m_new, l_i, acc * alpha[:, None] + pv  # two-level: each block's P·V summed in fp32

    @triton.jit
    def _attn_int8_kernel(
        Q8,
        QS,
        KD,  # TMA descriptors of the int8 K rows (B * H * Sp, D) and of e4m3 Vᵀ (B * H * D, Sp)
        KS,
        VD,
        VS,
        Out,
        scale_log2,  # log2(e) / sqrt(D)
        S,
        Sp,
        H,
        so_b,
        so_h,
        so_s,
        D: tl.constexpr,
        QB: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        P_MAX: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        log2_p = tl.log2(P_MAX)
        q = tl.load(Q8 + bh * Sp * D + offs_m[:, None] * D + offs_d[None, :])  # (BLOCK_M, D) int8
        qs = tl.load(QS + bh * Sp + offs_m) * scale_log2  # (BLOCK_M,) per-token scales, log2 units
        if INTERP:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        # l_i and acc both carry P's scale, which the division cancels. The last, partial key block
        # alone takes the padding mask.
        krow = (bh * Sp).to(tl.int32)
        full = S // BLOCK_N
        for j in range(0, full):
            s = _qk(q, KD, krow, j * BLOCK_N, BLOCK_N, INTERP)
            m_i, l_i, acc = _softmax_pv(
                s,
                qs,
                m_i,
                l_i,
                acc,
                KS,
                VD,
                bh,
                j * BLOCK_N,
                S,
                Sp,
                log2_p,
                D,
                QB,
                BLOCK_N,
                False,
                INTERP,
            )
        if full * BLOCK_N < S:
            s = _qk(q, KD, krow, full * BLOCK_N, BLOCK_N, INTERP)
            m_i, l_i, acc = _softmax_pv(
                s,
                qs,
                m_i,
                l_i,
                acc,
                KS,
                VD,
                bh,
                full * BLOCK_N,
                S,
                Sp,
                log2_p,
                D,
                QB,
                BLOCK_N,
                True,
                INTERP,
            )
        vs = tl.load(VS + bh * D + offs_d)  # (D,) V's per-channel scales
        out = acc * vs[None, :] / l_i[:, None]
        b = bh // H
        h = bh % H
        optr = Out + b * so_b + h * so_h + offs_m[:, None].to(tl.int64) * so_s + offs_d[None, :]
        tl.store(optr, out.to(Out.dtype.element_ty), mask=(offs_m < S)[:, None])


def gpu_tile(D: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on a GPU. BLOCK_N is the online softmax's key block, so it
    sets where P̃ is rounded and the quality gate's result; BLOCK_M and the rest change only the speed.
    d <= 128: the fastest 64-key tile on an H100 and (within 1%) on an H200 (`qwenfast bench attention
    tiles`; outputs bit-equal to the other 64-key tiles). BLOCK_N divides the K scale's 64-key block: an
    earlier kernel's 128-key blocks ran ~15% faster but lost the text-to-image gate (-3.3 points against
    -1.7: bench/results/attention.jsonl). d = 256: untimed."""
    return (64, 64, 4, 3) if D <= 128 else (64, 32, 4, 2)


def _config(D: int) -> tuple[int, int, int, int]:
    """The tile this process runs: `gpu_tile`, or small tiles in Triton's CPU interpreter."""
    return (32, 32, 4, 1) if interpreting() else gpu_tile(D)


def attention_int8_quantized(
    z: Int8QKV,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """The kernel on quantised inputs -> (B, H, S, D) in `out_dtype`, a view of (B, S, H, D) memory
    (`out`, when given: a contiguous (B, S, H, D) buffer to write). `config`: (BLOCK_M, BLOCK_N,
    num_warps, num_stages), default `_config` (a tile sweep passes others; BLOCK_N a divisor of
    QUANT_BLOCK, so a key block has one scale; BLOCK_M dividing PAD)."""
    B, H, Sp, D = z.q8.shape
    BM, BN, warps, stages = config or _config(D)
    if QUANT_BLOCK % BN or PAD % BM:
        raise ValueError(
            f"attention_int8: BLOCK_N {BN} must divide {QUANT_BLOCK} and BLOCK_M {BM} divide {PAD}"
        )
    o = torch.empty(B, z.S, H, D, dtype=out_dtype, device=z.q8.device) if out is None else out
    grid = (triton.cdiv(z.S, BM), B * H)
    kd = TensorDescriptor(z.k8.view(B * H * Sp, D), [B * H * Sp, D], [D, 1], [BN, D])
    vd = TensorDescriptor(z.v8t.view(B * H * D, Sp), [B * H * D, Sp], [Sp, 1], [D, BN])
    with _on_device(o):
        _attn_int8_kernel[grid](
            z.q8,
            z.qs,
            kd,
            z.ks,
            vd,
            z.vs,
            o,
            math.log2(math.e) / math.sqrt(D),
            z.S,
            Sp,
            H,
            o.stride(0),
            o.stride(2),
            o.stride(1),
            D=D,
            QB=QUANT_BLOCK,
            BLOCK_M=BM,
            BLOCK_N=BN,
            P_MAX=P_SCALE,
            INTERP=interpreting(),
            num_warps=warps,
            num_stages=stages,
        )
    return o.transpose(1, 2)


def _quantize_kernels(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mean: torch.Tensor, vs: torch.Tensor, Sp: int
) -> Int8QKV:
    """The per-block quantisation of `quantize_int8_attention` as three Triton passes."""
    B, H, S, D = q.shape
    dev = q.device
    nb = Sp // QUANT_BLOCK
    grid = (nb, B * H)
    out = []
    with _on_device(q):
        for x, smooth in ((q, False), (k, True)):  # Q: one scale per token; K: per block of keys
            x8 = torch.empty(B, H, Sp, D, dtype=torch.int8, device=dev)
            sc = torch.empty(B, H, nb if smooth else Sp, dtype=torch.float32, device=dev)
            args = (x, x8, sc, mean.contiguous(), S, Sp, H, *x.stride()[:3])
            _quant_int8_kernel[grid](*args, QB=QUANT_BLOCK, D=D, SMOOTH=smooth, PER_ROW=not smooth)
            out += [x8, sc]
        v8t = torch.empty(B, H, D, Sp, dtype=E4M3, device=dev)
        _quant_v_kernel[grid](
            v, v8t, vs.contiguous(), S, Sp, H, *v.stride()[:3], QB=QUANT_BLOCK, D=D, INTERP=interpreting()
        )
    return Int8QKV(*out, v8t, vs, S)


def kernel_runs(q: torch.Tensor) -> bool:
    """Whether `attention_int8` runs the kernel for `q` (else the reference): Triton on the tensor's
    device, a power-of-two head dim 32..256 (INT8 tensor-core products take K >= 32), and no autograd."""
    D = q.shape[-1]
    return triton_available() and use_triton(q) and D in (32, 64, 128, 256)


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """INT8 Q·Kᵀ + FP8 P·V attention of q, k, v (B, H, S, D) (equal shapes, bf16/fp16/fp32, any strides)
    -> (B, H, S, D) in q's dtype (a view of (B, S, H, D) memory). The kernel where `kernel_runs`, else
    `attention_int8_ref`."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"attention_int8 needs equal q, k, v shapes, got {q.shape} {k.shape} {v.shape}")
    if not kernel_runs(q):
        return attention_int8_ref(q, k, v)
    return attention_int8_quantized(quantize_int8_attention(q, k, v), q.dtype)
