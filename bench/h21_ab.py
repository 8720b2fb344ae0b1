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
from pathlib import Path

import torch
from fp8_gaps import _with_clocks, kernel_summary, timeline

import qwenfast.models.transformer21 as T
from qwenfast.benchmarks import versions
from qwenfast.runtime import attention as A


def main() -> None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from qwenfast.benchmarks.qwenimage21 import _time, setup
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ref, ours, (x, emb, t, shapes, vl), ref_fwd = setup(1024, 128, a.layers, torch.device("cuda"))
    cfg = ours.cfg

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
            runs["diffusers eager"].append(_time(lambda: ref_fwd(rc, "cached"), 1, 5))
            for name, fn in variants.items():
                runs[name].append(_time(fn, 1, 10))
        rec["ms"] = {k: round(statistics.median(v), 2) for k, v in runs.items()}
        rec["ms_rounds"] = {k: [round(x, 2) for x in v] for k, v in runs.items()}
        rec["speedup_vs_diffusers_eager"] = {k: round(rec["ms"]["diffusers eager"] / v, 3) for k, v in rec["ms"].items()}

        ks = timeline(variants["v in place"])
        busy, gaps, _ = kernel_summary(ks)
        rec["timeline_v_in_place"] = {"span_ms": round((ks[-1][1] - ks[0][0]) / 1000, 2), "kernels": len(ks),
                                      "busy_ms": {k: round(v / 1000, 2) for k, v in busy.most_common()},
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
