"""Qwen-Image-2.1 end to end on one GPU, full size, random weights: our pipeline with the step cache
off / "balanced" / "fast" (1024², 40 steps, no CFG: 2.1's defaults), and the 4-step turbo schedule
against diffusers' `QwenImage21Pipeline` holding the same weights, same run.

Both pipelines share one random text encoder (a transformers `Qwen3VLForConditionalGeneration`:
the full-size 8B shape by default, `--text-encoder tiny` for a 2-layer one) and the offline test
tokenizer (a short vocabulary: the embedding table is small, the 36 layers are the 8B's); the
transformer is diffusers' full-size `QwenImage21Transformer2DModel` with random variance-preserving
weights, ours loaded from its state dict; the VAE is diffusers' full-size `AutoencoderKLQwenImage21`
(random), ours loaded from its saved folder. Reported: seconds per image (median), and each
image's mean |Δ| (RGBA in [0, 1]) against our uncached image (the step cache's cost) or against
diffusers' image (turbo).

    python -m qwenfast.benchmarks.pipeline21 [--size 1024] [--steps 40] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "a lighthouse on a cliff at dusk, waves below, warm light in the windows"


def full_text_encoder_config(tokenizer) -> dict:
    """Qwen3-VL 8B's shape (36 x 4096 text layers, 27-block vision tower), the tokenizer's ids."""
    from ..testing.tiny21 import text_encoder_config

    cfg = text_encoder_config(tokenizer)
    cfg["text_config"].update(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        initializer_range=0.02,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    )
    cfg["vision_config"].update(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
        initializer_range=0.02,
    )
    return cfg


def build(dev: torch.device, dt: torch.dtype, text_encoder: str, tmp: Path, layers: int = 32):
    """(diffusers pipeline, our pipeline, what text encoder) sharing the random weights."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
    from diffusers import QwenImage21Pipeline as RefPipeline
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ..loading.diffusers_folder import load_scheduler_config
    from ..loading.folder21 import Fuser21, load_vae21
    from ..loading.weights import load_streaming
    from ..models.text_encoder21 import TextEncoder21
    from ..models.transformer21 import QwenImage21Transformer, Transformer21Config
    from ..pipeline.pipeline21 import QwenImage21Pipeline
    from ..testing.tiny import build_tokenizer
    from ..testing.tiny21 import (
        SCHEDULER_CONFIG,
        build_processor,
        build_text_encoder,
        diffusers_transformer21,
    )

    tok = build_tokenizer()
    processor = build_processor(tok)
    what = text_encoder
    te = None
    if text_encoder == "full":
        try:
            torch.manual_seed(0)
            with torch.device(dev):
                te = (
                    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**full_text_encoder_config(tok)))
                    .to(dt)
                    .eval()
                )
            what = f"random Qwen3-VL 8B shape ({sum(p.numel() for p in te.parameters()) / 1e9:.2f} B params)"
        except Exception as e:  # noqa: BLE001 - fall back, and say so in the results
            print(f"full-size text encoder failed ({e}); using the tiny one")
            te, what = None, "tiny (full-size failed)"
    if te is None:
        te = build_text_encoder(tok, seed=0, hidden_size=4096).to(dev, dt).eval()  # 2 layers, 4096 wide
        what = what if what != "full" else "tiny"
    te.requires_grad_(False)
    gen = torch.Generator().manual_seed(7)
    vae = AutoencoderKLQwenImage21(
        latents_mean=(torch.randn(64, generator=gen) * 0.5).tolist(),
        latents_std=(0.5 + torch.rand(64, generator=gen)).tolist(),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    vae.save_pretrained(tmp / "vae")
    scheduler.save_pretrained(tmp / "scheduler")
    vae = vae.to(dev, dt).eval()
    ref_tr = diffusers_transformer21(dtype=dt, device=dev, seed=0, num_layers=layers)
    ref = RefPipeline(scheduler=scheduler, vae=vae, text_encoder=te, processor=processor, transformer=ref_tr)
    ref.set_progress_bar_config(disable=True)
    with torch.device("meta"):
        tr = QwenImage21Transformer(Transformer21Config(num_layers=layers))
    items = ((k, v.detach().clone(), Path("memory")) for k, v in ref_tr.state_dict().items())
    tr = load_streaming(tr, items, dtype=dt, where="memory", convert=Fuser21())
    ours = QwenImage21Pipeline(
        tr,
        load_vae21(tmp / "vae", dev, dt),
        TextEncoder21(te, tok, processor.image_processor, getattr(processor, "chat_template", None)),
        load_scheduler_config(tmp / "scheduler"),
        device=dev,
    )
    ours.set_progress_bar_config(disable=True)
    return ref, ours, what


def timed(fn, n: int) -> tuple[float, np.ndarray]:
    """(median seconds of n calls, the last call's images)."""
    times, out = [], None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(n):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def main(argv=None) -> list[dict]:
    from ..pipeline.pipeline21 import TURBO_SIGMAS

    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--text-encoder", choices=["full", "tiny"], default="full")
    p.add_argument("--runs", type=int, default=2, help="timed calls per row (after one warm-up)")
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=32, help="fewer for a smoke run")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (timings meaningless)")
    p.add_argument("--fp8", action="store_true", help="also our FP8 pipeline (40 steps and turbo-4), last")
    a = p.parse_args(argv)
    dev, dt = torch.device(a.device), torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        t0 = time.perf_counter()
        ref, ours, te = build(dev, dt, a.text_encoder, Path(tmp), a.layers)
        print(f"built in {time.perf_counter() - t0:.0f} s; text encoder: {te}")
        kw = dict(prompt=PROMPT, height=a.size, width=a.size, output_type="np")

        def run(pipe, steps, sigmas=None, seed=0):
            return pipe(
                **kw,
                num_inference_steps=steps,
                sigmas=sigmas,
                generator=torch.Generator(dev).manual_seed(seed),
            ).images

        rows, base = [], None
        common = {
            "size": a.size,
            "dtype": "bf16",
            "text_encoder": te,
            "layers": a.layers,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        }
        for cache in ("off", "balanced", "fast"):
            ours.configure(cache=cache)
            run(ours, a.steps)  # warm-up: kernels, CUDA graphs of every step variant
            s, img = timed(lambda: run(ours, a.steps), a.runs)
            base = img if cache == "off" else base
            st = {k: v // (a.runs + 1) for k, v in ours.block_runner.stats.items()} if cache != "off" else {}
            rows.append(
                {
                    "what": "qwen-image-2.1 e2e step cache",
                    "cache": cache,
                    "steps": a.steps,
                    "ours_s": round(s, 3),
                    "mean_abs_diff_vs_off": float(f"{np.abs(img - base).mean():.3e}"),
                    "runner_steps_per_call": st,
                    **common,
                }
            )
        ours.configure(cache=None)
        sig = list(TURBO_SIGMAS["turbo-4"])
        run(ref, 4, sig)
        ref_s, ref_img = timed(lambda: run(ref, 4, sig), a.runs)
        run(ours, 4, sig)
        our_s, our_img = timed(lambda: run(ours, 4, sig), a.runs)
        rows.append(
            {
                "what": "qwen-image-2.1 e2e turbo-4",
                "steps": 4,
                "diffusers_s": round(ref_s, 3),
                "ours_s": round(our_s, 3),
                "speedup": round(ref_s / our_s, 3),
                "mean_abs_diff_vs_diffusers": float(f"{np.abs(our_img - ref_img).mean():.3e}"),
                **common,
            }
        )
        ref_40, ref_img40 = timed(lambda: run(ref, a.steps), 1)
        off = rows[0]["ours_s"]
        rows.append(
            {
                "what": "qwen-image-2.1 e2e diffusers",
                "steps": a.steps,
                "diffusers_s": round(ref_40, 3),
                "ours_s_cache_off": off,
                "speedup_cache_off": round(ref_40 / off, 3),
                "speedup_balanced": round(ref_40 / rows[1]["ours_s"], 3),
                "speedup_fast": round(ref_40 / rows[2]["ours_s"], 3),
                "mean_abs_diff_vs_diffusers": float(f"{np.abs(base - ref_img40).mean():.3e}"),
                **common,
            }
        )
        if a.fp8:  # FP8 block GEMMs (one-way: after every bf16 row), against the same run's diffusers bf16
            ours.configure(fp8=True)
            for steps, sigmas, ref_s_, ref_im in (
                (a.steps, None, ref_40, ref_img40),
                (4, sig, ref_s, ref_img),
            ):
                run(ours, steps, sigmas)
                s8, img8 = timed(lambda steps=steps, sigmas=sigmas: run(ours, steps, sigmas), a.runs)
                rows.append(
                    {
                        "what": "qwen-image-2.1 e2e fp8",
                        "steps": steps,
                        "schedule": "turbo-4" if sigmas else "default",
                        "diffusers_s": round(ref_s_, 3),
                        "ours_s": round(s8, 3),
                        "speedup": round(ref_s_ / s8, 3),
                        "mean_abs_diff_vs_diffusers_bf16": float(f"{np.abs(img8 - ref_im).mean():.3e}"),
                        **common,
                        "dtype": "fp8",
                    }
                )
    print(f"{'row':<32} {'ours s':>8} {'diffusers s':>11} {'mean |d|':>10}")
    for r in rows:
        label = r["what"].replace("qwen-image-2.1 e2e ", "") + (f" {r['cache']}" if "cache" in r else "")
        label += f" {r['steps']} steps" if r["what"].endswith("fp8") else ""
        d = r.get(
            "mean_abs_diff_vs_off",
            r.get("mean_abs_diff_vs_diffusers", r.get("mean_abs_diff_vs_diffusers_bf16", "")),
        )
        print(
            f"{label:<32} {r.get('ours_s', r.get('ours_s_cache_off', '')):>8} {r.get('diffusers_s', ''):>11} {d!s:>10}"
        )
    from . import emit_lines

    emit_lines(rows, a.out or None)
    return rows


if __name__ == "__main__":
    main()
