"""Qwen-Image-2.1 transformer: qwenfast vs diffusers' `QwenImage21Transformer2DModel`, same random
full-size weights (32 layers x 4096), same run, one GPU.

Measures per forward at a 1024² target (4096 tokens) with a 128-token prompt: the prefill step
("extract", block-causal over the whole sequence) and the cached steps (target tokens against the
stored prefix, where 39 of 40 steps go), eager and replayed as a CUDA graph (what the pipeline
runs), bf16 and FP8; the relative error of our prefill and cached step against diffusers; and a
denoise loop of 40 and 4 steps (no CFG) built from those forwards. The Qwen3-VL text encoder (8B)
is not loaded: random prompt embeddings stand in (its cost is one encode per call).

The oracle is diffusers' model as `from_pretrained(torch_dtype=bf16)` holds it
(`testing.tiny21.diffusers_transformer21`). `rel_err_old_oracle` repeats the comparison against the
oracle this benchmark used before, `model.to(bf16)`, whose timestep frequencies are rounded to bf16
(diffusers' loader keeps them fp32): that was the "0.12".

    python -m qwenfast.benchmarks.transformer21 [--size 1024] [--out results.jsonl] [--profile]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t) / iters * 1000


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(f"{((got - want).norm() / want.norm()).item():.3e}")


def _profile(fn, label: str, top: int = 12) -> None:
    """Print the CUDA kernels of one call of `fn`, by total time: where the cached step goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {label}: top CUDA kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70))


def _diffusers_compiled(ref, ref_fwd, rc, want) -> dict:
    """diffusers' own regional compile of its 2.1 model (`compile_repeated_blocks`, fullgraph where it
    compiles, else with graph breaks): prefill and cached-step ms, rel. err vs its eager output."""
    import torch._dynamo

    for fullgraph in (True, False):
        torch._dynamo.reset()
        try:
            ref.compile_repeated_blocks(fullgraph=fullgraph)
            with torch.no_grad():
                t0 = time.perf_counter()
                got = ref_fwd(rc, "cached").float()
                _sync()
                setup = time.perf_counter() - t0
                return {
                    "diffusers_compile_fullgraph": fullgraph,
                    "diffusers_compile_setup_s": round(setup, 1),
                    "diffusers_compile_prefill_ms": round(_time(lambda: ref_fwd()), 2),
                    "diffusers_compile_cached_ms": round(_time(lambda: ref_fwd(rc, "cached")), 2),
                    "diffusers_compile_rel_err": _rel(got, want),
                }
        except Exception as e:  # noqa: BLE001 - the record says what happened
            err = f"{type(e).__name__}: {e}"[:300]
    return {"diffusers_compile_error": err}


