"""The INT8 Q·Kᵀ + FP8 P·V attention kernel (kernels/attn_int8.py) over its tile choices: (BLOCK_M,
BLOCK_N, num_warps, num_stages) at Qwen-Image's 1024² and 2048² joint attention (B=1, 24 heads, d=128,
4224 and 16512 tokens): kernel ms (CUDA-event median, quantisation excluded), TOP/s, rel. error vs the
kernel at its default tile (each tile must give the same result up to fp32 summation order) and vs exact
fp32 attention; a tile that fails to compile or run is listed with its error. How the default tile was
chosen. One H100 / H200 GPU, about 2 minutes.

    python bench/attn_int8_tiles.py [--results DIR]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenfast.benchmarks import emit, median_ms, rel_err, versions  # noqa: E402
from qwenfast.kernels.attn_int8 import _config, attention_int8_quantized, quantize_int8_attention  # noqa: E402

SIZES = {4224: "1024²", 16512: "2048²"}
TILES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (bm, bn, w, st)
    for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))
    if not (bm == 64 and w == 8)  # 64 rows over 8 warps: wgmma's M is 64 per warp group
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=None, metavar="DIR", help="append to DIR/attention.jsonl")
    a = ap.parse_args()
    info = versions()
    default = _config(128)
    rows = []
    for S, what in SIZES.items():
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (
            torch.randn(1, S, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(3)
        )
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        z = quantize_int8_attention(q, k, v)
        ref = attention_int8_quantized(z, q.dtype, config=default).clone()
        flop = 4 * S * S * 128 * 24
        for tile in TILES:
            r = {"S": S, "size": what, "tile": list(tile), "default": tile == default}
            try:
                out = attention_int8_quantized(z, q.dtype, config=tile)
                r["rel_err_vs_default"] = float(f"{rel_err(out, ref):.2e}")
                r["rel_err_vs_fp32"] = float(f"{rel_err(out, exact):.2e}")
                r["ms"] = round(
                    median_ms(
                        lambda t=tile, z=z, dt=q.dtype: attention_int8_quantized(z, dt, config=t), 5, 30
                    ),
                    4,
                )
                r["tops"] = round(flop / r["ms"] / 1e9, 1)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a row, not the end
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
            print(
                f"{S:6d} {str(tile):18s} {r.get('ms', float('nan')):8.4f} ms {r.get('tops', 0):7.1f} TOP/s "
                f"err(default) {r.get('rel_err_vs_default')} err(fp32) {r.get('rel_err_vs_fp32')} "
                f"{r.get('error', '')}",
                flush=True,
            )
        torch.cuda.empty_cache()
    best = {}
    for S in SIZES:
        ok = [r for r in rows if r["S"] == S and "ms" in r and r["rel_err_vs_default"] <= 1e-3]
        best[S] = min(ok, key=lambda r: r["ms"])["tile"] if ok else None
        print(f"best at {S}: {best[S]}")
    emit({"bench": "attn_int8_tiles", **info, "default": list(default), "rows": rows, "best": best},
         "attention.jsonl", a.results)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
