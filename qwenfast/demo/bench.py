"""`qwenfast bench quality`: generate the held-out suite with a model and score it with the analyser.

The score is the quality gate: a faster path (kernels, graphs, batched CFG, lower precision) must keep
it. Image i of the suite uses seed i, so runs are comparable across devices and code paths.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import data as D
from . import score as S

if TYPE_CHECKING:
    from ..pipeline.edit import QwenImageEditPipeline
    from ..pipeline.text_to_image import QwenImagePipeline


def progress_bar(total: int, what: str):
    """The suite's progress on stderr (images done of `total`), so a minute-long run is never silent
    (stdout keeps the table and the final JSON line). Every batch redraws it (miniters 1, no minimum
    interval): a suite of a few fast images still shows its count before the bar clears."""
    from tqdm import tqdm

    kw = dict(file=sys.stderr, leave=False, dynamic_ncols=True, miniters=1, mininterval=0)
    return tqdm(total=total, desc=what, unit="img", **kw)


def generate(
    pipe: QwenImagePipeline,
    prompts: list[str],
    *,
    steps: int | None = None,
    cfg: float | None = None,
    batch: int = 16,
    seed0: int = 0,
    size: int = D.SIZE,
    negative: str = " ",
) -> list[np.ndarray]:
    """Images (uint8 HxWx3) for `prompts`, image i from `torch.Generator("cpu").manual_seed(seed0 + i)`."""
    d = pipe.defaults
    steps = d["num_inference_steps"] if steps is None else steps
    cfg = d["true_cfg_scale"] if cfg is None else cfg
    out = []
    with progress_bar(len(prompts), "quality") as bar:
        for s in range(0, len(prompts), batch):
            chunk = prompts[s : s + batch]
            gens = [torch.Generator("cpu").manual_seed(seed0 + s + i) for i in range(len(chunk))]
            res = pipe(
                chunk,
                negative_prompt=negative if cfg > 1 else None,
                height=size,
                width=size,
                num_inference_steps=steps,
                true_cfg_scale=cfg,
                generator=gens,
                output_type="np",
            )
            out += [S.to_uint8(a) for a in res.images]
            bar.update(len(chunk))
    return out


def run_t2i(
    pipe: QwenImagePipeline,
    n: int = 120,
    *,
    steps: int | None = None,
    cfg: float | None = None,
    batch: int = 16,
) -> tuple[S.SuiteResult, list[np.ndarray]]:
    suite = D.eval_prompts()[:n]
    prompts = [p for p, _ in suite]
    images = generate(pipe, prompts, steps=steps, cfg=cfg, batch=batch)
    return S.score_prompts(images, prompts), images


def run_edits(
    pipe: QwenImageEditPipeline,
    n: int = 36,
    *,
    steps: int | None = None,
    cfg: float | None = None,
    seed0: int = 0,
) -> tuple[S.SuiteResult, list[np.ndarray]]:
    """The held-out edit suite with an edit pipeline: edit i of `before` i with seed seed0 + i."""
    suite = D.eval_edits(max(n, 36))[:n]  # the first 36 are the held-out suite; more only for path gates
    d = pipe.defaults
    steps = d["num_inference_steps"] if steps is None else steps
    cfg = d["true_cfg_scale"] if cfg is None else cfg
    images = []
    with progress_bar(len(suite), "quality (edits)") as bar:
        for i, (before, instruction, _) in enumerate(suite):
            res = pipe(
                D.render(before),
                instruction,
                negative_prompt=" " if cfg > 1 else None,
                num_inference_steps=steps,
                true_cfg_scale=cfg,
                generator=torch.Generator("cpu").manual_seed(seed0 + i),
                output_type="np",
            )
            images.append(S.to_uint8(res.images[0]))
            bar.update(1)
    befores = [b for b, _, _ in suite]
    return S.score_edits(images, befores, [ins for _, ins, _ in suite]), images


def load(
    model: str | Path | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> QwenImagePipeline:
    """The demo pipeline for a folder: text-to-image, or edit when the folder is an edit model
    (None = the embedded text-to-image demo; "edit" = the embedded edit demo)."""
    from ..about import DEMO_EDIT_MODEL, DEMO_MODEL
    from ..pipeline.auto import from_pretrained

    path = DEMO_EDIT_MODEL if model == "edit" else DEMO_MODEL if model is None else model
    pipe = from_pretrained(path, device=device, dtype=dtype)  # picks the class from model_index.json
    pipe.set_progress_bar_config(disable=True)
    return pipe


def is_edit(pipe: QwenImagePipeline) -> bool:
    from ..pipeline.edit import QwenImageEditPipeline

    return isinstance(pipe, QwenImageEditPipeline)


def run_suite(
    pipe: QwenImagePipeline,
    n: int | None = None,
    *,
    steps: int | None = None,
    cfg: float | None = None,
    batch: int = 16,
) -> tuple[S.SuiteResult, list[np.ndarray]]:
    """The pipeline's held-out suite: edits (n default 36) or text-to-image prompts (n default 120)."""
    if is_edit(pipe):
        return run_edits(pipe, n or 36, steps=steps, cfg=cfg)
    return run_t2i(pipe, n or 120, steps=steps, cfg=cfg, batch=batch)


