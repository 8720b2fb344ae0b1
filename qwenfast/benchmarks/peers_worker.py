"""One engine of `qwenfast bench peers`, in its own process: build the shared random weights, time the
cases, print one JSON line per row (`PEERS_ROW {...}`) and save its outputs for the orchestrator.

Why a process per engine: a baseline must be what a user of that engine gets. Engines change process
state (torch.compile's caches and inductor settings, torchao's tensor subclasses, cache-dit's hooks on
diffusers' classes, qwenfast's attention switch); none of that can leak into another engine's row when
each runs alone. `python -m qwenfast.benchmarks.peers_worker ENGINE --case ... --out DIR`.

Same weights everywhere without a 60 GB file: every process draws them from one seed in the same order
(`build_diffusers`: diffusers' transformer, then its VAE, then transformers' Qwen2.5-VL-7B, all on the
GPU after `torch.manual_seed(0)`, exactly as `pipeline.build` does before converting them to
qwenfast's layout), and each row carries a fingerprint of its weights that the orchestrator compares.
The diffusers engines import nothing of qwenfast's runtime (only this module, `harness` and `about`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .harness import PROMPT, GiB, _call, _free, _peak, _reset_peak, _sync

# case name -> (kind, size, steps, cfg): "fwd" is one transformer forward (median of CUDA-event timings,
# mask None, 128 text tokens, t = 0.7); "e2e" a whole pipeline call (text encoder, denoise, VAE)
CASES = {
    "fwd:1024": ("fwd", 1024, 0, False),
    "fwd:1328": ("fwd", 1328, 0, False),
    "fwd:2048": ("fwd", 2048, 0, False),
    "e2e:1024:50:cfg": ("e2e", 1024, 50, True),
    "e2e:1024:4:nocfg": ("e2e", 1024, 4, False),
    "e2e:2048:4:nocfg": ("e2e", 2048, 4, False),
    "e2e:2512:2:nocfg": ("e2e", 2512, 2, False),
}
MAIN_CASES = ("fwd:1024", "fwd:1328", "fwd:2048", "e2e:1024:50:cfg", "e2e:1024:4:nocfg")  # the default run
HIGHRES_CASES = ("fwd:2048", "e2e:2048:4:nocfg", "e2e:2512:2:nocfg")  # `bench peers --highres`
DIFFUSERS_ENGINES = ("diffusers", "diffusers-torchao", "cache-dit")
# comfyui: `peers_comfyui` (forwards), comfyui-workflow: `peers_comfyui_e2e`; both need $QWENFAST_COMFYUI
ENGINES = (*DIFFUSERS_ENGINES, "comfyui", "comfyui-workflow", "qwenfast")
TXT_LEN = 128


# ------------------------------------------------------------------------------------------------ weights
def build_diffusers(smoke: bool = False) -> Any:
    """diffusers' QwenImagePipeline over random full-size weights drawn in `pipeline.build`'s order;
    `smoke`: the embedded demo model on the CPU in fp32 (checks the harness; times mean nothing)."""
    import diffusers
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ..about import DEMO_MODEL
    from .pipeline import QWEN25_VL_7B  # a plain dict (the module's heavy imports are lazy)

    if smoke:
        pipe = diffusers.QwenImagePipeline.from_pretrained(str(DEMO_MODEL), torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            tr = diffusers.QwenImageTransformer2DModel(num_layers=60).eval()
            vae = diffusers.AutoencoderKLQwenImage().eval().requires_grad_(False)
            te = (
                Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B))
                .eval()
                .requires_grad_(False)
            )
        finally:
            torch.set_default_dtype(torch.float32)
    tr.requires_grad_(False)
    sched_cfg = json.loads((Path(DEMO_MODEL) / "scheduler" / "scheduler_config.json").read_text())
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(sched_cfg)
    tok = AutoTokenizer.from_pretrained(str(Path(DEMO_MODEL) / "tokenizer"))
    pipe = diffusers.QwenImagePipeline(
        scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, transformer=tr
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fingerprint(transformer_blocks, vae: torch.nn.Module, te: torch.nn.Module) -> list[float]:
    """Sums of a few weights in float64: equal across processes iff the seeded draws were equal."""
    picks = [
        p for m in (transformer_blocks[0], transformer_blocks[-1], vae, te) for p in list(m.parameters())[:2]
    ]
    return [round(float(p.detach().double().sum()), 6) for p in picks]


# ------------------------------------------------------------------------------------------------ timing
def forward_inputs(
    size: int, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, txt_dim: int = 3584
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """The transformer bench's inputs for `size` (seeded by the size): x (1, L, 64), txt (1, 128, 3584), t.
    `device` / `dtype` / `txt_dim` other than the defaults: the demo model on the CPU (smoke)."""
    h = w = size // 16
    g = torch.Generator(device=device).manual_seed(size)
    x = torch.randn(1, h * w, 64, device=device, dtype=dtype, generator=g)
    txt = torch.randn(1, TXT_LEN, txt_dim, device=device, dtype=dtype, generator=g)
    return x, txt, torch.tensor([0.7], device=device), [(1, h, w)]


def time_forward(fn, warmup: int = 3, iters: int = 10) -> dict:
    """Median GPU ms (CUDA events) and median host ms to return from one call: near the GPU time when
    the engine is launch-bound (its figure then moves with the host CPU's speed) or when it waits on the
    GPU inside the call. Without a GPU (the smoke): one call, its wall time (the output is checked)."""
    with torch.no_grad():
        out = fn()
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            out = fn()
            return {"ms": round(1e3 * (time.perf_counter() - t0), 2), "out": out}
        for _ in range(warmup):
            fn()
        _sync()
        gpu, host = [], []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            fn()
            b.record()
            host.append(1e3 * (time.perf_counter() - t0))
            _sync()
            gpu.append(a.elapsed_time(b))
    return {"ms": round(statistics.median(gpu), 2), "host_ms": round(statistics.median(host), 1), "out": out}


def time_e2e(pipe, engine: str, size: int, steps: int, cfg: bool, counter=None, warm: bool = True) -> dict:
    """One warm-up call (2 steps, same shapes: compiles, captures graphs; `warm=False` skips it), then one
    timed call. `counter` (reset() / fraction()) gives the computed fraction of the timed call."""
    prompt = f"{PROMPT} ({size}:{steps}:{int(cfg)})"
    if warm:
        _call(pipe, engine, size, 2, cfg, prompt)
    if hasattr(getattr(pipe, "text_encoder", None), "clear_cache"):
        pipe.text_encoder.clear_cache()  # qwenfast caches prompt embeddings: time a real encode
    _free()
    _reset_peak()
    if counter is not None:
        counter.reset()
    _sync()
    t0 = time.perf_counter()
    img = _call(pipe, engine, size, steps, cfg, prompt)
    _sync()
    row = {"s": round(time.perf_counter() - t0, 3), "peak_gib": round(_peak() / GiB, 2), "out": img}
    if counter is not None:
        row["computed_fraction"] = counter.fraction()
    return row


class RunnerCounter:
    """qwenfast's computed fraction: its block runner's own count of full and cached forwards."""

    def __init__(self, runner):
        self.stats = runner.stats

    def reset(self) -> None:
        self.stats.update(full=0, cached=0)

    def fraction(self) -> float:
        return round(self.stats["full"] / max(1, self.stats["full"] + self.stats["cached"]), 3)


class BlockCounter:
    """Computed fraction of a diffusers transformer under a step cache: calls of its last block (which a
    cached step skips, with Bn = 0) over calls of the transformer. Forward pre-hooks, removed by close()."""

    def __init__(self, transformer: torch.nn.Module):
        self.n_fwd = self.n_last = 0
        self._hooks = [
            transformer.register_forward_pre_hook(lambda *_: self._add("n_fwd")),
            transformer.transformer_blocks[-1].register_forward_pre_hook(lambda *_: self._add("n_last")),
        ]

    def _add(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)

    def reset(self) -> None:
        self.n_fwd = self.n_last = 0

    def fraction(self) -> float:
        return round(self.n_last / max(1, self.n_fwd), 3)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


# ------------------------------------------------------------------------------------------------ engines
def _diffusers_forward(tr, size: int):
    x, txt, t, shapes = forward_inputs(size, tr.device, tr.dtype, tr.config.joint_attention_dim)
    return lambda: tr(
        hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=None, timestep=t,
        img_shapes=[shapes], return_dict=False,
    )[0]  # fmt: skip


def _shape(case: str, smoke: bool) -> tuple[str, int, int, bool]:
    """The case's (kind, size, steps, cfg); `smoke` shrinks it to 64² and at most 3 steps."""
    kind, size, steps, cfg = CASES[case]
    return (kind, 64, min(steps, 3), cfg) if smoke else (kind, size, steps, cfg)


def run_diffusers(engine: str, cases: list[str], emit, smoke: bool) -> None:
    """diffusers: eager, then + regional compile (compile after every eager row, same process);
    diffusers-torchao: torchao float8 dynamic (rowwise) + regional compile; cache-dit: its presets."""
    if smoke and engine == "diffusers-torchao":
        print("diffusers-torchao: float8 needs an FP8 GPU; nothing to check on the CPU", flush=True)
        return
    pipe = build_diffusers(smoke)
    tr = pipe.transformer
    fp = fingerprint(tr.transformer_blocks, pipe.vae, pipe.text_encoder)
    if engine == "cache-dit":
        return run_cache_dit(pipe, [c for c in cases if CASES[c][0] == "e2e"], emit, fp, smoke)
    variants = {
        "diffusers": [("diffusers eager", None), ("diffusers + regional compile", "compile")],
        "diffusers-torchao": [("diffusers + torchao float8 + regional compile", "torchao")],
    }[engine]
    for name, how in variants[: 1 if smoke else None]:
        if how == "compile":
            tr.compile_repeated_blocks(fullgraph=True)
        elif how == "torchao":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            quantize_(tr, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            tr.compile_repeated_blocks(fullgraph=True)
        for case in cases:
            kind, size, steps, cfg = _shape(case, smoke)
            t0 = time.perf_counter()
            if kind == "fwd":
                r = time_forward(_diffusers_forward(tr, size))
            else:
                r = time_e2e(pipe, "diffusers", size, steps, cfg)
            emit(name, case, r, fingerprint=fp, setup_s=round(time.perf_counter() - t0, 1))


def cache_dit_presets() -> dict[str, dict]:
    """cache-dit's documented settings (its examples' cache.yaml: DBCache F1B0, warm-up 8 steps every
    2nd, at most 2 cached in a row, threshold 0.12, TaylorSeer order 1), without and with TaylorSeer,
    and the same with its static "fast" step mask (what it runs when the adaptive test skips nothing)."""
    base = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=8, warmup_interval=2,
                max_cached_steps=-1, max_continuous_cached_steps=2, residual_diff_threshold=0.12)  # fmt: skip
    return {
        "diffusers + cache-dit DBCache (F1B0, R 0.12)": {"cache": base},
        "diffusers + cache-dit DBCache + TaylorSeer": {"cache": base, "taylorseer": 1},
        "diffusers + cache-dit fast step mask + TaylorSeer": {"cache": base, "taylorseer": 1, "mask": "fast"},
    }


def run_cache_dit(pipe, cases: list[str], emit, fp: list[float], smoke: bool) -> None:
    """cache-dit (PyPI `cache-dit`) on diffusers' pipeline: each preset enabled, timed, disabled. Its
    contexts are set for the call's step count, so there is no 2-step warm-up under the cache: one
    uncached 2-step call warms the GPU first."""
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    for case in cases:
        _, size, steps, cfg = _shape(case, smoke)
        _call(pipe, "diffusers", size, 2, cfg, PROMPT)
        for name, p in cache_dit_presets().items():
            kw = dict(p["cache"], num_inference_steps=steps)
            if "mask" in p and steps < 8 and steps not in (4, 6):
                continue  # cache-dit's predefined masks exist for 4, 6 and >= 8 steps
            if "mask" in p:
                kw["steps_computation_mask"] = cache_dit.steps_mask(mask_policy=p["mask"], total_steps=steps)
                kw["steps_computation_policy"] = "static"
            cal = TaylorSeerCalibratorConfig(taylorseer_order=p["taylorseer"]) if "taylorseer" in p else None
            cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(**kw), calibrator_config=cal)
            counter = BlockCounter(pipe.transformer)
            try:
                t0 = time.perf_counter()
                r = time_e2e(pipe, "diffusers", size, steps, cfg, counter=counter, warm=False)
                emit(name, case, r, fingerprint=fp, setup_s=round(time.perf_counter() - t0, 1))
            finally:
                counter.close()
                cache_dit.disable_cache(pipe)


