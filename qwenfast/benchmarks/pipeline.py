"""`qwenfast bench pipeline`: end to end vs diffusers' QwenImagePipeline, same weights; VAE, memory, offload.

Full size (GPU): diffusers builds a random 60-layer transformer and a random VAE, transformers a
random Qwen2.5-VL-7B (released config), and qwenfast runs the SAME tensors (transformer storage
shared, VAE converted, text encoder the same object), so both engines compute the same thing. The
tokenizer is the embedded tiny one (tokenisation cost is negligible; ids fit the 7B vocabulary).
`--smoke`: the embedded tiny model on the CPU (checks the harness, times mean nothing).

Stages (flags; each prints one JSON line, and with `--results DIR` appends it to DIR/pipeline.jsonl):
- default: cases "1024:50:cfg", "1328:50:cfg", "1024:4:nocfg": per engine a warm-up call (2 steps,
  same shapes: captures CUDA graphs), then one timed call with fresh prompts (qwenfast caches prompt
  embeddings) and per-stage times (text encode, denoise, VAE decode: CUDA-synchronised wrappers),
  peak memory, and the mean |difference| of the two engines' images.
- `--vae`: decode/encode ms (median of 5, CUDA events) ours fast / ours reference / diffusers at
  1024² and 1328², rel. error vs diffusers; decode at 2512² (auto tiling) with peak memory.
- `--memory`: planner calibration: per-phase peaks of our pipeline over sizes x batches, fitted
  coefficients, prediction error (goal <= 10% of measured peak); DIR/memory_calibration.json with --results.
- `--offload`: forced OOM recovery (a memory fraction that fits one image, a batch of 4 asked for:
  must split and equal the unsplit images), then offload "model" and "blocks" (peaks, times), and
  "blocks" under `set_per_process_memory_fraction` = 24 GiB and 8 GiB. Runs last: it moves weights to the host.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import RESULTS_HELP, results_dir, save_record, stamp
from .harness import PROMPT, GiB, StageTimer, _call, _device_name, _free, _peak, _reset_peak, _sync

if TYPE_CHECKING:
    from ..pipeline.text_to_image import QwenImagePipeline

CASES = {"1024:50:cfg": (1024, 50, True), "1328:50:cfg": (1328, 50, True), "1024:4:nocfg": (1024, 4, False)}
# a case of a few steps takes ~0.4-0.9 s, where one call varies by ~10 ms (H200): its total is the median
# of this many calls, without the stage timers (they synchronise around the prompt encode and the decode,
# which would hide their overlap with the host's own work); a further call gives the stages
SHORT_RUNS = 5

QWEN25_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct config.json (sizes), transformers-5 layout
    "model_type": "qwen2_5_vl", "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                    "hidden_act": "silu", "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "type": "mrope", "mrope_section": [16, 24, 24],
                                        "rope_theta": 1000000.0}},
    "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "in_channels": 3, "hidden_act": "silu"},
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ build
def build(
    smoke: bool,
    dtype: torch.dtype = torch.bfloat16,
    diffusers_transformer: bool = True,
    zero_cond_t: bool = False,
) -> tuple[QwenImagePipeline, Any]:  # Any: a diffusers pipeline or SimpleNamespace(vae=...)
    """(qwenfast pipeline, diffusers pipeline), same weights.

    `diffusers_transformer=False` (stages that never run diffusers' transformer: VAE, memory, offload)
    builds only ours, so the GPU memory looks as it does for a user: no diffusers-only tensors whose
    freed holes would blur the memory measurements. The returned "pipeline" then only has `.vae`.
    `zero_cond_t`: both transformers with Edit-2511's flag (reference tokens modulated with t=0; the
    same weights, and the same images for a single image stream).
    """
    import diffusers

    from ..config import QWEN_IMAGE_SCHEDULER, VAEConfig
    from ..models.text_encoder import TextEncoder
    from ..models.vae import QwenImageVAE, convert_vae_state_dict
    from ..pipeline.text_to_image import DEFAULT_MODEL, QwenImagePipeline

    if smoke:
        ours = QwenImagePipeline.from_pretrained(None, device="cpu", dtype=torch.float32)
        ref = diffusers.QwenImagePipeline.from_pretrained(str(DEFAULT_MODEL), torch_dtype=torch.float32)
        ref.text_encoder = ours.text_encoder.model  # one text encoder for both, as at full size
        if zero_cond_t:  # the demo's weights in transformers built with the flag
            import dataclasses

            from ..models.transformer import QwenImageTransformer

            tr = QwenImageTransformer(dataclasses.replace(ours.transformer.cfg, zero_cond_t=True))
            tr.load_state_dict(ours.transformer.state_dict())
            ours = QwenImagePipeline(
                tr.eval().requires_grad_(False),
                ours.vae,
                ours.text_encoder,
                ours.scheduler_config,
                model_path=ours.model_path,
            )
            rt = diffusers.QwenImageTransformer2DModel.from_config(
                {**ref.transformer.config, "zero_cond_t": True}
            )
            rt.load_state_dict(ref.transformer.state_dict())
            ref.transformer = rt.eval().requires_grad_(False)
        return ours, ref
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .transformer import build as build_transformer

    dev = torch.device("cuda")
    tr, ref_tr = build_transformer(60, compare=diffusers_transformer, dtype=dtype, zero_cond_t=zero_cond_t)
    with torch.device(dev):
        torch.set_default_dtype(dtype)
        try:
            ref_vae = diffusers.AutoencoderKLQwenImage().eval().requires_grad_(False)
            te_model = (
                Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B))
                .eval()
                .requires_grad_(False)
            )
        finally:
            torch.set_default_dtype(torch.float32)
    vae = QwenImageVAE(VAEConfig.from_dict(dict(ref_vae.config))).to(dev, dtype).eval().requires_grad_(False)
    vae.load_state_dict(convert_vae_state_dict(ref_vae.state_dict()), strict=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL / "tokenizer"))
    ours = QwenImagePipeline(
        tr, vae, TextEncoder(te_model, tok), QWEN_IMAGE_SCHEDULER, model_path="random full size"
    )
    sched_cfg = json.loads((DEFAULT_MODEL / "scheduler" / "scheduler_config.json").read_text())
    sched_cfg.update({k: v for k, v in vars(QWEN_IMAGE_SCHEDULER).items() if not k.startswith("_")})
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(sched_cfg)
    if ref_tr is None:
        return ours, SimpleNamespace(vae=ref_vae)
    ref = diffusers.QwenImagePipeline(
        scheduler=sched, vae=ref_vae, text_encoder=te_model, tokenizer=tok, transformer=ref_tr
    )
    return ours, ref


# ------------------------------------------------------------------------------------------------ stages
def end_to_end(
    ours: QwenImagePipeline,
    ref: Any,  # a diffusers QwenImagePipeline, or None
    cases: Iterable[str],
    smoke: bool,
    keep: dict | None = None,
    against: dict | None = None,
    keep_ours: dict | None = None,
) -> dict:
    """Timed cases. `keep` receives diffusers' images per case; `against` (such a dict, when `ref` is
    None) gives the images to compare with and the times to divide by."""
    res = {}
    for name in cases:
        size, steps, cfg = CASES[name]
        if smoke:
            size, steps = 64, min(steps, 2)
        row, images = {}, {}
        for engine, pipe in (("diffusers", ref), ("qwenfast", ours)):
            if pipe is None:
                continue
            timer = StageTimer()
            if engine == "diffusers":
                timer.wrap(pipe, "encode_prompt", "text_encode_s")
            else:  # ours: the text encoder's own call (the pipeline object is never patched)
                timer.wrap(pipe.text_encoder, "encode", "text_encode_s")
            timer.wrap(pipe.vae, "decode", "vae_decode_s")
            runs = []
            try:
                # warm-up with the timed prompt: same shapes, so CUDA graphs are captured here, as in
                # a running service (diffusers gets the same warm-up)
                _call(pipe, engine, size, 2, cfg, f"{PROMPT} ({name})")
                timer.restore()  # short cases: the total is the median of untimed calls (below)
                for _ in range(_short_runs(steps, smoke)):
                    runs.append(_timed_call(pipe, engine, size, steps, cfg, f"{PROMPT} ({name})")[0])
                timer.rewrap()
                timer.reset()
                _reset_peak()
                total, images[engine] = _timed_call(pipe, engine, size, steps, cfg, f"{PROMPT} ({name})")
            finally:
                timer.restore()
            st = {k: round(v, 3) for k, v in timer.t.items()}
            st["denoise_s"] = round(total - sum(timer.t.values()), 3)
            row[engine] = {"total_s": round(float(np.median(runs)) if runs else total, 3), **st}
            if runs:  # the staged call's stages; its total waits at each stage's sync: not the total
                row[engine].update(runs_s=[round(r, 4) for r in runs], staged_total_s=round(total, 3))
            row[engine]["peak_gib"] = round(_peak() / GiB, 2)
            print(f"  {name:14s} {engine:10s} {json.dumps(row[engine])}", flush=True)
        if keep_ours is not None:
            keep_ours[name] = (images["qwenfast"], row["qwenfast"]["total_s"])
        if "diffusers" in images and keep is not None:
            keep[name] = (images["diffusers"], row["diffusers"]["total_s"])
        if "diffusers" not in images and against is not None and name in against:
            images["diffusers"], t_ref = against[name]
            row["diffusers_total_s_same_run"] = t_ref
            row["speedup"] = round(t_ref / row["qwenfast"]["total_s"], 2)
        elif "diffusers" in images:
            row["speedup"] = round(row["diffusers"]["total_s"] / row["qwenfast"]["total_s"], 2)
        if "diffusers" in images:
            row["mean_abs_diff_images"] = float(
                f"{np.abs(images['diffusers'] - images['qwenfast']).mean():.3e}"
            )
        res[name] = row
    return res


def _short_runs(steps: int, smoke: bool) -> int:
    """Untimed-stage calls whose median is a short case's total (the smoke run: 2, to run the path)."""
    return (2 if smoke else SHORT_RUNS) if steps <= 8 else 0


