"""`qwenfast bench pipeline --task img2img|inpaint|edit-inpaint|edit-2511`: one end-to-end row per task vs
the matching diffusers pipeline, same weights, same run.

Built like `qwenfast bench pipeline` (`pipeline.build`: full-size random transformer, VAE and
Qwen2.5-VL-7B shared by both engines; `--smoke`: the embedded demo on the CPU). img2img and inpaint
run the text-to-image weights through `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline`
(`pipe.for_task`) and diffusers' classes of the same names; edit-inpaint runs the same transformer as
an Edit v1 model (`QwenImageEditInpaintPipeline`, diffusers' `QwenImageEditInpaintPipeline`, whose
input is resized to ~1024² area whatever `--size` says); edit-2511 runs it as an Edit-2511 model (both
transformers built with `zero_cond_t`; `QwenImageEditPlusPipeline` on each side) on a `--size`² input
to a `--size`² output (the reference goes to the VAE at ~1024² area, so at 2048² the transformer sees
16384 + 4096 image tokens). `--fp8` (one task): the row again with qwenfast's FP8 GEMMs. Per engine:
a 2-step warm-up with the timed shapes (CUDA graphs are captured there), then one timed call; the row
has total seconds, peak memory, the speed-up and the mean |difference| of the two engines' images
(uint8-scale / 255).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

TASKS = {
    "img2img": 0.6,
    "inpaint": 0.85,
    "edit-inpaint": 1.0,
    "edit-2511": None,
}  # task -> strength (None: none)


def _inputs(size: int):
    """A smooth random picture (low-frequency noise, so the VAE sees an image, not static) and a mask
    whose centre half is white (repaint)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (size // 32, size // 32, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((size // 4, size // 4, 3 * size // 4, 3 * size // 4), fill=255)
    return img, mask


def _edit_pipes(ours, ref, plus: bool = False):
    """(ours, diffusers) edit-inpaint pipelines on the text-to-image pipelines' weights, as Edit v1;
    `plus`: edit pipelines as Edit-2509/2511 (`QwenImageEditPlusPipeline`)."""
    import diffusers

    from ..pipeline.edit import QwenImageEditPipeline, load_image_processor
    from ..testing.tiny import build_processor

    te = ours.text_encoder
    tok = te.tokenizer
    ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    for (
        key,
        token,
    ) in ids.items():  # the random 7B's config names the real tokenizer's ids; ours is the tiny one
        setattr(te.model.config, key, tok.convert_tokens_to_ids(token))
    edit = QwenImageEditPipeline(
        ours.transformer,
        ours.vae,
        te,
        ours.scheduler_config,
        model_path="random full size",
        mode="edit-plus" if plus else "edit",
        image_processor=load_image_processor(),
        options=ours.options,
        device=ours.device,
    )
    d = (diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditInpaintPipeline)(
        scheduler=ref.scheduler,
        vae=ref.vae,
        text_encoder=ref.text_encoder,
        tokenizer=ref.tokenizer,
        processor=build_processor(ref.tokenizer),
        transformer=ref.transformer,
    )
    edit.set_progress_bar_config(disable=True)
    return (edit if plus else edit.for_task("edit-inpaint")), d


def _kwargs(task: str, img, mask, size: int, steps: int, strength: float | None) -> dict:
    kw = dict(
        negative_prompt=" ",
        true_cfg_scale=4.0,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        image=img,
    )
    if strength is not None:
        kw["strength"] = strength
    if task not in ("img2img", "edit-2511"):
        kw["mask_image"] = mask
    if task != "edit-inpaint":  # edit-inpaint follows the image (diffusers ignores height/width there)
        kw.update(height=size, width=size)
    return kw


def run_tasks(
    tasks: list[str],
    smoke: bool = False,
    steps: int | None = None,
    size: int | None = None,
    fp8: bool = False,
    out_dir: Path | None = None,
) -> dict:
    import diffusers

    from . import save_record, stamp, versions
    from .harness import PROMPT, GiB, _device_name, _free, _peak, _reset_peak, _sync
    from .pipeline import build

    steps = steps or (2 if smoke else 30)
    size = size or (64 if smoke else 1024)
    t0 = time.perf_counter()
    ours, ref = build(smoke, zero_cond_t="edit-2511" in tasks)
    ours.set_progress_bar_config(disable=True)
    record = {
        "bench": "tasks_inpaint",
        "device": _device_name(),
        "torch": torch.__version__,
        "triton": versions()["triton"],
        "smoke": smoke,
        "steps": steps,
        "size": size,
        "build_s": round(time.perf_counter() - t0, 1),
        "rows": {},
    }
    print(f"built in {record['build_s']} s on {record['device']}", flush=True)
    img, mask = _inputs(size)
    for task in tasks:
        strength = TASKS[task]
        if task.startswith("edit"):
            q, d = _edit_pipes(ours, ref, plus=task == "edit-2511")
        else:
            cls = (
                diffusers.QwenImageImg2ImgPipeline
                if task == "img2img"
                else diffusers.QwenImageInpaintPipeline
            )
            q, d = ours.for_task(task), cls(**ref.components)
        d.set_progress_bar_config(disable=True)
        row, images = {"strength": strength}, {}
        for engine, pipe in (("diffusers", d), ("qwenfast", q)):
            prompt = f"{PROMPT} ({task})"
            pipe(prompt=prompt, **_kwargs(task, img, mask, size, 2, strength))  # warm-up, same shapes
            if engine == "qwenfast":
                pipe.text_encoder.clear_cache()  # time a real encode
            _free()
            _reset_peak()
            _sync()
            t1 = time.perf_counter()
            images[engine] = pipe(prompt=prompt, **_kwargs(task, img, mask, size, steps, strength)).images
            _sync()
            row[engine] = {"total_s": round(time.perf_counter() - t1, 3), "peak_gib": round(_peak() / GiB, 2)}
            print(f"  {task:13s} {engine:10s} {json.dumps(row[engine])}", flush=True)
        if fp8 and not smoke:  # (no FP8 GEMMs on the CPU; one task: FP8 is one-way)
            d = ref = None  # diffusers' views keep the bf16 weights alive: drop them before FP8 replaces ours
            _free()
            q.configure(fp8=True)
            q(prompt=prompt, **_kwargs(task, img, mask, size, 2, strength))
            _free()
            _reset_peak()
            _sync()
            t1 = time.perf_counter()
            img8 = q(prompt=prompt, **_kwargs(task, img, mask, size, steps, strength)).images
            _sync()
            row["qwenfast_fp8"] = {
                "total_s": round(time.perf_counter() - t1, 3),
                "peak_gib": round(_peak() / GiB, 2),
                "mean_abs_diff_vs_diffusers": float(f"{np.abs(images['diffusers'] - img8).mean():.3e}"),
            }
            print(f"  {task:13s} {'fp8':10s} {json.dumps(row['qwenfast_fp8'])}", flush=True)
        row["speedup"] = round(row["diffusers"]["total_s"] / row["qwenfast"]["total_s"], 2)
        row["mean_abs_diff_images"] = float(f"{np.abs(images['diffusers'] - images['qwenfast']).mean():.3e}")
        row["shape"] = list(images["qwenfast"].shape)
        record["rows"][task] = row
        del d, q
        _free()
    print(f"{'task':14s} {'diffusers s':>12s} {'qwenfast s':>11s} {'speedup':>8s} {'mean |d|':>10s}")
    for task, r in record["rows"].items():
        print(
            f"{task:14s} {r['diffusers']['total_s']:12.2f} {r['qwenfast']['total_s']:11.2f} {r['speedup']:8.2f} "
            f"{r['mean_abs_diff_images']:10.2e}"
        )
    record = stamp(record)
    print(json.dumps(record))
    if out_dir is not None:
        save_record(record, Path(out_dir) / "tasks.jsonl")
    return record
