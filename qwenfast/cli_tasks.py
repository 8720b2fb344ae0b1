"""Command-line parts for the ControlNet and Layered tasks (kept out of cli.py, which they plug into).

- `qwenfast generate PROMPT --control IMG --controlnet PATH[:SCALE]`: text-to-image steered by a
  ControlNet (InstantX Union: canny, depth, pose, ... pictures). Repeat `--control` for several
  conditions through one Union net, or repeat both (one net per image). `--control-mask MASK` with the
  InstantX inpainting ControlNet repaints the mask's white pixels of the `--control` picture.
- `qwenfast layers IMG -o DIR --layers N --model Qwen-Image-Layered`: one RGBA PNG per layer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_engine_arguments
from .options import positive_int as _positive
from .validation import path_and_number


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
    g.add_argument("--control", action="append", default=[], metavar="IMG",
                   help="control picture (canny, depth, pose, ...); repeatable for several conditions")  # fmt: skip
    g.add_argument("--controlnet", type=path_and_number, action="append", default=[], metavar="PATH[:SCALE]",
                   help="ControlNet folder or .safetensors file, conditioning scale (default 1); one for every "
                        "--control (one Union net) or one per --control")  # fmt: skip
    g.add_argument("--control-mask", default=None, metavar="MASK",
                   help="with an inpainting ControlNet: white pixels of MASK are repainted in the --control picture")  # fmt: skip
    g.add_argument("--control-start", type=_fraction, default=0.0, help="share of the steps before the ControlNet starts")
    g.add_argument("--control-end", type=_fraction, default=1.0, help="share of the steps after which it stops")


def check_control_args(a: argparse.Namespace) -> None:
    if not a.control and not a.controlnet:
        if a.control_mask:
            raise ValueError("--control-mask needs --control IMG and --controlnet PATH (an inpainting ControlNet)")
        return
    if not a.control or not a.controlnet:
        raise ValueError("--control IMG and --controlnet PATH[:SCALE] go together")
    if len(a.controlnet) > 1 and len(a.controlnet) != len(a.control):
        raise ValueError(f"{len(a.controlnet)} --controlnet for {len(a.control)} --control: give one ControlNet "
                         "(used for every picture) or one per picture")  # fmt: skip
    if a.control_mask and (len(a.control) > 1 or len(a.controlnet) > 1):
        raise ValueError("--control-mask takes one --control picture and one (inpainting) --controlnet")
    if a.control_start >= a.control_end:
        raise ValueError(f"--control-start {a.control_start} must be below --control-end {a.control_end}")
    for p in [*a.control, *([a.control_mask] if a.control_mask else [])]:
        if not Path(p).is_file():
            raise ValueError(f"no such picture {p!r}")


def control_pipeline(a: argparse.Namespace, opts):
    """The ControlNet pipeline for `generate --control`, and its extra call arguments."""
    from PIL import Image

    from .pipeline.controlnet import QwenImageControlNetInpaintPipeline, QwenImageControlNetPipeline
    from .pipeline.edit import calculate_dimensions

    cls = QwenImageControlNetInpaintPipeline if a.control_mask else QwenImageControlNetPipeline
    paths = [p for p, _ in a.controlnet]
    many = len(a.control) > 1
    pipe = cls.from_pretrained(a.model, controlnet=paths if many else paths[0], device=a.device, dtype=a.dtype,
                               options=opts)  # fmt: skip
    scales = [s for _, s in a.controlnet]
    scales = scales * len(a.control) if len(scales) == 1 else scales
    pictures = [Image.open(p) for p in a.control]
    kw = {"control_image": pictures if many else pictures[0], "control_guidance_start": a.control_start,
          "control_guidance_end": a.control_end,
          "controlnet_conditioning_scale": scales if many else scales[0]}  # fmt: skip
    if a.control_mask:
        kw["control_mask"] = Image.open(a.control_mask)
    if not a.size:  # the picture's aspect at the model's own area (multiples of 32)
        d = pipe.defaults
        w, h = calculate_dimensions(d["width"] * d["height"], pictures[0].width / pictures[0].height)
        kw.update(width=w, height=h)
    return pipe, kw


# ---------------------------------------------------------------------------------------------- layers


def add_layers_parser(sub) -> None:
    p = sub.add_parser("layers", help="split a picture into RGBA layers (Qwen-Image-Layered)")
    p.add_argument("image", help="the picture to decompose")
    p.add_argument("-o", "--output", default="layers", help="folder for the layer PNGs (default ./layers)")
    p.add_argument("--model", required=True, help="Qwen-Image-Layered diffusers folder")
    p.add_argument("--layers", type=_positive, default=4, help="number of RGBA layers (default 4)")
    p.add_argument("--prompt", default=None, help="what the picture shows (default: the model captions it)")
    p.add_argument("--negative", default=None, help="negative prompt (default ' ' when --cfg > 1)")
    p.add_argument("--resolution", type=int, default=640, help="640 (recommended) or 1024: the layer size bucket")
    p.add_argument("--steps", type=_positive, default=None, help="denoising steps (default: the model's, 50)")
    p.add_argument("--cfg", type=float, default=None, help="true CFG scale (default: the model's, 4)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--n", type=_positive, default=1, help="decompositions to make (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--lora", action="append", default=[], type=path_and_number, metavar="PATH[:STRENGTH]",
                   help="fuse a LoRA at STRENGTH (default 1); repeatable")  # fmt: skip
    add_engine_arguments(p)