def _timed_call(pipe, engine: str, size: int, steps: int, cfg: bool, prompt: str) -> tuple[float, Any]:
    """(seconds, images) of one call, synchronised, with a real prompt encode (ours caches prompts)."""
    if engine == "qwenfast":
        pipe.text_encoder.clear_cache()
    _free()
    _sync()
    t0 = time.perf_counter()
    images = _call(pipe, engine, size, steps, cfg, prompt)
    _sync()
    return time.perf_counter() - t0, images


def cache_rows(ours, cases, smoke: bool, cache: str, uncached: dict, diffusers: dict) -> dict:
    """The end-to-end cases again with a step-cache policy: time, computed fraction, image difference
    vs our uncached image of the same run, and the cost of one cached forward vs a full one."""
    from ..runtime.cache import CachePolicy

    res = {}
    ours.configure(cache=cache)
    for name in cases:
        size, steps, cfg = CASES[name]
        if smoke:
            size, steps = 64, min(steps, 6)
        _call(ours, "qwenfast", size, steps, cfg, f"{PROMPT} ({name})")  # warm-up: every variant's graph
        stats = ours.block_runner.stats
        runs = []
        for _ in range(max(1, _short_runs(steps, smoke))):
            stats.update(full=0, cached=0)
            t, img = _timed_call(ours, "qwenfast", size, steps, cfg, f"{PROMPT} ({name})")
            runs.append(t)
        row = {
            "total_s": round(float(np.median(runs)), 3),
            "computed_fraction": round(stats["full"] / max(1, stats["full"] + stats["cached"]), 3),
        }
        if len(runs) > 1:
            row["runs_s"] = [round(r, 4) for r in runs]
        if name in uncached:
            row["uncached_s"] = uncached[name][1]
            row["speedup_vs_uncached"] = round(uncached[name][1] / row["total_s"], 2)
            row["mean_abs_diff_vs_uncached"] = float(f"{np.abs(img - uncached[name][0]).mean():.3e}")
        if name in diffusers:
            row["speedup_vs_diffusers"] = round(diffusers[name][1] / row["total_s"], 2)
        res[name] = row
        print(f"  {name:14s} cache={cache:<8s} {json.dumps(row)}", flush=True)
    # one cached forward vs one full forward (denoise only): N steps with every step but the first
    # cached, against N full steps
    size, n = (64, 6) if smoke else (1024, 20)
    policy = CachePolicy(
        kind="static",
        first=ours.block_runner.policy.first,
        last=ours.block_runner.policy.last,
        warmup=1,
        tail=0,
        every=10**6,
    )
    times = {}
    for label, c in (("full", None), ("cached", policy)):
        ours.configure(cache=c)
        _call(ours, "qwenfast", size, n, False, PROMPT, seed=1)
        _sync()
        t0 = time.perf_counter()
        _call(ours, "qwenfast", size, n, False, PROMPT, seed=1)
        _sync()
        times[label] = time.perf_counter() - t0
    per_full = times["full"] / n
    per_cached = (times["cached"] - per_full) / (n - 1)
    blocks = len(ours.transformer.transformer_blocks)
    res["cached_step"] = {
        "size": size,
        "full_forward_ms": round(1e3 * per_full, 2),
        "cached_forward_ms": round(1e3 * per_cached, 2),
        "ratio": round(per_cached / per_full, 4),
        "bound": round((policy.first + policy.last) / blocks * 1.1, 4),
    }
    print(f"  cached step: {json.dumps(res['cached_step'])}", flush=True)
    ours.configure(cache=None)
    return res


