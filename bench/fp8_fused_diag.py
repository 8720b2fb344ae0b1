"""GPU only: `python bench/fp8_fused_diag.py`. Mismatch statistics of the fused FP8 producers vs the unfused pair on the GPU (diagnostic)."""
import torch

import qwenfast.kernels as K
from qwenfast.kernels.adaln import layernorm_modulate, layernorm_modulate_fp8
from qwenfast.kernels.fp8_linear import quantize_activation, quantize_rows
from qwenfast.kernels.fp8_rows import quantize_rows_ref
from qwenfast.kernels.gated_residual import (
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_fp8,
)


def rnd(*s, dtype, seed, scale=1.0):
    return (torch.randn(*s, generator=torch.Generator().manual_seed(seed)) * scale).to("cuda", dtype)

def stats(tag, got, ref, gx=None, hx=None):
    M = got.rows
    s_diff = (got.scale[:M] != ref.scale[:M]).flatten()
    srel = ((got.scale[:M] / ref.scale[:M]) - 1).abs().max().item()
    c, cr = got.q[:M].view(torch.uint8).int(), ref.q[:M].view(torch.uint8).int()
    same = ~s_diff
    d = (c[same] - cr[same]).abs()
    out = f"{tag}: scales differ {int(s_diff.sum())}/{M} (max rel {srel:.2e}); codes (same-scale rows) differ {(d>0).float().mean().item():.2e} max step {int(d.max()) if d.numel() else 0}"
    if gx is not None:
        dx = (gx.float() - hx.float()).abs()
        ulp = hx.float().abs() * torch.finfo(hx.dtype).eps
        bad = dx > ulp
        out += f"; x differ {(dx>0).float().mean().item():.2e}, over 1 ulp {int(bad.sum())}, max d {dx.max().item():.3e} at |h| {hx.float().abs()[dx==dx.max()][0].item():.3e}"
    print(out, flush=True)

with K.use_backend("triton"):
    torch.manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    row = torch.cat([grid, mids, torch.randn(1000) * 100, -torch.rand(100) * 1e-6, torch.randn(1000) * 1e-3]).clamp(-448, 448)
    x = torch.stack([row, row.flip(0) * 0.37, torch.zeros_like(row)]).cuda()
    q, s = quantize_rows(x, rows=16)
    qr, sr = quantize_rows_ref(x)
    c, cr = q[:3].view(torch.uint8).int(), qr.view(torch.uint8).int()
    print("quantize_rows: scale equal", torch.equal(s[:3], sr), (s[:3]-sr).abs().max().item(), "rows0/2 codes equal", torch.equal(c[[0,2]], cr[[0,2]]), "row1 max step", int((c[1]-cr[1]).abs().max()), "frac", ((c[1]-cr[1])!=0).float().mean().item())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for split in (None, 20):
            B, L, D = 1, 77, 3072
            rows = B if split is None else 2 * B
            xx = rnd(B, L + 3, D, dtype=dtype, seed=1, scale=2.0)[:, 3:]
            shift, scale, _ = rnd(rows, 3 * D, dtype=dtype, seed=2).chunk(3, dim=-1)
            y = layernorm_modulate(xx, shift, scale, split=split)
            got = layernorm_modulate_fp8(xx, shift, scale, split=split, keep=True)
            stats(f"ln {dtype} split={split}", got, quantize_activation(y), got.x, y)
            x2 = rnd(B, L, D, dtype=dtype, seed=3, scale=2.0)
            y2 = rnd(B, L, D, dtype=dtype, seed=4)
            _, _, gate = rnd(rows, 3 * D, dtype=dtype, seed=5).chunk(3, dim=-1)
            sh, sc, _ = rnd(rows, 3 * D, dtype=dtype, seed=6).chunk(3, dim=-1)
            xp, hp = gated_residual_layernorm_modulate(x2, y2, gate, sh, sc, split=split)
            xn, g2 = gated_residual_layernorm_modulate_fp8(x2, y2, gate, sh, sc, split=split, out_x=x2.clone(), keep=True)
            stats(f"gr {dtype} split={split}", g2, quantize_activation(hp), g2.x, hp)
