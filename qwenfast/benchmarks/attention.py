"""8-bit attention on the GPU: candidates vs cuDNN bf16, the full FP8 forward, the demo quality gate.

`python -m qwenfast.benchmarks.attention micro|transformer|quality [--results DIR]` (bench/attention.sh
runs the three). Every step prints a table, a line per result starting with `ATTN` (grep-able), and
JSON lines (appended to DIR/attention.jsonl with --results); a failing candidate prints its error
and the run goes on.

- micro: Qwen-Image's joint attention (B=1, 24 heads, d=128, 4224, 7017, 16512 and 24777 tokens: 1024²,
  1328², 2048², 2512²; the model's BSHD buffers): cuDNN bf16, FA3 bf16 (if its wheel loads), "cudnn-fp8"
  (per-tensor scales), "fa3-fp8" (per-head scales) and "int8-qk-fp8-pv" (`kernels.attn_int8`: INT8 Q·Kᵀ
  after K smoothing, per-block scales, FP8 P·V), and "sage-int8-fp8" (SageAttention 2's CUDA kernel for
  Hopper, the same recipe, where bench/build_sageattention.py built it). Per candidate: ms per layer
  (CUDA events, median) for quantisation + kernel, the kernel alone and the quantisation alone; rel.
  error vs exact fp32 and vs cuDNN bf16 on N(0, 1) inputs and on sharper ones (Q, K x2); NaN checks
  (all-zero rows, 1e4-magnitude rows, all-zero tensors); a CUDA-graph replay equal to the eager call. PASS = rel. error vs fp32 <= PASS_TOL and
  every NaN and graph check. The winner (fastest PASS at 4224 tokens) goes to DIR/attn_winner.txt.
- transformer: the full-size 60-layer model (random bf16 weights, FP8 block GEMMs as `bench
  transformer`'s FP8 row) at 1024², CUDA graphs, attention "cudnn" vs "fp8": ms per forward, kernel
  time by category (eager profile: GEMM, attention, quantisation, other), rel. error of the output.
- tiles: the int8 kernel alone over its tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) at 4224 and
  16512 tokens: ms, TOP/s, rel. error vs its default tile and vs exact fp32 (how `gpu_tile` was chosen).
- quality: the demo quality gate (`demo.bench.quality_paths`) at batch 1, so the prompts carry no
  padding mask and the FP8 kernels really run (batched prompts of different lengths need a mask, for
  which "fp8" runs cuDNN bf16): bf16 + kernels + graphs and FP8 GEMMs + kernels + graphs, both with
  attention "fp8", then the fp32 reference; each gap to the reference (the gate: <= 2 points).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from . import emit, median_ms, rel_err, versions

PASS_TOL = 0.08  # rel. error vs exact fp32 on N(0, 1) inputs (e4m3 Q/K alone: ~0.046 at d=128)
TARGET_MS_PER_FORWARD = 12.0  # the goal: attention <= 12 ms of a 60-layer 1024² forward
LAYERS = 60
# the 8-bit candidates and the QWENFAST_FP8_ATTENTION engine each one is
ENGINE_OF = {"cudnn-fp8": "cudnn", "fa3-fp8": "fa3", "int8-qk-fp8-pv": "int8", "sage-int8-fp8": "sage"}
SIZES = {
    4224: "1024² (4096 image + 128 text tokens)",
    7017: "1328² (6889 image + 128 text tokens)",
    16512: "2048² (16384 image + 128 text tokens)",
    24777: "2512² (24649 image + 128 text tokens)",
}


def _say(tag: str, **kw) -> None:
    print("ATTN " + tag + " " + " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


def _inputs(S: int, seed: int, H: int = 24, D: int = 128, scale_qk: float = 1.0):
    """(B=1, H, S, D) bf16 views of (1, S, H, D) storage, as the model's fused attention writes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for s in (scale_qk, scale_qk, 1.0):
        x = torch.randn(1, S, H, D, device="cuda", generator=g) * s
        out.append(x.to(torch.bfloat16).transpose(1, 2))
    return out


