"""Session 12 (issue 18): the Qwen-Image-2.1 cached step (1024², 128 prompt tokens, bf16, full size,
random weights, CUDA graph) in variants captured side by side, timed in interleaved rounds against
diffusers' eager cached step in the same process (so clock and temperature drift hit all alike):

- "v in place": the V projection written by its GEMM straight into the KV cache (`project_qkv`)
- "one qkv GEMM": the previous layout (Q|K|V in one GEMM, V copied by the QK-norm kernel)
- "cudnn": "v in place" with cuDNN attention instead of FA3 (where FA3 is installed)
- "cublaslt": "v in place" captured with `preferred_blas_library("cublaslt")`

then the kernel timeline of one "v in place" replay (time by category, idle gaps) and the SM clock
while each runs for ~2 s. Prints a table and a JSON line.  `python bench/h21_ab.py [--rounds 4]`
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from fp8_gaps import _with_clocks, cat, timeline

import qwenfast.models.transformer21 as T
from qwenfast.benchmarks import versions
from qwenfast.runtime import attention as A


def ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1000


def main() -> None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from qwenfast.loading.qwenimage21 import Fuser21
    from qwenfast.loading.weights import load_streaming
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner
    from qwenfast.testing.tiny21 import diffusers_transformer21

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    ref = diffusers_transformer21(dtype=dt, device=dev, seed=0, num_layers=a.layers)
    cfg = T.Transformer21Config(num_layers=a.layers)
    with torch.device("meta"):
        ours = T.QwenImage21Transformer(cfg)
    items = ((k, v.detach().clone(), Path("memory")) for k, v in ref.state_dict().items())
    ours = load_streaming(ours, items, dtype=dt, where="memory", convert=Fuser21())
    h = w = 64
    N, L = h * w, 128
    g = torch.Generator(dev).manual_seed(1)
    emb = torch.randn(1, L, 4096, device=dev, dtype=dt, generator=g)
    x = torch.randn(1, N, 64, device=dev, dtype=dt, generator=g)
    t = torch.full((1,), 0.5, device=dev, dtype=dt)
    vl = torch.cat([torch.zeros(L, dtype=torch.bool), torch.ones(N // 4, dtype=torch.bool)])
    shapes = [(1, h, w)]

    def ref_fwd(cache, mode):
        return ref(hidden_states=x, encoder_hidden_states=emb, timestep=t, img_shapes=[shapes], img_mask=vl.to(dev)[None],
                   kv_cache=cache, kv_cache_mode=mode, return_dict=False)[0][:, -N:]  # fmt: skip

    rec = {"what": "2.1 cached step variants", "gpu": torch.cuda.get_device_name(), **versions()}
    with torch.no_grad():
        rc = QwenImage21KVCache(cfg.num_layers)
        ref_fwd(rc, "extract")
        want = ref_fwd(rc, "cached").float()
        oc = T.PrefixKVCache(cfg.num_layers)
        ours(x, emb, None, t, shapes, vl, oc, "extract")
        graphs = CudaGraphRunner(ours)

        def cached(x, t):
            return ours(x, emb, None, t, shapes, vl, oc, "cached")

        real_project, fa3 = T.project_qkv, A._fa3(allow_fwd=True) is not None
        variants = {}
        for name in ("v in place", "one qkv GEMM", "cudnn", "cublaslt"):
            if name == "cudnn" and not fa3:
                continue
            T.project_qkv = (lambda lin, h, vb, off: (lin(h), vb)) if name == "one qkv GEMM" else real_project
            A.set_attention("cudnn" if name == "cudnn" else "auto")
            torch.backends.cuda.preferred_blas_library("cublaslt" if name == "cublaslt" else "cublas")
            out = graphs.run(("cached", name), cached, x, t).float()  # captured under these settings
            rec[f"rel_err {name}"] = float(f"{((out - want).norm() / want.norm()).item():.3e}")
            variants[name] = lambda name=name: graphs.run(("cached", name), cached, x, t)
        T.project_qkv = real_project
        A.set_attention("auto")
        torch.backends.cuda.preferred_blas_library("cublas")

        runs = {k: [] for k in ("diffusers eager", *variants)}
        for _ in range(a.rounds):
            runs["diffusers eager"].append(ms(lambda: ref_fwd(rc, "cached"), 5))
            for name, fn in variants.items():
                runs[name].append(ms(fn, 10))
        rec["ms"] = {k: round(statistics.median(v), 2) for k, v in runs.items()}
        rec["ms_rounds"] = {k: [round(x, 2) for x in v] for k, v in runs.items()}
        rec["speedup_vs_diffusers_eager"] = {k: round(rec["ms"]["diffusers eager"] / v, 3) for k, v in rec["ms"].items()}

        ks = timeline(variants["v in place"])
        by = {}
        for s, e, n in ks:
            by[cat(n)] = by.get(cat(n), 0.0) + (e - s) / 1000
        gaps = [b[0] - a_[1] for a_, b in zip(ks, ks[1:]) if b[0] > a_[1]]
        rec["timeline_v_in_place"] = {"span_ms": round((ks[-1][1] - ks[0][0]) / 1000, 2), "kernels": len(ks),
                                      "busy_ms": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda i: -i[1])},
                                      "idle_ms": round(sum(gaps) / 1000, 2)}  # fmt: skip
        top = {}
        for s, e, n in ks:
            top[n[:70]] = top.get(n[:70], 0.0) + (e - s) / 1000
        rec["top_kernels_ms"] = {k: round(v, 2) for k, v in sorted(top.items(), key=lambda i: -i[1])[:10]}
        clocks = {}
        for name, fn in (("diffusers eager", lambda: ref_fwd(rc, "cached")), ("v in place", variants["v in place"])):
            _, clocks[name] = _with_clocks(lambda fn=fn: [fn() for _ in range(20)] and torch.cuda.synchronize())
        rec["sm_clock_mhz"] = clocks
    print(f"{'variant':<18} {'median ms':>9} {'vs diffusers':>12}  rounds")
    for k, v in rec["ms"].items():
        print(f"{k:<18} {v:>9} {rec['speedup_vs_diffusers_eager'][k]:>12}  {rec['ms_rounds'][k]}")
    print(json.dumps(rec))
    if a.out:
        with open(Path(a.out) / "h21_ab.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
