"""Does the memory layout of Q / K / V change the attention kernel's speed? (issue 18: in the 2.1 cached
step our cuDNN attention took 15.3 ms against diffusers' 14.6 ms with the same kernel; our buffers are
token-major (B, S, H, D) for Q, K and V, diffusers' K / V come out of a `torch.cat` head-major.)

Per shape, per backend (cuDNN SDPA, FA3 bf16 from `fa3-fwd` when installed), per layout of Q and of
K/V ("tok" = (B, S, H, D) memory viewed as (B, H, S, D), "head" = contiguous (B, H, S, D)): the median
ms of one call (`triton.testing.do_bench`), and the output's max abs difference from the tok/tok
cuDNN result (layouts change no math: 0 expected for cuDNN).

    python bench/attn_layout.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (heads, query tokens, key tokens)
    "qwen-image 1024² joint": (24, 4224, 4224),
    "qwen-image 1328² joint": (24, 7017, 7017),
    "2.1 cached step 1024²": (32, 4096, 4224),
}


def _make(B, H, S, D, layout, g):
    if layout == "tok":
        return torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)


def main() -> None:
    try:
        import fa3_fwd_interface as fa3
    except Exception:
        fa3 = None
    rows = []
    for name, (H, Sq, Sk) in SHAPES.items():
        base = None
        for ql in ("tok", "head"):
            for kl in ("tok", "head"):
                g = torch.Generator(device="cuda").manual_seed(0)
                q = _make(1, H, Sq, 128, ql, g)
                k, v = _make(1, H, Sk, 128, kl, g), _make(1, H, Sk, 128, kl, g)
                # same values whatever the layout: rebuild from the tok draw
                g2 = torch.Generator(device="cuda").manual_seed(0)
                qt, kt, vt = (_make(1, H, s, 128, "tok", g2) for s in (Sq, Sk, Sk))
                q.copy_(qt), k.copy_(kt), v.copy_(vt)

                def cudnn():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v)

                out = cudnn()
                if base is None:
                    base = out.float()
                row = {"shape": name, "q": ql, "kv": kl, "cudnn_ms": round(triton.testing.do_bench(cudnn, rep=300), 4),
                       "cudnn_maxdiff": float((out.float() - base).abs().max())}  # fmt: skip
                if fa3 is not None:

                    def fa():
                        o = fa3.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                        return o[0] if isinstance(o, tuple) else o

                    try:
                        o = fa().transpose(1, 2)
                        row["fa3_ms"] = round(triton.testing.do_bench(fa, rep=300), 4)
                        row["fa3_maxdiff"] = float((o.float() - base).abs().max())
                    except Exception as e:  # noqa: BLE001 - a layout FA3 refuses
                        row["fa3_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                rows.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
