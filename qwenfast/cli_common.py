"""What every image command of the CLI shares (generate, edit, layers; cli.py and cli_tasks.py use it):
value checks before anything loads, notes for flags that do nothing here, the per-image seeds, the
size a command makes, and writing the PNGs with their metadata.

Rules (the server follows the same ones, qwenfast/validation.py):
- image i of `--seed S --n N` is drawn from its own generator seeded S+i and records S+i, so it is
  the image `--seed S+i --n 1` makes;
- `--size` is refused, never rounded, when it breaks the size rule; the message names the nearest sizes;
- every message names the flag as typed (`--strength`), never the Python argument.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from . import validation as V
from .engine_args import check_parallel_args, engine_notes, model_heads, note, on_cpu  # noqa: F401 (the CLI's names)


def setup_pipe(pipe, a) -> list[dict]:
    """Progress bar, preset, LoRAs (FP8 is an option of the load: engine_options_from_args)."""
    pipe.set_progress_bar_config(disable=a.quiet)
    if a.preset:
        pipe.apply_preset(a.preset)
    return [{"name": pipe.load_lora(p, s), "path": p, "strength": s} for p, s in a.lora]


def check_values(a: argparse.Namespace) -> None:
    """The server's value rules (qwenfast/validation.py) for --steps, --cfg, --seed and --strength; ValueError
    names the flag. --size is checked by its parser (and again with the model's multiple after loading)."""
    V.check_steps(a.steps, name="--steps")
    V.check_cfg(a.cfg, name="--cfg")
    V.check_seed(a.seed, name="--seed")
    V.check_strength(getattr(a, "strength", None), a.steps, name="--strength", steps_name="--steps")


def check_output(output: str) -> None:
    """-o of generate / edit, before anything loads: a PNG file name (the PNG carries the prompt, seed and
    settings), not a folder."""
    path = Path(output)
    if path.is_dir():
        raise ValueError(f"-o {output} is a folder; give a file name such as {path / 'out.png'}")
    if path.suffix and path.suffix.lower() != ".png":
        raise ValueError(
            f"-o {output}: qwenfast writes PNG files (with the prompt and seed inside); use a .png name, "
            f"e.g. {path.with_suffix('.png')}"
        )


def model_size(pipe, a) -> tuple[int, int] | None:
    """--size checked with the model's multiple (16; 32 for Qwen-Image-2.1): refused, not rounded. None
    when --size is not given."""
    if not a.size:
        return None
    w, h = a.size
    V.check_size(w, h, multiple=2 * pipe.vae_scale_factor, name="--size")
    return w, h


def size_note(pipe, w: int, h: int) -> None:
    msg = pipe.size_note(w, h)
    if msg:
        print(msg, file=sys.stderr)


def sampling(d: dict, a) -> tuple[int, float, str | None, int]:
    """(steps, cfg, negative prompt, seed) from the flags over the model's defaults."""
    steps = a.steps or d["num_inference_steps"]
    cfg = d["true_cfg_scale"] if a.cfg is None else a.cfg
    negative = a.negative if a.negative is not None else (" " if cfg > 1 else None)
    seed = a.seed if a.seed is not None else random.randrange(2**31)
    return steps, cfg, negative, seed


def generators(seed: int, n: int) -> list:
    """One CPU generator per image, seeded seed + i (validation.image_seeds)."""
    import torch

    return [torch.Generator("cpu").manual_seed(s) for s in V.image_seeds(seed, n)]


def one_by_one(call, seed: int, n: int, **kw) -> list:
    """`call(..., generator=g)` once per image with its own generator: for pipelines that draw more than the
    noise from the generator (img2img / inpainting sample the picture's latents, ControlNets the control
    latents), so image i is the image of seed + i alone."""
    images: list = []
    for g in generators(seed, n):
        images += call(generator=g, num_images_per_prompt=1, **kw).images
    return images


def seeds_text(seed: int, n: int) -> str:
    s = V.image_seeds(seed, n)
    return f"seed {s[0]}" if n == 1 else f"seeds {s[0]}..{s[-1]}"


def meta_extras(meta: dict, a, loras: list[dict]) -> None:
    if loras:
        meta["loras"] = json.dumps(loras)
    if a.preset:
        meta["preset"] = a.preset
    if a.fp8:
        meta["fp8"] = "e4m3 rowwise (transformer blocks)"
    if a.cache not in (None, "off"):
        meta["cache"] = a.cache


def save_pngs(images: list, output: Path, meta: dict[str, str], seed: int | None = None) -> list[Path]:
    """PNGs with `meta` as iTXt; with `seed`, image i records seed + i (its own seed)."""
    from PIL import PngImagePlugin

    seeds = V.image_seeds(seed, len(images)) if seed is not None else None
    output.parent.mkdir(parents=True, exist_ok=True)
    if len(images) == 1:
        paths = [output]
    else:
        paths = [output.with_name(f"{output.stem}-{i}{output.suffix or '.png'}") for i in range(len(images))]
    for i, (img, p) in enumerate(zip(images, paths)):
        info = PngImagePlugin.PngInfo()
        for k, v in ({**meta, "seed": str(seeds[i])} if seeds else meta).items():
            info.add_itxt(k, v)  # iTXt: UTF-8, so any prompt survives
        img.save(p, format="PNG", pnginfo=info)
    return paths


# The image commands by the task they run, and how to run one: what a --model that cannot run a command's
# task is told to use instead (which tasks a folder runs is the pipeline registry's answer, pipeline/auto.py).
HOW_TO_RUN = (
    ("text-to-image", 'To make an image from a prompt with it: qwenfast generate "PROMPT" --model {model}'),
    ("edit", 'To edit pictures with it: qwenfast edit IMAGE.png --prompt "INSTRUCTION" --model {model}'),
    ("layered", "To split a picture into layers with it: qwenfast layers IMAGE.png -o DIR --model {model}"),
)


def pipeline_class(
    a: argparse.Namespace, task: str, command: str, single: dict | None = None, hint: str = ""
):
    """The pipeline class that will run `task` for this command (the registry's, before anything loads),
    and the flags checked against what it declares it can do (`CAPABILITIES`): a --model that runs
    another task says which command runs it (`hint`: where to get the right model), --parallel and
    single files only where the class takes them, --size with the class's multiple."""
    from .errors import CheckpointError
    from .pipeline import auto

    try:
        cls = auto.pipeline_class(None if single is not None else a.model, task)
    except CheckpointError:  # no readable model_index.json: the loader says what is missing
        cls = auto.pipeline_class(None, task)
    except ValueError:
        kind = auto.folder_kind(a.model)
        how = next((how for t, how in HOW_TO_RUN if t in auto.folder_tasks(kind)), None)
        msg = f"{a.model} is {auto.describe(kind)}; `qwenfast {command}` needs {auto.pipeline_class(None, task).checkpoints}"
        raise ValueError(
            msg + (f". {how.format(model=a.model)}" if how else "") + (f"; {hint}" if hint else "")
        ) from None
    caps = cls.CAPABILITIES
    if single is not None and not caps.single_files:
        raise ValueError(
            f"`qwenfast {command}` ({task}) loads a diffusers folder (--model), not single files"
        )
    if getattr(a, "parallel", None) and not caps.parallel:
        raise ValueError(f"`qwenfast {command}` ({task}) runs on one GPU (no --parallel)")
    if getattr(a, "size", None):  # refused before loading; the model's own multiple again after (model_size)
        V.check_size(*a.size, multiple=caps.size_multiple, name="--size")
    return cls


def load_pipeline(a: argparse.Namespace, task: str, single: dict | None = None, **kwargs):
    """The pipeline of `task` from --model (None: the task's embedded demo) or the single files, through
    the pipeline registry, with the engine options of the flags; `kwargs` to the class's loader."""
    from .engine_args import engine_options_from_args
    from .pipeline import auto

    opts = engine_options_from_args(a)  # with --fp8 the transformer loads as FP8
    if single is not None:
        return auto.from_single_files(
            **single, task=task, device=a.device, dtype=a.dtype, options=opts, **kwargs
        )
    return auto.from_pretrained(a.model, task=task, device=a.device, dtype=a.dtype, options=opts, **kwargs)
