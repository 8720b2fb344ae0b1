"""`qwenfast bench pipeline`'s component stages (`--vae`, `--memory`, `--offload`; see pipeline.py's
docstring): the VAE against diffusers', the memory planner's calibration, OOM recovery and offload."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import rel_err
from .harness import PROMPT, GiB, StageTimer, _call, _device_name, _free, _peak, _reset_peak, _sync

if TYPE_CHECKING:
    from ..pipeline.common import QwenImageOutput
    from ..pipeline.text_to_image import QwenImagePipeline


def _median_ms(fn, n=5) -> float:
    fn()
    _sync()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(ts), 2)


@torch.no_grad()
def vae_bench(ours: QwenImagePipeline, ref: Any, smoke: bool) -> dict:  # ref: anything with diffusers' `.vae`
    vae, rvae = ours.vae, ref.vae
    dev, dt = next(vae.parameters()).device, next(vae.parameters()).dtype
    res = {}
    for size in (64, 96) if smoke else (1024, 1328):
        g = torch.Generator().manual_seed(size)
        z = torch.randn(1, 16, size // 8, size // 8, generator=g).to(dev, dt)
        x = (torch.rand(1, 3, size, size, generator=g) * 2 - 1).to(dev, dt)
        row = {}
        want = rvae.decode(z[:, :, None]).sample[:, :, 0].clamp(-1, 1)
        want_m = rvae.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
        # how far bf16 itself moves the decode: diffusers' bf16 and ours, each vs diffusers in fp32
        rvae.float()
        exact = rvae.decode(z[:, :, None].float()).sample[:, :, 0].clamp(-1, 1)
        rvae.to(dt)
        row["diffusers_bf16_vs_fp32_decode_rel_err"] = float(f"{rel_err(want, exact):.2e}")
        vae.fast, vae.tiling = True, False
        row["ours_fast_vs_fp32_decode_rel_err"] = float(f"{rel_err(vae.decode(z), exact):.2e}")
        del exact
        row["diffusers_decode_ms"] = _median_ms(lambda: rvae.decode(z[:, :, None]))
        row["diffusers_encode_ms"] = _median_ms(lambda: rvae.encode(x[:, :, None]))
        vae.tiling = False
        for fast in (False, True):
            vae.fast = fast
            tag = "fast" if fast else "reference"
            got = vae.decode(z)
            row[f"ours_{tag}_decode_rel_err"] = float(
                f"{((got - want).float().norm() / want.float().norm()):.2e}"
            )
            row[f"ours_{tag}_encode_rel_err"] = float(
                f"{((vae.encode(x)[0] - want_m).float().norm() / want_m.float().norm()):.2e}"
            )
            row[f"ours_{tag}_decode_ms"] = _median_ms(lambda: vae.decode(z))
            row[f"ours_{tag}_encode_ms"] = _median_ms(lambda: vae.encode(x))
        row["decode_speedup"] = round(row["diffusers_decode_ms"] / row["ours_fast_decode_ms"], 2)
        row["encode_speedup"] = round(row["diffusers_encode_ms"] / row["ours_fast_encode_ms"], 2)
        res[str(size)] = row
        print(f"  VAE {size}: {json.dumps(row)}", flush=True)
    vae.fast, vae.tiling = True, "auto"
    big = 128 if smoke else 2512
    z = torch.randn(1, 16, big // 8, big // 8, device=dev, dtype=dt)
    for mode in ("auto", True):
        vae.tiling = mode
        _free()
        _reset_peak()
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        t0 = time.perf_counter()
        out = vae.decode(z)
        _sync()
        key = f"decode_{big}_{'auto' if mode == 'auto' else 'tiled'}"
        res[key] = {
            "s": round(time.perf_counter() - t0, 3),
            "shape": list(out.shape),
            "finite": bool(torch.isfinite(out).all()),
            "activation_peak_gib": round((_peak() - base) / GiB, 2),
            "tiled": mode is True or vae._want_tiling(1, big, big, dt, encode=False),
        }
        print(f"  VAE {key}: {json.dumps(res[key])}", flush=True)
        del out
    vae.tiling = "auto"
    return res


@torch.no_grad()
def memory_calibration(ours: QwenImagePipeline, smoke: bool, out_dir: Path | None) -> dict:
    """Measure per-phase peaks of our pipeline over a grid; fit the planner's coefficients; report errors."""
    from dataclasses import replace

    from ..runtime.memory import Calibration, MemoryPlanner, ModelSizes, _elem

    sizes = ModelSizes.from_pipeline(ours)
    grid = [(s, b) for s in ((64, 96) if smoke else (512, 768, 1024, 1328)) for b in (1, 2)]
    dt = ours.dtype
    e = _elem(dt)
    rows = []
    # no graphs: graph pools would carry memory from one grid point to the next. CFG as two passes of
    # `batch` sequences (what "auto" does for prompts of unequal length), so the fitted coefficient is
    # per sequence; predict(batched_cfg=True) doubles it for one batched pass
    saved = ours.options
    ours.configure(cuda_graphs=False, batched_cfg=False)
    _drop_graphs(ours)
    for size, b in grid:
        _free()
        timer = StageTimer(stage_peaks=True)
        timer.wrap(ours.text_encoder, "encode", "encode")
        timer.wrap(ours.vae, "decode", "decode", before="denoise")  # the peak since the encode = denoising
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        try:
            _call(ours, "qwenfast", size, 1, True, f"calibration {size} {b}", batch=b)
        finally:
            timer.restore()
        rows.append({"size": size, "batch": b, "base": base, **{k: v - base for k, v in timer.peak.items()}})
    ours.configure(cuda_graphs=saved.cuda_graphs, batched_cfg=saved.batched_cfg)
    if not torch.cuda.is_available():  # the harness ran; CPU has no allocator peaks to fit
        return {"grid": rows, "skipped": "no CUDA memory counters on CPU"}
    # activation features per phase (what the planner multiplies its coefficients by)
    txt = 64
    feats = []
    for r in rows:
        toks = (r["size"] // 16) ** 2
        feats.append(
            {
                "denoise": r["batch"] * (toks + txt) * sizes.dim * e,
                "decode": r["batch"] * r["size"] ** 2 * sizes.vae_base_dim * e,
            }
        )
    fit = {}
    for phase, key in (("denoise", "transformer"), ("decode", "vae_decode")):
        xs = np.array([f[phase] for f in feats], dtype=np.float64)
        ys = np.array([r.get(phase, 0) for r in rows], dtype=np.float64)
        if phase == "decode":
            ys = ys - np.array([r["batch"] * 3 * r["size"] ** 2 * e for r in rows])
        A = np.stack([xs, np.ones_like(xs)], 1)
        (k, c), *_ = np.linalg.lstsq(A, ys, rcond=None)
        fit[key], fit[f"{phase}_offset"] = float(k), float(c)
    calib = replace(
        Calibration(),
        transformer=round(fit["transformer"], 3),
        vae_decode=round(fit["vae_decode"], 3),
        overhead=int(max(0.0, fit["denoise_offset"], fit["decode_offset"])),
        source=f"fitted by qwenfast bench pipeline --memory on {_device_name()}",
    )
    pl = MemoryPlanner(sizes, calib)
    errs = []
    for r in rows:
        p = pl.predict(
            r["size"], r["size"], r["batch"], cfg=True, batched_cfg=False, txt_len=txt, offload="none"
        )
        measured = r["base"] + max(r.get("encode", 0), r.get("denoise", 0), r.get("decode", 0))
        r["predicted_gib"], r["measured_gib"] = round(p.peak / GiB, 3), round(measured / GiB, 3)
        r["rel_err"] = round((p.peak - measured) / max(measured, 1), 4)
        act_pred = p.peak - p.resident
        act_meas = measured - r["base"]
        r["activation_rel_err"] = round((act_pred - act_meas) / max(act_meas, 1), 4)
        errs.append(abs(r["rel_err"]))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        calib.save(out_dir / "memory_calibration.json")
    res = {
        "calibration": vars(calib),
        "grid": rows,
        "max_abs_rel_err": max(errs),
        "within_10pct": max(errs) <= 0.10,
    }
    print(
        f"  memory: max |pred - measured| / measured = {max(errs):.3f}; calibration {vars(calib)}", flush=True
    )
    return res


def _drop_graphs(pipe) -> None:
    """Captured CUDA graphs keep their activation pool allocated: drop them before measuring memory."""
    pipe.release_graphs()
    _free()


@torch.no_grad()
def offload_bench(ours: QwenImagePipeline, smoke: bool) -> dict:
    """Forced OOM recovery, then offload modes (irreversible: run last)."""
    from ..runtime.memory import MemoryPlanner

    res = {}
    cuda = torch.cuda.is_available()
    size, steps = (64, 2) if smoke else (1024, 4)
    prompts = [f"{PROMPT} #{i}" for i in range(4)]

    def run(batch_prompts: list[str], output_type: str = "np") -> QwenImageOutput:
        return ours(
            batch_prompts,
            height=size,
            width=size,
            num_inference_steps=steps,
            true_cfg_scale=1.0,
            generator=[torch.Generator("cpu").manual_seed(i) for i in range(len(batch_prompts))],
            output_type=output_type,
        )

    ours.configure(cuda_graphs=False)  # a captured batch-4 graph would keep its pool: the OOM must be real
    _drop_graphs(ours)
    want_lat = run(prompts, "latent").images.float()
    want = run(prompts).images
    if cuda:  # a fraction that holds the weights + the denoising activations of two images, not four
        _free()
        total = torch.cuda.get_device_properties(0).total_memory
        p4 = MemoryPlanner.from_pipeline(ours).predict(size, size, 4, cfg=False)
        act4 = p4.phases["denoise"] - p4.resident
        allowed = torch.cuda.memory_reserved() + int(0.6 * act4)  # the cap counts reserved segments
        res["forced_oom_allowed_gib"] = round(allowed / GiB, 2)
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total))
    try:
        # latents first (the split itself must not change them), then the whole call to pixels (the VAE
        # may also tile under this cap, which moves pixels a little: reported, not compared)
        lat = run(prompts, "latent")
        t0 = time.perf_counter()
        out = run(prompts)
        res["forced_oom"] = {
            "s": round(time.perf_counter() - t0, 2),
            "events": out.info.get("oom_backoff", []),
            "latent_events": lat.info.get("oom_backoff", []),
            "latent_max_abs_diff_vs_unsplit": float((lat.images.float() - want_lat).abs().max()),
            "max_abs_diff_vs_unsplit": float(np.abs(out.images - want).max()),
        }
    except Exception as e:  # noqa: BLE001 - the record says what happened
        res["forced_oom"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    print(f"  forced OOM: {json.dumps(res['forced_oom'])}", flush=True)
    # the baseline of the offload rows: the same call with every weight resident (graphs off as there)
    run(prompts[:1])
    _sync()
    _reset_peak()
    t0 = time.perf_counter()
    run(prompts[:1])
    _sync()
    res["none"] = {
        "s": round(time.perf_counter() - t0, 2),
        "peak_gib": round(_peak() / GiB, 2),
        "predicted_gib": round(
            MemoryPlanner.from_pipeline(ours).predict(size, size, 1, cfg=False).peak / GiB, 2
        ),
        "offload_after_forced_oom": ours.offload,
    }  # "none" unless a fallback switched it on
    print(f"  offload none: {json.dumps(res['none'])}", flush=True)
    for mode in ("model", "blocks"):
        t0 = time.perf_counter()
        ours.enable_offload(mode)
        setup = time.perf_counter() - t0
        _free()
        t0 = time.perf_counter()
        run(prompts[:1])  # the first call after switching (pins, first transfers), then a timed one
        _sync()
        first = time.perf_counter() - t0
        _reset_peak()
        t0 = time.perf_counter()
        got = run(prompts[:1]).images
        _sync()
        pred = MemoryPlanner.from_pipeline(ours).predict(size, size, 1, cfg=False, offload=mode).peak
        res[mode] = {
            "setup_s": round(setup, 1),
            "first_s": round(first, 2),
            "s": round(time.perf_counter() - t0, 2),
            "peak_gib": round(_peak() / GiB, 2),
            "predicted_gib": round(pred / GiB, 2),
            "max_abs_diff_vs_none": float(np.abs(got - want[:1]).max()),
        }
        print(f"  offload {mode}: {json.dumps(res[mode])}", flush=True)
    for cap in (24, 8) if cuda else ():  # a 24 GiB card (4090-class), and a smaller one
        _free()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total))
        key = f"blocks_{cap}gib"
        try:
            _reset_peak()
            t0 = time.perf_counter()
            out = run(prompts[:1])
            res[key] = {
                "s": round(time.perf_counter() - t0, 2),
                "peak_gib": round(_peak() / GiB, 2),
                "oom_backoff": out.info.get("oom_backoff", []),
                "max_abs_diff_vs_none": float(np.abs(out.images - want[:1]).max()),
            }
        except Exception as e:  # noqa: BLE001
            res[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        print(f"  offload blocks under {cap} GiB: {json.dumps(res[key])}", flush=True)
    return res
