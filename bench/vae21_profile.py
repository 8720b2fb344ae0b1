"""Where Qwen-Image-2.1's VAE decode (fast path, 1024², bf16, full-size random weights) spends its
time: aten ops grouped by input shape, by CUDA time; and a micro-benchmark of the output conv
(few output channels: 144 -> 4 for 2.1, 96 -> 3 for Qwen-Image) against zero-padded output channels.

    python bench/vae21_profile.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from qwenfast.benchmarks import median_ms


def ms(fn, n: int = 10) -> float:
    return round(median_ms(fn, warmup=2, iters=n), 3)


@torch.no_grad()
def main() -> None:
    from diffusers import AutoencoderKLQwenImage21

    from qwenfast.loading.qwenimage21 import load_vae21

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    ref = AutoencoderKLQwenImage21(latents_mean=(torch.randn(64, generator=gen) * 0.5).tolist(),
                                   latents_std=(0.5 + torch.rand(64, generator=gen)).tolist())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(Path(tmp) / "vae")
        vae = load_vae21(Path(tmp) / "vae", dev, dt)
    z = torch.randn(1, 64, 64, 64, device=dev, dtype=dt)
    res = {"decode_fast_ms": ms(lambda: vae.decode(z), 5)}
    vae.fast = False
    res["decode_reference_ms"] = ms(lambda: vae.decode(z), 5)
    vae.fast = True
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        vae.decode(z)
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=30,
                                                             max_name_column_width=40, max_shapes_column_width=90))  # fmt: skip
    for cin, cout in ((144, 4), (96, 3)):
        x = torch.randn(1, cin, 1024, 1024, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, 3, 3, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
        b = torch.randn(cout, device=dev, dtype=dt)
        res[f"conv_{cin}_{cout}_ms"] = ms(lambda x=x, w=w, b=b: F.conv2d(x, w, b, padding=1))
        for pad in (8, 16, 32):
            wp = torch.zeros(pad, cin, 3, 3, device=dev, dtype=dt)
            wp[:cout] = w
            wp = wp.contiguous(memory_format=torch.channels_last)
            bp = torch.zeros(pad, device=dev, dtype=dt)
            bp[:cout] = b
            res[f"conv_{cin}_{cout}_pad{pad}_ms"] = ms(lambda x=x, wp=wp, bp=bp, c=cout: F.conv2d(x, wp, bp, padding=1)[:, :c].contiguous())
            got = F.conv2d(x, wp, bp, padding=1)[:, :cout]
            want = F.conv2d(x, w, b, padding=1)
            res[f"conv_{cin}_{cout}_pad{pad}_maxdiff"] = float((got.float() - want.float()).abs().max())
        xc = x.contiguous()
        res[f"conv_{cin}_{cout}_nchw_ms"] = ms(lambda xc=xc, w=w, b=b: F.conv2d(xc, w.contiguous(), b, padding=1))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
