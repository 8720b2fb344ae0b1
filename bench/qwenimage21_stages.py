"""Where Qwen-Image-2.1's end-to-end time goes besides the denoise loop, ours vs diffusers, same
weights, one process: prompt encoding (random Qwen3-VL of the 8B shape), VAE decode and encode at
1024² (ours: reference modules and the fast path), the 4-step turbo schedule end to end, and the
top CUDA kernels of our prefill (the "extract" step) and the text encoder. GPU only (H100 / H200),
about 4 minutes.

    python bench/qwenimage21_stages.py [--out FILE] [--text-encoder tiny] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from qwenfast.benchmarks.harness import PROMPT
from qwenfast.benchmarks.pipeline21 import build
from qwenfast.benchmarks.pipeline_stages import _median_ms as med_ms  # wall clock, synchronised, CPU too
from qwenfast.benchmarks.transformer21 import _profile
from qwenfast.config import TURBO_SIGMAS


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(f"{((a - b).norm() / b.norm()).item():.2e}")


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--text-encoder", choices=["full", "tiny"], default="full")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (timings meaningless)")
    a = p.parse_args()
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    row: dict = {"what": "qwen-image-2.1 stages", "size": a.size, "device": name}
    with tempfile.TemporaryDirectory() as tmp:
        ref, ours, te = build(dev, dt, a.text_encoder, Path(tmp), a.layers)
        row["text_encoder"] = te
        # 1. prompt encoding
        row["te_diffusers_ms"] = med_ms(lambda: ref.encode_prompt(PROMPT, device=dev))
        row["te_ours_ms"] = med_ms(lambda: ours.text_encoder.encode([PROMPT]))
        e_ref = ref.encode_prompt(PROMPT, device=dev)[0]
        e_ours = ours.text_encoder.encode([PROMPT])[0]
        row["te_rel_err"] = rel(e_ours, e_ref)
        # the bf16 noise floor: both encodes against diffusers' encode with the text encoder in fp32
        import copy

        te_bf16 = ref.text_encoder
        ref.text_encoder = copy.deepcopy(te_bf16).float()
        e32 = ref.encode_prompt(PROMPT, device=dev)[0]
        ref.text_encoder = te_bf16
        row["te_diffusers_vs_fp32_rel_err"], row["te_ours_vs_fp32_rel_err"] = rel(e_ref, e32), rel(e_ours, e32)
        del e32
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        row["te_tokens"] = int(e_ours.shape[1])
        if dev.type == "cuda":
            _profile(lambda: ours.text_encoder.encode([PROMPT]), "ours prompt encoding", top=10)
        # 2. VAE decode / encode
        g = torch.Generator(dev).manual_seed(3)
        h = a.size // 16
        z = torch.randn(1, 64, h, h, device=dev, dtype=dt, generator=g)
        x = torch.rand(1, 4, a.size, a.size, device=dev, dtype=dt, generator=g) * 2 - 1
        want = ref.vae.decode(z[:, :, None]).sample[:, :, 0]
        want_m = ref.vae.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
        row["vae_decode_diffusers_ms"] = med_ms(lambda: ref.vae.decode(z[:, :, None]))
        row["vae_encode_diffusers_ms"] = med_ms(lambda: ref.vae.encode(x[:, :, None]))
        for fast in (False, True):
            ours.vae.fast = fast
            tag = "fast" if fast else "reference"
            row[f"vae_decode_{tag}_ms"] = med_ms(lambda: ours.vae.decode(z))
            row[f"vae_encode_{tag}_ms"] = med_ms(lambda: ours.vae.encode(x))
            row[f"vae_decode_{tag}_rel_err"] = rel(ours.vae.decode(z), want)
            row[f"vae_encode_{tag}_rel_err"] = rel(ours.vae.encode(x)[0], want_m)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if dev.type == "cuda":
            _profile(lambda: ours.vae.decode(z), "ours VAE decode (fast)", top=12)
        print(json.dumps(row), flush=True)
        # 3. the 4-step turbo schedule end to end
        sig = list(TURBO_SIGMAS["turbo-4"])
        kw = dict(prompt=PROMPT, height=a.size, width=a.size, output_type="np", num_inference_steps=4, sigmas=sig)

        def run(pipe):
            return pipe(**kw, generator=torch.Generator(dev).manual_seed(0)).images

        for name, pipe in (("diffusers", ref), ("ours", ours)):
            run(pipe)
            row[f"turbo4_{name}_ms"] = med_ms(lambda pipe=pipe: run(pipe), n=3)
        row["turbo4_speedup"] = round(row["turbo4_diffusers_ms"] / row["turbo4_ours_ms"], 3)
        row["turbo4_mean_abs_diff"] = float(f"{np.abs(run(ours) - run(ref)).mean():.3e}")
        # 4. our prefill ("extract") step's kernels
        from qwenfast.models.transformer21 import PrefixKVCache

        tr = ours.transformer
        emb, mask, slots = ours.text_encoder.encode([PROMPT])
        N = h * h
        L = emb.shape[1]
        vl = torch.cat([slots[0].cpu(), torch.ones(N // 4, dtype=torch.bool)])
        lat = torch.randn(1, N, 64, device=dev, dtype=dt)
        t = torch.full((1,), 0.5, device=dev, dtype=dt)
        cache = PrefixKVCache(tr.cfg.num_layers)
        row["prefill_ms"] = med_ms(lambda: tr(lat, emb, mask, t, [(1, h, h)], vl, cache, "extract"))
        row["cached_ms"] = med_ms(lambda: tr(lat, emb, mask, t, [(1, h, h)], vl, cache, "cached"))
        row["prompt_tokens"] = int(L)
        if dev.type == "cuda":
            _profile(lambda: tr(lat, emb, mask, t, [(1, h, h)], vl, cache, "extract"), "ours prefill step", top=14)
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
