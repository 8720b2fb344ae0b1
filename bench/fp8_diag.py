"""Which FP8 GEMM shapes cuBLASLt refuses on this GPU (raw `torch._scaled_mm`, rowwise scales), and
whether `FP8Linear` (which pads M to a multiple of 16) runs them; then a 2-layer full-width FP8
transformer over short text lengths, batch 1 and 2, with and without a mask. Prints failures with
their tracebacks. GPU only: `python bench/fp8_diag.py`."""

import traceback

import torch

from qwenfast.kernels.fp8_linear import FP8Linear, quantize_model, quantize_rows_ref

dev = "cuda"
bad_raw, bad_ours = [], []
for K, N in ((3072, 3072), (3072, 9216), (3072, 12288), (12288, 3072)):
    w8, sw = quantize_rows_ref(torch.randn(N, K, device=dev, dtype=torch.bfloat16))
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
    lin = FP8Linear(w8, sw, bias, torch.bfloat16)
    for M in list(range(1, 34)) + [48, 64, 130, 4096, 6889]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        x8, sx = quantize_rows_ref(x)
        try:
            torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), bias=bias, out_dtype=torch.bfloat16,
                             use_fast_accum=True)
            torch.cuda.synchronize()
        except RuntimeError as e:
            bad_raw.append((M, K, N, str(e).splitlines()[0][:80]))
        try:
            lin(x)
            torch.cuda.synchronize()
        except RuntimeError as e:
            bad_ours.append((M, K, N, str(e).splitlines()[0][:80]))
summary = [f"raw _scaled_mm refused {len(bad_raw)} shapes (M, K, N): {[b[:3] for b in bad_raw][:60]}",
           f"  first error: {bad_raw[0][3] if bad_raw else '-'}",
           f"FP8Linear (padded, with fallback) failed on {len(bad_ours)} shapes: {bad_ours[:10]}"]

from qwenfast.config import TransformerConfig  # noqa: E402
from qwenfast.models.transformer import QwenImageTransformer  # noqa: E402

torch.manual_seed(0)
m = QwenImageTransformer(TransformerConfig(num_layers=2)).to(dev, torch.bfloat16).eval()
quantize_model(m)
fails = 0
with torch.no_grad():
    for B in (1, 2):
        for L in (1, 5, 6, 7, 13, 23, 40):
            for masked in (False, True):
                x = torch.randn(B, 1024, 64, device=dev, dtype=torch.bfloat16)
                txt = torch.randn(B, L, 3584, device=dev, dtype=torch.bfloat16)
                mask = torch.ones(B, L, device=dev, dtype=torch.long) if masked else None
                if masked and L > 1:
                    mask[0, -1] = 0
                t = torch.full((B,), 0.5, device=dev, dtype=torch.bfloat16)
                try:
                    y = m(x, txt, mask, t, [(1, 32, 32)])
                    torch.cuda.synchronize()
                    assert torch.isfinite(y).all()
                except Exception:  # noqa: BLE001
                    fails += 1
                    summary.append(f"FAIL B={B} L={L} masked={masked}")
                    if fails <= 1:
                        traceback.print_exc()
print("\n".join(summary))
print(f"transformer FP8 forward failures: {fails}")
