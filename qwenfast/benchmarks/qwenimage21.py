"""Qwen-Image-2.1 transformer: qwenfast vs diffusers' `QwenImage21Transformer2DModel`, same random
full-size weights (32 layers x 4096), same run, one GPU.

Measures per forward at a 1024² target (4096 tokens) with a 128-token prompt: the prefill step
("extract", block-causal over the whole sequence) and the cached steps (target tokens against the
stored prefix, where 39 of 40 steps go), bf16 and FP8, the relative error against diffusers, and a
denoise loop of 40 and 4 steps (no CFG) built from those forwards. The Qwen3-VL text encoder
(8B) is not loaded: random prompt embeddings stand in (its cost is one encode per call).

    python -m qwenfast.benchmarks.qwenimage21 [--size 1024] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1000


def main(argv=None) -> list[dict]:
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from ..loading.qwenimage21 import Fuser21
    from ..loading.weights import load_streaming
    from ..models.transformer21 import PrefixKVCache, QwenImage21Transformer, Transformer21Config

    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    with torch.device(dev):
        ref = QwenImage21Transformer2DModel().to(dt).eval()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, m.in_features**-0.5)
    cfg = Transformer21Config()
    with torch.device("meta"):
        ours = QwenImage21Transformer(cfg)
    items = ((k, v.detach().clone(), Path("memory")) for k, v in ref.state_dict().items())
    ours = load_streaming(ours, items, dtype=dt, where="memory", convert=Fuser21())
    h = w = a.size // 16
    N, L = h * w, a.text
    emb = torch.randn(1, L, 4096, device=dev, dtype=dt)
    x = torch.randn(1, N, 64, device=dev, dtype=dt)
    t = torch.full((1,), 0.5, device=dev, dtype=dt)
    vl = torch.cat([torch.zeros(L, dtype=torch.bool), torch.ones(N // 4, dtype=torch.bool)]).to(dev)
    shapes = [(1, h, w)]
    rows: list[dict] = []

    def ref_fwd(cache=None, mode=None):
        return ref(hidden_states=x, encoder_hidden_states=emb, timestep=t, img_shapes=[shapes], img_mask=vl[None],
                   kv_cache=cache, kv_cache_mode=mode, return_dict=False)[0][:, -N:]  # fmt: skip

    with torch.no_grad():
        rc = QwenImage21KVCache(cfg.num_layers)
        ref_fwd(rc, "extract")
        ref_prefill = _time(lambda: ref_fwd())
        ref_cached = _time(lambda: ref_fwd(rc, "cached"))
        want = ref_fwd(rc, "cached").float()
        for label, fp8 in (("bf16", False), ("fp8", True)):
            if fp8:
                from ..kernels.fp8_linear import quantize_model

                quantize_model(ours)
            oc = PrefixKVCache(cfg.num_layers)
            ours(x, emb, None, t, shapes, vl, oc, "extract")
            pre = _time(lambda: ours(x, emb, None, t, shapes, vl))
            cached = _time(lambda: ours(x, emb, None, t, shapes, vl, oc, "cached"))
            got = ours(x, emb, None, t, shapes, vl, oc, "cached").float()
            err = ((got - want).norm() / want.norm()).item()
            for steps in (40, 4):
                rows.append({"what": "qwen-image-2.1 transformer", "size": a.size, "dtype": label, "steps": steps,
                             "diffusers_prefill_ms": round(ref_prefill, 2), "diffusers_cached_ms": round(ref_cached, 2),
                             "ours_prefill_ms": round(pre, 2), "ours_cached_ms": round(cached, 2),
                             "rel_err_cached": err,
                             "diffusers_loop_s": round((ref_prefill + (steps - 1) * ref_cached) / 1000, 3),
                             "ours_loop_s": round((pre + (steps - 1) * cached) / 1000, 3),
                             "speedup_loop": round((ref_prefill + (steps - 1) * ref_cached)
                                                   / (pre + (steps - 1) * cached), 3),
                             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)})  # fmt: skip
    print(f"{'dtype':>5} {'steps':>5} {'ref pre':>8} {'ref cached':>10} {'ours pre':>8} {'ours cached':>11} "
          f"{'rel err':>8} {'loop x':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['dtype']:>5} {r['steps']:>5} {r['diffusers_prefill_ms']:>8} {r['diffusers_cached_ms']:>10} "
              f"{r['ours_prefill_ms']:>8} {r['ours_cached_ms']:>11} {r['rel_err_cached']:>8.1e} "
              f"{r['speedup_loop']:>6}")  # fmt: skip
    for r in rows:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