def quality(
    model: str | Path | None = None,
    n: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    steps: int | None = None,
    cfg: float | None = None,
    batch: int = 16,
    verbose: bool = False,
) -> dict:
    """Load a demo model folder (None = the embedded default, "edit" = the embedded edit model), print
    its held-out suite score (120 prompts, or 36 edit instructions) and return the benchmark record
    (`qwenfast bench quality` prints it as its final JSON line)."""
    pipe = load(model, device, dtype)
    cap = 36 if is_edit(pipe) else 120  # the held-out suites' sizes
    n = min(n or cap, cap)
    t0 = time.perf_counter()
    res, images = run_suite(pipe, n, steps=steps, cfg=cfg, batch=batch)
    n = len(images)
    dt = time.perf_counter() - t0
    d = pipe.defaults
    what = "edit instructions" if is_edit(pipe) else "prompts"
    print(f"model    {pipe.model_path}")
    print(
        f"suite    {n} held-out {what} (seed i for item i), {steps or d['num_inference_steps']} steps, "
        f"cfg {cfg if cfg is not None else d['true_cfg_scale']}, {pipe.device} {pipe.dtype}, {dt:.1f}s"
    )
    print(f"score    {res.score:.1f}% of {what} pass every check ({res.attribute:.1f}% of single checks)")
    print("checks   " + ", ".join(f"{k} {v:.1f}%" for k, v in res.per_check.items()))
    if verbose:
        for it in res.items:
            if not it["pass"]:
                bad = [k for k, v in it["checks"].items() if not v]
                print(f"  FAIL {it['prompt']!r}: {', '.join(bad)}")
    return {
        "bench": "quality",
        "model": "demo-t2i" if model is None else str(model),
        "n": n,
        "steps": steps or d["num_inference_steps"],
        "cfg": cfg if cfg is not None else d["true_cfg_scale"],
        "device": str(pipe.device),
        "dtype": str(pipe.dtype).replace("torch.", ""),
        "score": round(res.score, 2),
        "attribute": round(res.attribute, 2),
        "per_check": {k: round(v, 2) for k, v in res.per_check.items()},
        "seconds": round(dt, 1),
    }


# ------------------------------------------------------------------------------------ the gate per path
# (name, dtype, kernel backend, CUDA graphs, batched CFG, fast VAE, 8-bit weights: "" | "fp8" | "int8"): each
# path adds one speed-up to the one above it, so a drop in score points at the step that caused it. True
# (not "auto") batched CFG forces the padded, masked batch, the riskier path; INT8 is FP8's alternative.
PATHS = (
    ("reference fp32", torch.float32, "torch", False, False, False, ""),
    ("bf16", torch.bfloat16, "torch", False, False, False, ""),
    ("bf16 + kernels", torch.bfloat16, "triton", False, False, True, ""),
    ("bf16 + kernels + graphs", torch.bfloat16, "triton", True, False, True, ""),
    ("bf16 + kernels + graphs + batched CFG", torch.bfloat16, "triton", True, True, True, ""),
    ("fp8 + kernels + graphs + batched CFG", torch.bfloat16, "triton", True, True, True, "fp8"),
    ("int8 + kernels + graphs + batched CFG", torch.bfloat16, "triton", True, True, True, "int8"),
)