def run_qwenfast(cases: list[str], emit, caches: list[str], smoke: bool) -> None:
    """qwenfast over the same weights (converted by `pipeline.build`): bf16, then FP8 (one-way), then FP8
    with 8-bit attention; the end-to-end cases also with each step-cache preset."""
    from .pipeline import build

    ours, ref = build(smoke, diffusers_transformer=True)
    ours.set_progress_bar_config(disable=True)
    fp = fingerprint(ref.transformer.transformer_blocks, ref.vae, ref.text_encoder)
    del ref  # ours shares its block weights; the rest (its unfused Q/K/V copies) goes
    _free()
    variants = [("qwenfast bf16", None), ("qwenfast FP8", "fp8"), ("qwenfast FP8 + 8-bit attention", "attn8")]
    if smoke:  # FP8 GEMMs need an FP8 GPU
        cases, variants = [c for c in cases if CASES[c][0] == "e2e"], variants[:1]
    for name, setup in variants:
        if setup == "fp8":
            ours.enable_fp8()
            _free()
        elif setup == "attn8":
            ours.configure(attention="fp8")
        for case in cases:
            kind, size, steps, cfg = _shape(case, smoke)
            t0 = time.perf_counter()
            if kind == "fwd":
                r = _qwenfast_forward(ours, size, "fp8" if setup == "attn8" else "auto")
                emit(name, case, r, fingerprint=fp, setup_s=round(time.perf_counter() - t0, 1))
                continue
            r = time_e2e(ours, "qwenfast", size, steps, cfg)
            emit(name, case, r, fingerprint=fp, setup_s=round(time.perf_counter() - t0, 1))
            for preset in caches if setup != "attn8" else ():
                ours.configure(cache=preset)
                t0 = time.perf_counter()
                r = time_e2e(ours, "qwenfast", size, steps, cfg, counter=RunnerCounter(ours.block_runner))
                emit(
                    f"{name} + {preset} cache",
                    case,
                    r,
                    fingerprint=fp,
                    setup_s=round(time.perf_counter() - t0, 1),
                )
                ours.configure(cache=None)