def run(
    cases: Iterable[str] = tuple(CASES),
    smoke: bool = False,
    vae: bool = False,
    memory: bool = False,
    offload: bool = False,
    e2e: bool = True,
    out_dir: Path | None = None,
    fp8: bool = False,
    cache: str | None = None,
) -> dict:
    t0 = time.perf_counter()
    ours, ref = build(smoke, diffusers_transformer=e2e or smoke)
    if hasattr(ref, "set_progress_bar_config"):
        ref.set_progress_bar_config(disable=True)
    ours.set_progress_bar_config(disable=True)
    from . import versions

    record = {
        "bench": "pipeline",
        "device": _device_name(),
        "torch": torch.__version__,
        "triton": versions()["triton"],
        "smoke": smoke,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    print(f"built in {record['build_s']} s on {record['device']}", flush=True)
    out_dir = None if out_dir is None else Path(out_dir)

    def save(key: str, value: Any) -> None:
        record[key] = value
        if out_dir is not None:  # the whole record is printed at the end either way
            line = {k: record[k] for k in ("bench", "device", "torch", "triton", "smoke")} | {key: value}
            save_record(line, out_dir / "pipeline.jsonl")

    kept: dict = {}
    ours_kept: dict = {}
    if e2e:
        save("end_to_end", end_to_end(ours, ref, cases, smoke, keep=kept, keep_ours=ours_kept))
        if cache:
            save(f"end_to_end_cache_{cache}", cache_rows(ours, cases, smoke, cache, ours_kept, kept))
    if fp8 and e2e:  # qwenfast again with FP8 block GEMMs (irreversible for `ours`, so after the bf16 rows)
        # diffusers goes first (its VAE stays for the VAE rows): it shares our bf16 block weights, so
        # with it alive FP8 would add its weights to theirs instead of replacing ours
        ref = SimpleNamespace(vae=ref.vae)
        _free()
        ours.enable_fp8()
        _free()
        fp8_kept: dict = {}
        save("end_to_end_fp8", end_to_end(ours, None, cases, smoke, against=kept, keep_ours=fp8_kept))
        if cache:
            save(f"end_to_end_fp8_cache_{cache}", cache_rows(ours, cases, smoke, cache, fp8_kept, kept))
    from .pipeline_stages import memory_calibration, offload_bench, vae_bench

    if vae:
        save("vae", vae_bench(ours, ref, smoke))
    # Drop diffusers: it shares our GPU weights but also holds its own unfused Q/K/V copies (6.3 GiB at
    # full size), which would count as our base memory, and it would keep the weights on the GPU after
    # offloading moves ours to the host.
    del ref
    _free()
    if memory:
        save("memory", memory_calibration(ours, smoke, out_dir))
    if offload:
        save("offload", offload_bench(ours, smoke))
    record = stamp(record)
    print(json.dumps(record))
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case", action="append", choices=list(CASES), help="end-to-end cases (default: all three)"
    )
    p.add_argument("--smoke", action="store_true", help="embedded tiny model on the CPU (checks the harness)")
    p.add_argument("--vae", action="store_true", help="also VAE decode/encode timings and the 2512² decode")
    p.add_argument("--memory", action="store_true", help="also calibrate/check the memory planner")
    p.add_argument("--offload", action="store_true", help="also forced-OOM recovery and offload modes (last)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end cases")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="repeat the end-to-end cases with qwenfast's FP8 GEMMs (with --task: one task, its row again in FP8)",
    )
    p.add_argument(
        "--cache",
        default=None,
        choices=["balanced", "fast"],
        help="also the end-to-end cases with this step-cache preset (bf16, and FP8 with --fp8)",
    )
    p.add_argument("--results", default=None, metavar="DIR", help=RESULTS_HELP)
    p.add_argument(
        "--task",
        action="append",
        choices=["img2img", "inpaint", "edit-inpaint", "edit-2511"],
        help="instead: one row per task vs diffusers' pipeline of that task (benchmarks/tasks_inpaint.py, run by the CLI)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="with --task: steps of the timed call (default 30)"
    )
    p.add_argument(
        "--size",
        type=int,
        default=None,
        help="with --model-type 2.1: the image's side in pixels (default 1024; 2.1's own code defaults to 2048); "
        "with --task: the input and output side (default 1024)",
    )
    p.add_argument(
        "--model-type",
        choices=["qwen-image", "2.1"],
        default="qwen-image",
        help="2.1: Qwen-Image-2.1 end to end vs diffusers' QwenImage21Pipeline (40 steps, step cache "
        "presets, turbo-4; --fp8 adds FP8 rows; --steps; records to DIR/qwenimage21.jsonl)",
    )


def run_from_args(a: argparse.Namespace) -> int:
    run(
        cases=tuple(a.case or CASES),
        smoke=a.smoke,
        vae=a.vae,
        memory=a.memory,
        offload=a.offload,
        e2e=not a.no_e2e,
        out_dir=results_dir(a.results),
        fp8=a.fp8,
        cache=a.cache,
    )
    return 0