def _exact(q, k, v) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def _cudnn_bf16(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def _candidates() -> dict:
    """name -> (run(q, k, v), kernel-only timer factory or None, quant-only fn or None, note)."""
    from .. import kernels as K
    from ..kernels.attn_quant import quantize_qkv
    from ..runtime import attention_fp8 as A8

    cands = {"cudnn-bf16": (_cudnn_bf16, None, None, f"torch cuDNN {torch.backends.cudnn.version()}")}
    try:
        fa3 = A8._import_fa3()
        cands["fa3-bf16"] = (
            lambda q, k, v: _first(
                fa3.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            ).transpose(1, 2),
            None,
            None,
            fa3.__name__,
        )
    except Exception as e:  # noqa: BLE001
        _say("unavailable", candidate="fa3-bf16", error=repr(f"{type(e).__name__}: {e}"))
    from ..kernels.attn_int8 import attention_int8, attention_int8_quantized, quantize_int8_attention

    def int8_kernel_only(q, k, v):
        z = quantize_int8_attention(q, k, v)
        return lambda: attention_int8_quantized(z, q.dtype)

    cands["int8-qk-fp8-pv"] = (
        attention_int8,
        int8_kernel_only,
        lambda q, k, v: lambda: quantize_int8_attention(q, k, v),
        A8.Int8Sage().version if K.triton_available() else "triton missing",
    )
    sage = A8.load_engine("sage")  # SageAttention 2's CUDA kernel, where built (bench/build_sageattention.py)
    if sage is None:
        _say("unavailable", candidate="sage-int8-fp8", error=repr(A8.engine_error("sage")))
    else:
        cands["sage-int8-fp8"] = (lambda q, k, v, e=sage: e.run(q, k, v), None, None, sage.version)
    for name in ("cudnn", "fa3"):
        eng = A8.load_engine(name)
        if eng is None:
            _say("unavailable", candidate=f"{name}-fp8", error=repr(A8.engine_error(name)))
            continue

        def run(q, k, v, eng=eng):
            return A8.run_engine(eng, q, k, v)

        def kernel_only(q, k, v, eng=eng):
            q8, k8, v8, d = quantize_qkv(q, k, v, per_head=eng.per_head)
            return lambda: eng(q8, k8, v8, d, q.dtype)

        def quant_only(q, k, v, eng=eng):
            return lambda: quantize_qkv(q, k, v, per_head=eng.per_head)

        cands[f"{name}-fp8"] = (
            run,
            kernel_only,
            quant_only,
            eng.version,
        )  # called after the runs: says which graphs
    return cands


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _nan_checks(run, S: int) -> dict:
    q, k, v = _inputs(S, seed=7)
    q, k, v = (t.clone() for t in (q, k, v))  # (B, H, S, D) contiguous copies: writable rows
    q[:, :, :64] = 0
    k[:, :, 100:164] = 0
    v[:, :, 200:264] = 0
    q[:, :, 300:304] = 1e4
    k[:, 3, 400:404] = -1e4
    v[:, 5, 500:504] = 1e4
    z = torch.zeros_like(q)
    res = {}
    for name, args in (
        ("zero_and_1e4_rows", (q, k, v)),
        ("all_zero", (z, z, z)),
        ("huge_tensor_1e4", (q * 0 + 1e4, k, v)),
    ):
        try:
            out = run(*args)
            res[name] = bool(torch.isfinite(out.float()).all())
        except Exception as e:  # noqa: BLE001
            res[name] = f"error: {type(e).__name__}: {e}"
    return res


def _graph_check(run, q, k, v) -> bool | str:
    """Capture one call in a CUDA graph, replay it: the same output as eager (bitwise)."""
    try:
        want = run(q, k, v)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(q, k, v)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run(q, k, v)
        g.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(out, want))
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}"