def _qwenfast_forward(ours, size: int, attention: str) -> dict:
    """What a denoising step runs: the fused blocks in a CUDA graph, modulation rows from the table."""
    from ..runtime.attention import use_attention
    from ..runtime.cuda_graphs import CudaGraphRunner
    from .transformer import _table_fwd

    x, txt, t, shapes = forward_inputs(size)
    with use_attention(attention):
        return time_forward(
            _table_fwd(ours.transformer, CudaGraphRunner(ours.transformer), x, txt, t, shapes)
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwenfast.benchmarks.peers_worker")
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("--case", action="append", choices=list(CASES), required=True)
    p.add_argument("--cache", action="append", default=[], help="qwenfast step-cache presets to add")
    p.add_argument("--out", required=True, help="folder for the outputs (.npy) the orchestrator compares")
    p.add_argument("--smoke", action="store_true", help="the demo model on the CPU (checks the harness)")
    a = p.parse_args(argv)
    sys.argv = sys.argv[:1]  # read: ComfyUI (the comfyui engines) parses the command line again, as its own
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def emit(name: str, case: str, r: dict, **extra: Any) -> None:
        arr = r.pop("out")
        arr = (
            arr.float().cpu().numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr, dtype=np.float32)
        )
        fname = re.sub(r"[^A-Za-z0-9]+", "_", f"{name}_{case}").strip("_") + ".npy"
        np.save(out / fname, arr)
        row = {"engine": a.engine, "row": name, "case": case, **r, **extra, "output": fname}
        print("PEERS_ROW " + json.dumps(row), flush=True)

    if a.engine == "qwenfast":
        run_qwenfast(a.case, emit, a.cache, a.smoke)
    elif a.engine in ("comfyui", "comfyui-workflow"):
        from .peers_comfyui import run_comfyui
        from .peers_comfyui_e2e import run_comfyui_e2e

        helpers = SimpleNamespace(
            CASES=CASES, PROMPT=PROMPT, build_diffusers=build_diffusers, fingerprint=fingerprint,
            forward_inputs=forward_inputs, time_forward=time_forward, shape=_shape, free=_free,
        )  # fmt: skip
        if a.engine == "comfyui":
            run_comfyui(a.case, emit, a.smoke, helpers)
        else:
            run_comfyui_e2e([c for c in a.case if CASES[c][0] == "e2e"], emit, a.smoke, helpers)
    else:
        run_diffusers(a.engine, a.case, emit, a.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