def quality_paths(
    model: str | Path | None = None,
    n: int = 120,
    device: torch.device | str | None = None,
    batch: int = 24,
    # (name, dtype, kernel backend, CUDA graphs, batched CFG, fast VAE, 8-bit weights), as in PATHS
    paths: Sequence[tuple[str, torch.dtype, str, bool, bool, bool, str]] = PATHS,
) -> list[dict]:
    """Score the held-out suite once per code path (same seeds); rows with the gap to the reference, each
    item's pass ("passes") and the items lost and gained against the reference.

    Edit models score `n` edits (beyond the 36 held-out ones the suite continues with the same
    generator, so 2 points are more than one item). FP8 rows are skipped where FP8 GEMMs are not
    supported (CPU, pre-Ada GPUs)."""
    from ..kernels import use_backend
    from ..kernels.fp8_linear import fp8_supported
    from ..pipeline.text_to_image import resolve_device

    dev = resolve_device(device)
    rows, ref, ref_passes = [], None, None
    for name, dtype, kernels, graphs, batched, fast_vae, weights in paths:
        if weights == "fp8" and not fp8_supported(dev):
            rows.append({"path": name, "skipped": f"FP8 GEMMs need an Ada/Hopper GPU, not {dev}"})
            continue
        pipe = load(model, dev, dtype)
        pipe.configure(
            cuda_graphs=graphs,
            batched_cfg=batched,
            kernels=kernels,
            fp8=weights == "fp8",
            int8=weights == "int8",
        )
        pipe.vae.fast = fast_vae
        t0 = time.perf_counter()
        with use_backend(kernels):  # also the VAE's kernels, which run outside the pipeline's call too
            res, _ = run_suite(pipe, n, batch=batch)
        row = {
            "path": name,
            "score": round(res.score, 2),
            "attribute": round(res.attribute, 2),
            "s": round(time.perf_counter() - t0, 1),
        }
        ref = row["score"] if ref is None else ref
        row["gap"] = round(row["score"] - ref, 2)
        # which items pass ("1"/"0" in suite order), and against the reference the items this path lost and
        # gained: a gap of one or two items with many flips each way is noise of the numerics, not a loss
        row["passes"] = "".join("1" if it["pass"] else "0" for it in res.items)
        ref_passes = row["passes"] if ref_passes is None else ref_passes
        row["lost"] = sum(a > b for a, b in zip(ref_passes, row["passes"]))
        row["gained"] = sum(a < b for a, b in zip(ref_passes, row["passes"]))
        rows.append(row)
        print(f"  {name:40s} {row['score']:5.1f}%  (gap {row['gap']:+.1f})  {row['s']:.1f}s", flush=True)
        del pipe
    return rows


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)) / 255.0**2
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray, win: int = 7) -> float:
    """Mean structural similarity of two uint8 HxWx3 images: Wang et al.'s formula with a `win` x `win`
    uniform window per channel (scikit-image's defaults: K1 0.01, K2 0.03, sample covariance)."""
    import torch.nn.functional as F

    x = torch.from_numpy(a.astype(np.float64) / 255.0).permute(2, 0, 1)[:, None]  # (3, 1, H, W)
    y = torch.from_numpy(b.astype(np.float64) / 255.0).permute(2, 0, 1)[:, None]
    n = win * win
    mean = lambda t: F.avg_pool2d(t, win, stride=1)  # noqa: E731 - the local mean, valid windows only
    mx, my = mean(x), mean(y)
    cov = n / (n - 1)
    vx, vy, vxy = cov * (mean(x * x) - mx**2), cov * (mean(y * y) - my**2), cov * (mean(x * y) - mx * my)
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def quality_cache(
    model=None,
    caches=("balanced", "fast"),
    n: int | None = None,
    device=None,
    dtype=None,
    steps: int = 50,
    cfg=None,
    batch: int = 24,
) -> list[dict]:
    """The held-out suite at `steps` steps (CFG on, the model's scale) uncached and with each step-cache
    policy, same seeds: score, the fraction of steps computed in full, PSNR / SSIM of each image vs the
    uncached one."""
    pipe = load(model, device, dtype)
    rows, ref = [], None
    for cache in (None, *caches):
        pipe.configure(cache=cache)
        t0 = time.perf_counter()
        res, images = run_suite(pipe, n, steps=steps, cfg=cfg, batch=batch)
        name = getattr(cache, "name", cache) or "off"
        row = {"cache": name, "score": round(res.score, 2), "s": round(time.perf_counter() - t0, 1)}
        if cache is not None:
            st = pipe.block_runner.stats
            row["computed_fraction"] = round(st["full"] / max(1, st["full"] + st["cached"]), 3)
            row["gap"] = round(row["score"] - ref[0], 2)
            ps = [psnr(a, b) for a, b in zip(images, ref[1])]
            row["psnr_db"] = round(float(np.mean([min(v, 99.0) for v in ps])), 2)
            row["ssim"] = round(float(np.mean([ssim(a, b) for a, b in zip(images, ref[1])])), 4)
        else:
            ref = (row["score"], images)
        rows.append(row)
        extra = (
            ""
            if cache is None
            else (
                f"  computed {row['computed_fraction']:.0%}  PSNR {row['psnr_db']} dB  "
                f"SSIM {row['ssim']}  (gap {row['gap']:+.1f})"
            )
        )
        print(f"  cache {row['cache']:<9s} {row['score']:5.1f}%{extra}  {row['s']}s", flush=True)
    pipe.configure(cache=None)
    return rows