def micro(out_dir: Path | None) -> dict:

    info = {**versions(), "cudnn_torch": torch.backends.cudnn.version()}
    print(
        f"GPU {info['gpu']}  torch {info['torch']}  triton {info['triton']}  torch cuDNN {info['cudnn_torch']}"
    )
    cands = _candidates()
    for name, c in cands.items():
        _say("candidate", name=name, lib=repr(c[3]() if callable(c[3]) else c[3]))
    rows = []
    for S, what in SIZES.items():
        print(f"\n== S={S} tokens ({what}), B=1 H=24 d=128 ==", flush=True)
        q, k, v = _inputs(S, seed=S)
        exact = _exact(q, k, v)
        qs, ks, vs = _inputs(S, seed=S + 1, scale_qk=2.0)
        exact_s = _exact(qs, ks, vs)
        bf16 = _cudnn_bf16(q, k, v)
        for name, (run, kernel_only, quant_only, lib) in cands.items():
            row = {"bench": "attention_micro", **info, "S": S, "candidate": name, "lib": lib}
            try:
                with torch.no_grad():
                    out = run(q, k, v)
                    row["rel_err_vs_fp32"] = float(f"{rel_err(out, exact):.3e}")
                    row["rel_err_vs_cudnn_bf16"] = float(f"{rel_err(out, bf16):.3e}")
                    row["rel_err_sharp_vs_fp32"] = float(f"{rel_err(run(qs, ks, vs), exact_s):.3e}")
                    row["ms_layer"] = round(median_ms(lambda: run(q, k, v), 5, 30), 4)
                    if kernel_only is not None:
                        row["ms_kernel"] = round(median_ms(kernel_only(q, k, v), 5, 30), 4)
                        row["ms_quant"] = round(median_ms(quant_only(q, k, v), 5, 30), 4)
                    row["ms_forward_60"] = round(LAYERS * row["ms_layer"], 2)
                    row["tflops"] = round(4 * S * S * 128 * 24 / row["ms_layer"] / 1e9, 1)
                    row["nan_checks"] = _nan_checks(run, S)
                    row["cuda_graph_ok"] = _graph_check(run, q, k, v)
                ok_nan = all(v is True for v in row["nan_checks"].values())
                row["pass"] = bool(
                    row["rel_err_vs_fp32"] <= PASS_TOL and ok_nan and row["cuda_graph_ok"] is True
                )
                row["meets_12ms"] = row["ms_forward_60"] <= TARGET_MS_PER_FORWARD
            except Exception as e:  # noqa: BLE001 - report and go on with the next candidate
                row["error"] = f"{type(e).__name__}: {e}"
                row["pass"] = False
                traceback.print_exc()
            row["lib"] = lib() if callable(lib) else lib
            rows.append(row)
            _say(
                "result",
                **{
                    k2: (json.dumps(v2) if isinstance(v2, dict) else v2)
                    for k2, v2 in row.items()
                    if k2 not in ("bench", "gpu", "torch", "triton", "cudnn_torch")
                },
            )
            emit(row, "attention.jsonl", out_dir)
        torch.cuda.empty_cache()
    _print_micro(rows)
    base = {r["S"]: r.get("ms_layer") for r in rows if r["candidate"] == "cudnn-bf16"}
    fp8 = [r for r in rows if r["S"] == 4224 and r["candidate"] in ENGINE_OF and r.get("pass")]
    winner = min(fp8, key=lambda r: r["ms_layer"])["candidate"] if fp8 else None
    summary = {
        "bench": "attention_summary",
        **info,
        "winner": winner,
        "pass_tol": PASS_TOL,
        "cudnn_bf16_ms_layer": base,
        "fp8_engine_for_backend": ENGINE_OF.get(winner, "none"),
        "winner_ms_forward_60_4224": next(
            (r["ms_forward_60"] for r in fp8 if r["candidate"] == winner), None
        ),
        "winner_meets_12ms": next((r["meets_12ms"] for r in fp8 if r["candidate"] == winner), None),
    }
    _say(
        "summary",
        winner=winner,
        ms_forward_60=summary["winner_ms_forward_60_4224"],
        meets_12ms=summary["winner_meets_12ms"],
    )
    emit(summary, "attention.jsonl", out_dir)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "attn_winner.txt").write_text(ENGINE_OF.get(winner, "none") + "\n")
    return summary


