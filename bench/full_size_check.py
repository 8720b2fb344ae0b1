"""GPU correctness check of the foundation: full-size transformer, random bf16 weights.

diffusers builds QwenImageTransformer2DModel (60 layers, 20B params) with random weights and saves
it in the real sharded layout; qwenfast loads that folder with its streaming loader; both run the
same 1024² inputs. Prints relative error, forward times and load time and a JSON record
(`--results DIR`: appended to DIR/full_size_check.jsonl). The two models are resident one after the
other, so it fits an 80 GB H100; about 4 minutes (most of it saving 40 GB of random weights).

    python bench/full_size_check.py [--size 1024] [--txt 128] [--dir /tmp/qi-random] [--results DIR]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwenfast.benchmarks import emit  # noqa: E402
from qwenfast.benchmarks.transformer import _median_ms  # noqa: E402
from qwenfast.benchmarks.transformer import _rel as rel


def timed(fn, warmup=2, iters=5) -> float:
    if not torch.cuda.is_available():  # CPU smoke run of this script: one call, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return _median_ms(fn, warmup, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--txt", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/qi-random/transformer")
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--results", default=None, help="append the record to DIR/full_size_check.jsonl")
    a = ap.parse_args()

    from diffusers import QwenImageTransformer2DModel

    from qwenfast.loading.diffusers_folder import load_transformer

    dev, dt = torch.device(a.device), torch.bfloat16
    h = w = a.size // 16
    L = h * w
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(2, L, 64, device=dev, dtype=dt, generator=g)
    txt = torch.randn(2, a.txt, 3584, device=dev, dtype=dt, generator=g)
    mask = torch.ones(2, a.txt, dtype=torch.long, device=dev)
    mask[1, a.txt // 3 :] = 0  # second sample: padded prompt
    t = torch.tensor([0.6, 0.6], device=dev)
    shapes = [(1, h, w)]
    res = {"bench": "full_size_check", "size": a.size, "txt": a.txt}

    # ---- diffusers: build random, save in the real layout, run
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        torch.set_default_dtype(dt)
        ref = QwenImageTransformer2DModel(num_layers=a.layers).eval()
        torch.set_default_dtype(torch.float32)
    res["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref.save_pretrained(a.dir, max_shard_size="5GB")
    res["save_s"] = time.perf_counter() - t0
    with torch.no_grad():
        def run_ref(i=slice(0, 1), m=None):
            return ref(hidden_states=x[i], encoder_hidden_states=txt[i], encoder_hidden_states_mask=m,
                       timestep=t[i], img_shapes=[shapes] * (i.stop - i.start), return_dict=False)[0]  # fmt: skip
        out_ref = run_ref().clone()
        out_ref_mask = run_ref(slice(0, 2), mask).clone()
        res["diffusers_ms"] = timed(run_ref)
    ref = None  # free the diffusers copy before loading ours
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # ---- qwenfast: stream the saved folder to the GPU, run
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load_transformer(Path(a.dir), dev, dt)
    if cuda:
        torch.cuda.synchronize()
    res["load_s"] = time.perf_counter() - t0
    res["load_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    with torch.no_grad():
        def run_ours(i=slice(0, 1), m=None):
            return model(x[i], txt[i], m, t[i], shapes)
        out = run_ours()
        out_mask = run_ours(slice(0, 2), mask)
        res["qwenfast_ms"] = timed(run_ours)
    res["rel_err"] = rel(out_ref, out)
    res["rel_err_masked_b2"] = rel(out_ref_mask, out_mask)
    res["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(out_mask).all())
    res["ok"] = res["finite"] and res["rel_err"] <= 1e-2 and res["rel_err_masked_b2"] <= 1e-2

    print(f"{'':24}{'diffusers':>12}{'qwenfast':>12}")
    print(f"{'forward ms (median)':24}{res['diffusers_ms']:>12.1f}{res['qwenfast_ms']:>12.1f}")
    print(f"rel err B=1: {res['rel_err']:.2e}   rel err B=2 masked: {res['rel_err_masked_b2']:.2e}   ok={res['ok']}")
    print(f"save {res['save_s']:.0f}s, qwenfast load {res['load_s']:.1f}s (peak {res['load_peak_gib']:.1f} GiB)")
    emit(res, "full_size_check.jsonl", a.results)

if __name__ == "__main__":
    main()
