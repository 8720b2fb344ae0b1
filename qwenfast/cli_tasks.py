"""Command-line parts for the ControlNet and Layered tasks (kept out of cli.py, which they plug into).

- `qwenfast generate PROMPT --control IMG --controlnet PATH[:SCALE]`: text-to-image steered by a
  ControlNet (InstantX Union: canny, depth, pose, ... pictures). Repeat `--control` for several
  conditions through one Union net, or repeat both (one net per image). `--control-mask MASK` with the
  InstantX inpainting ControlNet repaints the mask's white pixels of the `--control` picture.
- `qwenfast layers IMG -o DIR --layers N --model Qwen-Image-Layered`: one RGBA PNG per layer.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import cli_common as C
from .engine_args import add_engine_arguments
from .engine_args import positive_int as _positive
from .validation import path_and_number

LAYERED_HINT = (
    "get Qwen-Image-Layered from Hugging Face (Qwen/Qwen-Image-Layered; there is no embedded demo of it): "
    "hf download Qwen/Qwen-Image-Layered --local-dir /models/Qwen-Image-Layered, then pass "
    "--model /models/Qwen-Image-Layered"
)
CONTROLNET_HINT = (
    "ControlNets for Qwen-Image are on Hugging Face: InstantX/Qwen-Image-ControlNet-Union (canny, depth, "
    "pose, ... pictures) and InstantX/Qwen-Image-ControlNet-Inpainting (with --control-mask), e.g. "
    "hf download InstantX/Qwen-Image-ControlNet-Union --local-dir /models/Qwen-Image-ControlNet-Union, "
    "then --controlnet /models/Qwen-Image-ControlNet-Union"
)


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {s!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {s!r}")
    return v


def add_control_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ControlNet (InstantX Qwen-Image-ControlNet-Union / -Inpainting)")
    g.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="IMG",
        help="control picture (canny, depth, pose, ...); repeatable for several conditions",
    )
    g.add_argument(
        "--controlnet",
        type=path_and_number,
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="ControlNet folder or .safetensors file, conditioning scale (default 1); one for every "
        "--control (one Union net) or one per --control",
    )
    g.add_argument(
        "--control-mask",
        default=None,
        metavar="MASK",
        help="with an inpainting ControlNet: white pixels of MASK are repainted in the --control picture",
    )
    g.add_argument(
        "--control-start", type=_fraction, default=0.0, help="share of the steps before the ControlNet starts"
    )
    g.add_argument(
        "--control-end", type=_fraction, default=1.0, help="share of the steps after which it stops"
    )


def check_control_args(a: argparse.Namespace) -> None:
    if not a.control and not a.controlnet:
        if a.control_mask:
            raise ValueError(
                "--control-mask needs --control IMG and --controlnet PATH (an inpainting ControlNet)"
            )
        return
    if not a.control:
        raise ValueError("--controlnet PATH[:SCALE] needs --control IMG (the canny / depth / pose picture)")
    if not a.controlnet:
        raise ValueError(
            f"--control IMG needs --controlnet PATH[:SCALE] (a ControlNet folder or file); {CONTROLNET_HINT}"
        )
    for net, _ in a.controlnet:
        if not Path(net).exists():
            raise ValueError(f"no ControlNet at {net!r}; {CONTROLNET_HINT}")
    if len(a.controlnet) > 1 and len(a.controlnet) != len(a.control):
        raise ValueError(
            f"{len(a.controlnet)} --controlnet for {len(a.control)} --control: give one ControlNet "
            "(used for every picture) or one per picture"
        )
    if a.control_mask and (len(a.control) > 1 or len(a.controlnet) > 1):
        raise ValueError("--control-mask takes one --control picture and one (inpainting) --controlnet")
    if a.control_start >= a.control_end:
        raise ValueError(f"--control-start {a.control_start} must be below --control-end {a.control_end}")
    for p in [*a.control, *([a.control_mask] if a.control_mask else [])]:
        if not Path(p).is_file():
            raise ValueError(f"no such picture {p!r}")


def control_inputs(a: argparse.Namespace) -> tuple[object, dict]:
    """(`controlnet=` for the loader: one path or a list, the ControlNet call arguments) of `generate --control`."""
    from PIL import Image

    paths = [p for p, _ in a.controlnet]
    many = len(a.control) > 1
    scales = [s for _, s in a.controlnet]
    scales = scales * len(a.control) if len(scales) == 1 else scales
    pictures = [Image.open(p) for p in a.control]
    kw = {
        "control_image": pictures if many else pictures[0],
        "control_guidance_start": a.control_start,
        "control_guidance_end": a.control_end,
        "controlnet_conditioning_scale": scales if many else scales[0],
    }
    if a.control_mask:
        kw["control_mask"] = Image.open(a.control_mask)
    return (paths if many else paths[0]), kw


def control_size(pipe, control: dict) -> tuple[int, int]:
    """(width, height) without --size: the (first) control picture's aspect at the model's own area
    (multiples of 32)."""
    from .pipeline.edit import calculate_dimensions

    first = (
        control["control_image"][0]
        if isinstance(control["control_image"], list)
        else control["control_image"]
    )
    d = pipe.defaults
    return calculate_dimensions(d["width"] * d["height"], first.width / first.height)


# ---------------------------------------------------------------------------------------------- layers


def add_layers_parser(sub) -> None:
    p = sub.add_parser("layers", help="split a picture into RGBA layers (Qwen-Image-Layered)")
    p.add_argument("image", help="the picture to decompose")
    p.add_argument("-o", "--output", default="layers", help="folder for the layer PNGs (default ./layers)")
    p.add_argument(
        "--model",
        default=None,
        help="Qwen-Image-Layered diffusers folder (required; Hugging Face: Qwen/Qwen-Image-Layered)",
    )
    p.add_argument("--layers", type=_positive, default=4, help="number of RGBA layers (default 4)")
    p.add_argument("--prompt", default=None, help="what the picture shows (default: the model captions it)")
    p.add_argument("--negative", default=None, help="negative prompt (default ' ' when --cfg > 1)")
    p.add_argument(
        "--resolution", type=int, default=640, help="640 (recommended) or 1024: the layer size bucket"
    )
    p.add_argument("--steps", type=_positive, default=None, help="denoising steps (default: the model's, 50)")
    p.add_argument("--cfg", type=float, default=None, help="true CFG scale (default: the model's, 4)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed; decomposition i of --n uses SEED+i (default: random, printed)",
    )
    p.add_argument(
        "--n", type=_positive, default=1, help="decompositions to make, seeds SEED, SEED+1, ... (default 1)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        type=path_and_number,
        metavar="PATH[:STRENGTH]",
        help="fuse a LoRA at STRENGTH (default 1); repeatable",
    )
    add_engine_arguments(p)


def check_layered_model(a: argparse.Namespace) -> None:
    """--model of `qwenfast layers`: given, a folder, and one the registry runs "layered" on; else say
    where to get Qwen-Image-Layered."""
    if a.model is None:
        raise ValueError(f"`qwenfast layers` needs --model, a Qwen-Image-Layered folder; {LAYERED_HINT}")
    if not Path(a.model).is_dir():
        raise ValueError(f"--model {a.model}: no such folder; {LAYERED_HINT}")
    C.pipeline_class(a, "layered", "layers", hint=LAYERED_HINT)


def cmd_layers(a: argparse.Namespace) -> int:
    """`qwenfast layers IMG -o DIR`: one RGBA PNG per layer (decomposition i of --n: seed + i)."""
    a.size = None
    C.check_values(a)
    from . import validation as V

    V.check_range("--layers", a.layers, 1, 16)  # the pipeline's limits, named as flags, before loading
    if a.resolution % 32 or not 64 <= a.resolution <= 2048:
        raise ValueError(
            f"--resolution must be a multiple of 32 in 64..2048 (640 is recommended, 1024 the other "
            f"size the model was trained at), got {a.resolution}"
        )
    check_layered_model(a)  # and --parallel: the layered pipeline runs on one GPU
    if not Path(a.image).is_file():
        raise ValueError(f"no such picture {a.image!r}")
    C.engine_notes(a)
    t0 = time.perf_counter()
    pipe = C.load_pipeline(a, "layered")
    loras = C.setup_pipe(pipe, a)
    t_load = time.perf_counter() - t0
    steps, cfg, negative, seed = C.sampling(pipe.defaults, a)
    t1 = time.perf_counter()
    out = pipe(
        a.image,
        a.prompt,
        negative_prompt=negative,
        true_cfg_scale=cfg,
        layers=a.layers,
        num_inference_steps=steps,
        num_images_per_prompt=a.n,
        resolution=a.resolution,
        generator=C.generators(seed, a.n),
    )
    t_gen = time.perf_counter() - t1
    folder = Path(a.output)
    meta = {
        "prompt": a.prompt or "(caption)",
        "steps": str(steps),
        "cfg": str(cfg),
        "layers": str(a.layers),
        "model": pipe.model_path,
        "input": str(a.image),
        "generator": "qwenfast",
    }
    if loras:
        meta["loras"] = str(loras)
    paths = []
    for b, layer_images in enumerate(out.images):
        stem = "layer" if len(out.images) == 1 else f"image-{b}-layer"
        for k, im in enumerate(layer_images):
            paths += C.save_pngs([im], folder / f"{stem}-{k}.png", {**meta, "layer": str(k)}, seed + b)
    w, h = out.images[0][0].size
    print(
        f"saved {len(paths)} RGBA layers to {folder}/ ({C.seeds_text(seed, a.n)}, {steps} steps, cfg {cfg}, "
        f"{w}x{h}; load {t_load:.1f}s, decompose {t_gen:.2f}s on {pipe.device})"
    )
    return 0