def _print_micro(rows: list[dict]) -> None:
    print(
        f"\n{'S':>5} {'candidate':12}{'ms/layer':>9}{'kernel':>8}{'quant':>7}{'x60 ms':>8}{'TFLOP/s':>8}"
        f"{'err fp32':>9}{'err bf16':>9}{'sharp':>8}  NaN-free  graph  PASS"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['S']:>5} {r['candidate']:12} ERROR {r['error'][:160]}")
            continue
        nan_ok = all(v is True for v in r["nan_checks"].values())
        print(
            f"{r['S']:>5} {r['candidate']:12}{r['ms_layer']:>9.3f}{r.get('ms_kernel', math.nan):>8.3f}"
            f"{r.get('ms_quant', math.nan):>7.3f}{r['ms_forward_60']:>8.1f}{r['tflops']:>8.0f}"
            f"{r['rel_err_vs_fp32']:>9.1e}{r['rel_err_vs_cudnn_bf16']:>9.1e}{r['rel_err_sharp_vs_fp32']:>8.1e}"
            f"  {str(nan_ok):8}  {str(r['cuda_graph_ok'])[:5]:5}  {r['pass']}"
        )


# ------------------------------------------------------------------------------------ full forward


TILE_SIZES = {4224: "1024²", 16512: "2048²"}
TILES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages); 64 rows over 8 warps: wgmma's M is 64 per warp group.
    # BLOCK_N divides the K scale's 64-key block (one scale per key block)
    (bm, bn, w, st)
    for bm, bn, w, st in itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4))
    if not (bm == 64 and w == 8)
]


def tiles(out_dir: Path | None) -> dict:
    """The int8 kernel (quantisation excluded) per tile; a tile that fails to compile is a row with its
    error. Each tile must equal the default one up to fp32 summation order where its key block is the
    same (the key block moves where P is rounded)."""
    from ..kernels.attn_int8 import attention_int8_quantized, gpu_tile, quantize_int8_attention

    default, rows = gpu_tile(128), []
    for S, what in TILE_SIZES.items():
        q, k, v = _inputs(S, seed=S)
        exact = _exact(q, k, v)
        z = quantize_int8_attention(q, k, v)
        ref = attention_int8_quantized(z, q.dtype, config=default).clone()
        for tile in TILES:
            r = {"S": S, "size": what, "tile": list(tile), "default": tile == default}
            try:
                out = attention_int8_quantized(z, q.dtype, config=tile)
                r["rel_err_vs_default"] = float(f"{rel_err(out, ref):.2e}")
                r["rel_err_vs_fp32"] = float(f"{rel_err(out, exact):.2e}")
                r["ms"] = round(
                    median_ms(lambda t=tile: attention_int8_quantized(z, q.dtype, config=t), 5, 30), 4
                )
                r["tops"] = round(4 * S * S * 128 * 24 / r["ms"] / 1e9, 1)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a row, not the end
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
            print(
                f"{S:6d} {str(tile):18s} {r.get('ms', float('nan')):8.4f} ms {r.get('tops', 0):7.1f} TOP/s  "
                f"err(default) {r.get('rel_err_vs_default')}  err(fp32) {r.get('rel_err_vs_fp32')} "
                f"{r.get('error', '')}",
                flush=True,
            )
        torch.cuda.empty_cache()
    best = {}
    for S in TILE_SIZES:
        ok = [r for r in rows if r["S"] == S and "ms" in r]
        best[S] = min(ok, key=lambda r: r["ms"])["tile"] if ok else None
        print(f"fastest at {S}: {best[S]} (default {list(default)})")
    rec = {"bench": "attn_int8_tiles", **versions(), "default": list(default), "rows": rows, "best": best}
    emit(rec, "attention.jsonl", out_dir)
    return rec