def setup(size: int, text: int, layers: int, dev: torch.device):
    """diffusers' full-width 2.1 transformer (random weights, bf16) and ours loaded from it, the inputs of
    one forward at size² with `text` prompt tokens, and diffusers' forward on them:
    -> (ref, ours, (x, emb, t, img_shapes, vl), ref_fwd(cache=None, mode=None) -> its target tokens)."""
    from ..loading.folder21 import Fuser21
    from ..loading.weights import load_streaming
    from ..models.transformer21 import QwenImage21Transformer, Transformer21Config
    from ..testing.tiny21 import diffusers_transformer21

    dt = torch.bfloat16
    ref = diffusers_transformer21(dtype=dt, device=dev, seed=0, num_layers=layers)
    with torch.device("meta"):
        ours = QwenImage21Transformer(Transformer21Config(num_layers=layers))
    items = ((k, v.detach().clone(), Path("memory")) for k, v in ref.state_dict().items())
    ours = load_streaming(ours, items, dtype=dt, where="memory", convert=Fuser21())
    h = w = size // 16
    N = h * w
    g = torch.Generator(dev).manual_seed(1)
    emb = torch.randn(1, text, 4096, device=dev, dtype=dt, generator=g)
    x = torch.randn(1, N, 64, device=dev, dtype=dt, generator=g)
    t = torch.full((1,), 0.5, device=dev, dtype=dt)
    vl = torch.cat(
        [torch.zeros(text, dtype=torch.bool), torch.ones(N // 4, dtype=torch.bool)]
    )  # host-side layout
    shapes = [(1, h, w)]

    def ref_fwd(cache=None, mode=None):
        return ref(
            hidden_states=x,
            encoder_hidden_states=emb,
            timestep=t,
            img_shapes=[shapes],
            img_mask=vl.to(dev)[None],
            kv_cache=cache,
            kv_cache_mode=mode,
            return_dict=False,
        )[0][:, -N:]

    return ref, ours, (x, emb, t, shapes, vl), ref_fwd


def main(argv=None) -> list[dict]:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from ..models.transformer21 import PrefixKVCache
    from ..runtime.cuda_graphs import CudaGraphRunner

    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of a cached step")
    p.add_argument("--layers", type=int, default=32, help="fewer for a smoke run")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also diffusers' regional compile (compile_repeated_blocks) of its model, timed last",
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (timings meaningless)")
    a = p.parse_args(argv)
    dev, dt = torch.device(a.device), torch.bfloat16
    ref, ours, (x, emb, t, shapes, vl), ref_fwd = setup(a.size, a.text, a.layers, dev)
    cfg, N = ours.cfg, x.shape[1]
    rows: list[dict] = []

    with torch.no_grad():
        rc = QwenImage21KVCache(cfg.num_layers)
        want_pre = ref_fwd(rc, "extract").float()
        want = ref_fwd(rc, "cached").float()
        ref_prefill = _time(lambda: ref_fwd())
        ref_cached = _time(lambda: ref_fwd(rc, "cached"))
        freqs = ref.time_text_embed.time_proj.freqs
        ref.time_text_embed.time_proj.freqs = freqs.to(dt)  # what `model.to(bf16)` did to the oracle
        old_oracle = ref_fwd(rc, "cached").float()
        ref.time_text_embed.time_proj.freqs = freqs
        # the bf16 noise floor: diffusers' own bf16 output against the same weights run in fp32
        import copy

        ref32 = copy.deepcopy(ref).float()
        rc32 = QwenImage21KVCache(cfg.num_layers)
        kw32 = dict(
            hidden_states=x.float(),
            encoder_hidden_states=emb.float(),
            timestep=t.float(),
            img_shapes=[shapes],
            img_mask=vl.to(dev)[None],
            return_dict=False,
        )
        ref32(**kw32, kv_cache=rc32, kv_cache_mode="extract")
        want32 = ref32(**kw32, kv_cache=rc32, kv_cache_mode="cached")[0][:, -N:].float()
        del ref32, rc32
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        graphs = CudaGraphRunner(ours)
        for label, fp8 in (("bf16", False), ("fp8", True)):
            if fp8:
                from ..kernels.fp8_linear import quantize_model

                quantize_model(ours)
                graphs.clear()
            oc = PrefixKVCache(cfg.num_layers)  # static: the graph reads these buffers
            got_pre = ours(x, emb, None, t, shapes, vl, oc, "extract").float()

            def cached(x, t, oc=oc):
                return ours(x, emb, None, t, shapes, vl, oc, "cached")

            def graphed(oc=oc, cached=cached):
                return graphs.run(("cached", label), cached, x, t)

            pre = _time(lambda oc=oc: ours(x, emb, None, t, shapes, vl, oc, "extract"))
            eager = _time(lambda: cached(x, t))
            replay = _time(graphed)
            got = graphed().float()
            ours.fused = False
            got_ref_path = cached(x, t).float()  # the torch reference blocks
            ours.fused = True
            if a.profile:
                _profile(lambda cached=cached: cached(x, t), f"ours cached step, {label}")
                if not fp8:
                    _profile(lambda: ref_fwd(rc, "cached"), "diffusers cached step, bf16")
            for steps in (40, 4):
                loop_ref = ref_prefill + (steps - 1) * ref_cached
                loop = pre + (steps - 1) * replay
                rows.append(
                    {
                        "what": "qwen-image-2.1 transformer",
                        "size": a.size,
                        "dtype": label,
                        "steps": steps,
                        "diffusers_prefill_ms": round(ref_prefill, 2),
                        "diffusers_cached_ms": round(ref_cached, 2),
                        "ours_prefill_ms": round(pre, 2),
                        "ours_cached_eager_ms": round(eager, 2),
                        "ours_cached_graph_ms": round(replay, 2),
                        "rel_err_prefill": _rel(got_pre, want_pre),
                        "rel_err_cached": _rel(got, want),
                        "rel_err_cached_reference_blocks": _rel(got_ref_path, want),
                        "rel_err_old_oracle": _rel(got, old_oracle),
                        "rel_err_diffusers_bf16_vs_fp32": _rel(want, want32),
                        "rel_err_ours_vs_fp32": _rel(got, want32),
                        "diffusers_loop_s": round(loop_ref / 1000, 3),
                        "ours_loop_s": round(loop / 1000, 3),
                        "speedup_loop": round(loop_ref / loop, 3),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
                        if dev.type == "cuda"
                        else None,
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    }
                )
            del oc
            graphs.clear()
    if a.compile and dev.type == "cuda":
        comp = _diffusers_compiled(ref, ref_fwd, rc, want)
        for r in rows:
            r.update(comp)
            if "diffusers_compile_cached_ms" in comp:
                r["speedup_cached_vs_diffusers_compile"] = round(
                    comp["diffusers_compile_cached_ms"] / r["ours_cached_graph_ms"], 3
                )
        print(f"diffusers regional compile: {comp}")
    print(
        f"{'dtype':>5} {'steps':>5} {'ref pre':>8} {'ref cached':>10} {'ours pre':>8} {'eager':>7} {'graph':>7} "
        f"{'err pre':>8} {'err cached':>10} {'err old':>8} {'loop x':>6}"
    )
    for r in rows:
        print(
            f"{r['dtype']:>5} {r['steps']:>5} {r['diffusers_prefill_ms']:>8} {r['diffusers_cached_ms']:>10} "
            f"{r['ours_prefill_ms']:>8} {r['ours_cached_eager_ms']:>7} {r['ours_cached_graph_ms']:>7} "
            f"{r['rel_err_prefill']:>8.1e} {r['rel_err_cached']:>10.1e} {r['rel_err_old_oracle']:>8.1e} "
            f"{r['speedup_loop']:>6}"
        )
    from . import emit_lines

    emit_lines(rows, a.out or None)
    return rows


if __name__ == "__main__":
    main()
