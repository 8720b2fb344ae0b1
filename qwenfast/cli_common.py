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


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


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
        raise ValueError(f"-o {output}: qwenfast writes PNG files (with the prompt and seed inside); use a .png name, "
                         f"e.g. {path.with_suffix('.png')}")  # fmt: skip


def on_cpu(a: argparse.Namespace) -> bool:
    """Whether this run computes on the CPU (--device cpu, or no CUDA device)."""
    if a.device:
        return str(a.device).startswith("cpu")
    import torch

    return not torch.cuda.is_available()


def engine_notes(a: argparse.Namespace, loras: bool | None = None) -> None:
    """Flags that would do nothing (or not what they say) here get one line on stderr; an offload on the
    CPU is dropped (the weights already live in host memory: it would only copy them every step).
    `loras`: whether LoRAs can come (None: `--lora` was given)."""
    loras = bool(getattr(a, "lora", None)) if loras is None else loras
    if a.preset and a.preset != "default" and not loras:
        note(f"--preset {a.preset} is the sampling recipe of a distilled LoRA (few steps, no CFG); without "
             "--lora the base model runs it and gives blurry images: add --lora PATH (e.g. the matching "
             "Lightning / turbo LoRA), or leave --preset out")  # fmt: skip
    if not on_cpu(a):
        return
    if a.offload not in (None, "none"):
        note(f"--offload {a.offload} does nothing on the CPU (the weights already live in host memory); "
             "running without it")  # fmt: skip
        a.offload, a.offload_budget = None, None
    if a.fp8:
        note("--fp8 on the CPU is emulated (the weights are rounded to FP8 e4m3 and multiplied in fp32): the "
             "images change as with FP8 on a GPU, but nothing gets faster; FP8 speed needs an Ada/Hopper GPU")  # fmt: skip


def model_heads(model: str | None, transformer_file: str | None = None) -> int | None:
    """The attention head count from `MODEL/transformer/config.json` (the embedded demo when None);
    None when it cannot be read before loading (single files, a folder without that config)."""
    if transformer_file is not None:
        return None
    from . import DEMO_MODEL

    try:
        cfg = json.loads((Path(model or DEMO_MODEL) / "transformer" / "config.json").read_text())
        heads = cfg.get("num_attention_heads")
    except (OSError, ValueError, AttributeError):
        return None
    return heads if isinstance(heads, int) and heads > 0 else None


def check_parallel_args(a: argparse.Namespace) -> None:
    """--parallel: the layout's syntax and whether the model's heads allow it, before any process starts."""
    if not getattr(a, "parallel", None):
        return
    from .runtime.parallel import ParallelConfig

    try:
        layout = ParallelConfig.parse(a.parallel)
    except ValueError as e:
        raise ValueError(f"--parallel {a.parallel}: {e}" if not str(e).startswith("--parallel") else str(e)) from None
    V.check_parallel(layout.cfg, layout.ulysses, model_heads(a.model, getattr(a, "transformer", None)))


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


def check_model_kind(model: str | None, want: str) -> None:
    """`--model` of the wrong kind: say which command runs it (the loader's advice is for Python users)."""
    if model is None:
        return
    from .loading.diffusers_folder import inspect_folder

    kind, problems = inspect_folder(Path(model))
    if kind is None or problems:
        return  # the loader reports what is missing
    if want == "edit" and kind == "text-to-image":
        raise ValueError(f"{model} is a text-to-image model (Qwen-Image layout); `qwenfast edit` needs an edit model "
                         f"(Qwen-Image-Edit, -2509, -2511). To make an image from a prompt with it: "
                         f"qwenfast generate \"PROMPT\" --model {model}")  # fmt: skip
    if want == "text-to-image" and kind == "layered":
        raise ValueError(f"{model} is a Qwen-Image-Layered model; split a picture into layers with: "
                         f"qwenfast layers IMAGE.png -o DIR --model {model}")  # fmt: skip
    if want == "text-to-image" and kind not in ("text-to-image", "controlnet", "controlnet-inpaint"):
        raise ValueError(f"{model} is a Qwen-Image edit model ({kind}); `qwenfast generate` needs a text-to-image "
                         f"model (Qwen-Image, -2512). To edit pictures with it: "
                         f"qwenfast edit IMAGE.png --prompt \"INSTRUCTION\" --model {model}")  # fmt: skip


def is_21(model: str | None) -> bool:
    """Whether --model is a Qwen-Image-2.1 folder (model_index.json names QwenImage21Pipeline)."""
    f = Path(model) / "model_index.json" if model else None
    if f is None or not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("_class_name") == "QwenImage21Pipeline"
    except (ValueError, OSError):
        return False