def _profile_ms(fn) -> dict[str, float]:
    """Kernel ms by category for one call of fn (eager)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats = {"gemm": 0.0, "attention": 0.0, "fp8_quant": 0.0, "other": 0.0}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        n = e.key.lower()
        if any(s in n for s in ("_amax_kernel", "_quant_kernel", "_quant_int8_kernel", "_quant_v_kernel")):
            cats["fp8_quant"] += t
        elif any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn", "fprop", "_attn_int8")):
            cats["attention"] += t
        elif any(s in n for s in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "_mm")):
            cats["gemm"] += t
        else:
            cats["other"] += t
    return {k: round(v / 1e3, 2) for k, v in cats.items()}


def transformer(out_dir: Path | None, size: int = 1024, txt_len: int = 128) -> dict:
    from ..runtime.attention import use_attention
    from ..runtime.cuda_graphs import CudaGraphRunner
    from .transformer import _fp8_modules, _swap, build

    t0 = time.perf_counter()
    ours, _ = build(LAYERS, compare=False)
    _swap(ours, _fp8_modules(ours))  # FP8 block GEMMs: the FP8 forward (89.6 ms measured with bf16 attention)
    ours.fused = True
    print(f"built 60-layer model with FP8 block GEMMs in {time.perf_counter() - t0:.0f}s", flush=True)
    h = w = size // 16
    g = torch.Generator(device="cuda").manual_seed(size)
    x = torch.randn(1, h * w, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, txt_len, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([0.7], device="cuda")
    shapes = [(1, h, w)]
    res = {
        "bench": "attention_transformer",
        **versions(),
        "size": size,
        "tokens": h * w + txt_len,
        "rows": {},
    }
    outs = {}
    for backend in ("cudnn", "fp8"):
        row = {}
        try:
            with torch.no_grad(), use_attention(backend):
                graphs = CudaGraphRunner(ours)
                fn = lambda graphs=graphs: graphs(x, txt, None, t, shapes)  # noqa: E731
                outs[backend] = fn().clone()
                row["ms_forward_graph"] = round(median_ms(fn, 3, 10), 2)
                row["graph_enabled_after"] = bool(graphs.enabled)
                row["profile_eager_ms"] = _profile_ms(lambda: ours(x, txt, None, t, shapes))
                row["attention_ms_eager_incl_quant"] = round(
                    row["profile_eager_ms"]["attention"] + row["profile_eager_ms"]["fp8_quant"], 2
                )
                del graphs
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        res["rows"][backend] = row
        _say(
            "forward",
            backend=backend,
            **{k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()},
        )
        torch.cuda.empty_cache()
    if "cudnn" in outs and "fp8" in outs:
        res["rel_err_fp8_vs_cudnn_attention"] = float(f"{rel_err(outs['fp8'], outs['cudnn']):.3e}")
    from ..runtime.attention_fp8 import CALLS

    res["fp8_calls"] = dict(CALLS)
    _say("fp8_calls", **{repr(k): v for k, v in CALLS.items()})
    c, f = res["rows"].get("cudnn", {}), res["rows"].get("fp8", {})
    if "ms_forward_graph" in c and "ms_forward_graph" in f:
        res["saved_ms"] = round(c["ms_forward_graph"] - f["ms_forward_graph"], 2)
        res["fp8_forward_le_75ms"] = f["ms_forward_graph"] <= 75.0
        res["fp8_attention_le_12ms"] = f.get("attention_ms_eager_incl_quant", 1e9) <= TARGET_MS_PER_FORWARD
    print(
        f"\n1024² FP8-GEMM forward, CUDA graphs: cudnn {c.get('ms_forward_graph')} ms, fp8 {f.get('ms_forward_graph')} ms;"
        f" attention (eager profile, incl. quantisation): cudnn {c.get('attention_ms_eager_incl_quant')} ms,"
        f" fp8 {f.get('attention_ms_eager_incl_quant')} ms; rel err fp8 vs cudnn {res.get('rel_err_fp8_vs_cudnn_attention')}"
    )
    _say(
        "forward_summary",
        saved_ms=res.get("saved_ms"),
        fp8_forward_le_75ms=res.get("fp8_forward_le_75ms"),
        fp8_attention_le_12ms=res.get("fp8_attention_le_12ms"),
        rel_err=res.get("rel_err_fp8_vs_cudnn_attention"),
    )
    emit(res, "attention.jsonl", out_dir)
    return res


# ------------------------------------------------------------------------------------ quality gate

BF16_PATH = ("bf16 + kernels + graphs", torch.bfloat16, "triton", True, False, True, False)
FP8_PATH = ("fp8 + kernels + graphs", torch.bfloat16, "triton", True, False, True, True)


README_REF = {"demo-t2i": 92.5, "edit": 88.3}  # fp32 reference scores at n=120 (README quality-gate table)


def quality(out_dir: Path | None, model: str | None, n: int, device: str = "cuda") -> dict:
    """The gate at batch 1: bf16 and FP8 GEMMs with attention "fp8" first (what a timeout must not cut),
    then the fp32 reference (exact attention); gaps to the reference."""
    from ..demo.bench import PATHS, quality_paths
    from ..runtime.attention import use_attention
    from ..runtime.attention_fp8 import CALLS

    name = model or "demo-t2i"
    _say("quality_start", model=name, n=n, readme_fp32_reference=README_REF.get(name))
    with use_attention("fp8"):
        fp8_rows = quality_paths(model, n=n, device=device, batch=1, paths=(BF16_PATH, FP8_PATH))
    _say("fp8_calls", **{repr(k): v for k, v in CALLS.items()})  # which engine ran (or why bf16 did)
    for r in fp8_rows:
        r["attention"] = "fp8"
        _say(
            "quality_row",
            model=name,
            path=repr(r["path"]),
            attention="fp8",
            score=r.get("score"),
            skipped=repr(r.get("skipped")),
        )
    with use_attention("auto"):  # exact attention in fp32 (cuDNN has no fp32 kernel: "cudnn" would refuse)
        ref_rows = quality_paths(model, n=n, device=device, batch=1, paths=(PATHS[0],))
    ref = ref_rows[0].get("score")
    ref_rows[0]["attention"] = "auto (exact, fp32)"
    for r in fp8_rows:
        if "score" in r and ref is not None:
            r["gap"] = round(r["score"] - ref, 2)
    rows = ref_rows + fp8_rows
    worst = max((abs(r["gap"]) for r in fp8_rows if "gap" in r), default=None)
    rec = {
        "bench": "attention_quality",
        **versions(),
        "model": name,
        "n": n,
        "batch": 1,
        "rows": rows,
        "max_abs_gap_fp8_attention": worst,
        "gate_ok": worst is not None and worst <= 2.0,
        "fp8_calls": dict(CALLS),
    }
    if CALLS.get("int8"):  # the key block sets where P is rounded, so the gate's result: record the tile
        from ..kernels.attn_int8 import gpu_tile

        rec["int8_tile"] = list(gpu_tile(128))
    for r in rows:
        _say(
            "quality",
            model=name,
            path=repr(r["path"]),
            attention=r["attention"],
            score=r.get("score"),
            gap=r.get("gap"),
            skipped=repr(r.get("skipped")),
        )
    _say(
        "quality_summary", model=name, reference=ref, max_abs_gap_fp8_attention=worst, gate_ok=rec["gate_ok"]
    )
    emit(rec, "attention.jsonl", out_dir)
    return rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`qwenfast bench attention ...` and `python -m qwenfast.benchmarks.attention ...` take the same."""
    p.add_argument(
        "part",
        choices=["micro", "transformer", "tiles", "quality"],
        help="micro: kernels per layer; transformer: the 60-layer FP8 forward, cudnn vs fp8; "
        "tiles: the int8 kernel per tile; quality: the demo gate with fp8 attention",
    )
    p.add_argument("--results", default=None, metavar="DIR", help="append JSON lines to DIR/attention.jsonl")
    p.add_argument("--model", default=None, help="quality: demo model (default text-to-image; 'edit')")
    p.add_argument("--n", type=int, default=120, help="quality: suite items")
    p.add_argument("--device", default="cuda", help="quality: device (cpu: a dry run of the code path)")


def run_from_args(a: argparse.Namespace) -> int:
    out = Path(a.results) if a.results else None
    if a.part == "quality":
        quality(out, a.model, a.n, a.device)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    {"micro": micro, "transformer": transformer, "tiles": tiles}[a.part](out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m qwenfast.benchmarks.attention", description=__doc__.split("\n")[0]
    )
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
