"""`qwenfast` command line: generate | edit | layers | doctor | bench.

Errors a user can fix (bad size, missing files, unknown dtype) print one line starting with
`error:` and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import cli_common as C
from . import validation as V
from .engine_args import add_engine_arguments
from .engine_args import positive_int as _positive
from .options import WEIGHTS


def _size(s: str) -> tuple[int, int]:
    try:
        w, h = V.parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    try:  # the server's rule (validation.check_size): refused, never rounded; 2.1 models check 32 after loading
        V.check_size(w, h, name="")  # argparse says "argument --size: "
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return w, h


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or "default" in h
            or action.default is None
            or action.default == []
            or action.default is argparse.SUPPRESS
        ):
            return h
        return h + " (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:  # never "Qwen-\nImage", "--max-\nsize"
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """argparse with `_Help` in every subcommand (subparsers are made with the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


SINGLE_FILES = ("transformer", "vae", "text_encoder", "tokenizer")


def add_single_file_args(parser: argparse.ArgumentParser) -> None:
    """--transformer/--vae/--text-encoder/--tokenizer (+ --configs): ComfyUI single files instead of --model."""
    s = parser.add_argument_group("single files (ComfyUI split files, bf16 or FP8; instead of --model)")
    s.add_argument("--transformer", help="diffusion model file, e.g. qwen_image_fp8_e4m3fn.safetensors")
    s.add_argument("--vae", help="VAE file, e.g. qwen_image_vae.safetensors")
    s.add_argument("--text-encoder", help="text encoder file, e.g. qwen_2.5_vl_7b_fp8_scaled.safetensors")
    s.add_argument("--tokenizer", help="tokenizer folder (e.g. Qwen-Image/tokenizer); single files lack one")
    s.add_argument(
        "--configs",
        help="folder with transformer/ vae/ text_encoder/ scheduler/ configs, "
        "for non-standard model sizes (full-size configs are inferred from the files)",
    )


def single_file_kwargs(a: argparse.Namespace) -> dict | None:
    """None without single files; else the arguments of `from_single_files` (clear errors when incomplete)."""
    given = {k: getattr(a, k) for k in SINGLE_FILES}
    if not any(given.values()):
        return None
    if a.model is not None:
        raise ValueError("--model and --transformer/--vae/--text-encoder/--tokenizer exclude each other")
    missing = ["--" + k.replace("_", "-") for k, v in given.items() if v is None]
    if missing:
        need = "--transformer, --vae, --text-encoder and --tokenizer"
        raise ValueError(f"single files need {need}; missing {missing}")
    c = Path(a.configs) if a.configs else None
    for sub, name in (
        ("transformer", "config.json"),
        ("vae", "config.json"),
        ("text_encoder", "config.json"),
        ("scheduler", "scheduler_config.json"),
    ):
        if c is not None and (c / sub / name).is_file():
            given[sub if sub == "scheduler" else f"{sub}_config"] = c / sub / name
    return given


def _add_sampling_args(p: argparse.ArgumentParser, size_help: str) -> None:
    """Sampling options `generate` and `edit` share (the engine options are `add_engine_arguments`)."""
    p.add_argument(
        "--negative", default=None, help="negative prompt (default ' ' when --cfg > 1, as Qwen's examples)"
    )
    p.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help=f"denoising steps, 1..{V.MAX_STEPS} (default: the model's own, e.g. 20 for the embedded "
        "demo, 50 for Qwen-Image)",
    )
    p.add_argument(
        "--cfg",
        type=float,
        default=None,
        help=f"true CFG scale, 0..{V.MAX_CFG:g}; 1 or less disables CFG (default: the model's own, e.g. 2 "
        "for the embedded demo, 4 for Qwen-Image)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed, 0..2**63-1; image i of --n uses SEED+i (default: random, printed)",
    )
    p.add_argument("--size", type=_size, default=None, help=size_help)
    p.add_argument(
        "--n", type=_positive, default=1, help="number of images, seeds SEED, SEED+1, ... (default 1)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--lora",
        type=V.path_and_number,
        action="append",
        default=[],
        metavar="PATH[:STRENGTH]",
        help="fuse a LoRA (.safetensors; diffusers, kohya, ComfyUI names) at STRENGTH (default 1); repeatable",
    )
    add_engine_arguments(p)  # --device --dtype --offload --fp8 --cuda-graphs --kernels --attention --preset


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="qwenfast", description="Fast Qwen-Image inference.")
    p.add_argument("--version", action="version", version=f"qwenfast {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="text-to-image")
    g.add_argument("prompt")
    g.add_argument(
        "-o", "--output", default="out.png", help="PNG path; with --n > 1, -0, -1, ... are appended"
    )
    g.add_argument(
        "--model",
        default=None,
        help="diffusers-layout text-to-image folder (default: the embedded 128x128 demo model)",
    )
    g.add_argument(
        "--image",
        default=None,
        metavar="IMG",
        help="start from this picture (img2img); the output keeps its size unless --size is given",
    )
    g.add_argument(
        "--mask",
        default=None,
        metavar="MASK",
        help="with --image: inpaint; white (>= 50%% grey) pixels of MASK are repainted, black ones kept",
    )
    g.add_argument(
        "--strength",
        type=float,
        default=None,
        metavar="S",
        help="with --image: 0..1, how much of the schedule runs (1 = ignore the picture's content there); "
        "default 0.6 for img2img, 1.0 with --mask",
    )
    add_single_file_args(g)
    _add_sampling_args(
        g,
        size_help=f"WIDTHxHEIGHT, multiples of 16 (32 for Qwen-Image-2.1), sides up to {V.MAX_SIDE} "
        "(default: the model's own size, e.g. 128x128 for the embedded demo, 1024x1024 for "
        "Qwen-Image; with --image, the picture's size rounded down to multiples of 16)",
    )
    from .cli_tasks import add_control_args, add_layers_parser

    add_control_args(g)  # --control IMG --controlnet PATH[:SCALE]

    e = sub.add_parser("edit", help="edit images (Qwen-Image-Edit v1, 2509, 2511)")
    e.add_argument("image", nargs="+", help="input image(s): 1 for Edit v1, 1-3 for Edit-2509/2511")
    e.add_argument("--prompt", required=True, help="the edit instruction")
    e.add_argument(
        "-o", "--output", default="edited.png", help="PNG path; with --n > 1, -0, -1, ... are appended"
    )
    e.add_argument(
        "--model", default=None, help="diffusers-layout edit model folder (default: embedded demo edit model)"
    )
    e.add_argument(
        "--mask",
        default=None,
        metavar="MASK",
        help="inpaint: only the white (>= 50%% grey) pixels of MASK change (one input image)",
    )
    e.add_argument(
        "--strength",
        type=float,
        default=None,
        metavar="S",
        help="with --mask: 0..1, how much of the schedule runs (default 1.0)",
    )
    add_single_file_args(e)
    _add_sampling_args(
        e,
        size_help=f"WIDTHxHEIGHT, multiples of 16 (32 for Qwen-Image-2.1), sides up to {V.MAX_SIDE} "
        "(default: the last image's aspect at the model's own area, e.g. ~128x128 for the "
        "embedded demo, ~1024x1024 for Qwen-Image-Edit)",
    )

    add_layers_parser(sub)  # qwenfast layers IMG -o DIR --layers N

    from .cli_tools import add_bench_parser

    add_bench_parser(sub)  # qwenfast bench WHAT ...

    from .server.options import add_serve_arguments

    add_serve_arguments(
        sub.add_parser("serve", help="OpenAI-compatible image server + web page ([server] extra)")
    )

    from .export.cli_export import add_arguments as add_export_arguments

    add_export_arguments(
        sub.add_parser("export", help="export a model component (ONNX) for TensorRT / Triton")
    )

    d = sub.add_parser("doctor", help="versions, GPU, and whether a model folder is complete")
    d.add_argument("--model", default=None, help="model folder to check (default: the embedded model)")
    d.add_argument(
        "--vram",
        type=float,
        default=None,
        metavar="GIB",
        help="print the memory plan for a card with this much memory (full-size Qwen-Image at 1024², 50 steps "
        "with CFG, or --model's folder); default: this GPU's free memory",
    )
    d.add_argument(
        "--weights", choices=list(WEIGHTS), default="bf16", help="weight format of the plan (default bf16)"
    )
    return p


def _start_inputs(a: argparse.Namespace, task: str) -> tuple[tuple | None, float | None]:
    """((image, mask or None), strength) of `generate --image [--mask]` / `edit --mask`, loaded and checked
    before the model is; (None, None) without them. Default strength: 0.6 for img2img, 1.0 to inpaint."""
    from .pipeline.edit import load_images
    from .pipeline.img2img import load_masks

    image = getattr(a, "image", None)
    if a.mask and task != "edit-inpaint" and image is None:
        raise ValueError("--mask needs --image (the picture to inpaint)")
    if image is None and task != "edit-inpaint":
        if a.strength is not None:
            raise ValueError("--strength needs --image (img2img) or --mask with --image (inpainting)")
        return None, None
    if task == "edit-inpaint" and a.mask is None:
        if a.strength is not None:
            raise ValueError("--strength needs --mask (edit inpainting)")
        return None, None
    strength = a.strength if a.strength is not None else (0.6 if task == "img2img" else 1.0)
    V.check_strength(
        strength, a.steps, name="--strength", steps_name="--steps"
    )  # again with the model's steps
    img = load_images(image)[0] if task != "edit-inpaint" else None  # edit loads its own images
    mask = load_masks(a.mask)[0] if a.mask else None
    return (img, mask), strength


def _before_launch(a: argparse.Namespace) -> None:
    """Checks and notes of the launching process (with --parallel the ranks run the command again)."""
    from . import launch

    if not launch.is_worker():
        C.check_parallel_args(a)
        C.engine_notes(a)


def _generate_task(a: argparse.Namespace, start) -> tuple[str, str]:
    """(the task `generate` runs with these flags, the command as typed for messages)."""
    if a.controlnet:
        return ("controlnet-inpaint" if a.control_mask else "controlnet"), "generate --controlnet"
    if start is not None:
        return ("inpaint", "generate --mask") if a.mask else ("img2img", "generate --image")
    return "text-to-image", "generate"


def cmd_generate(a: argparse.Namespace) -> int:
    from . import DEMO_MODEL, launch
    from .cli_tasks import check_control_args, control_inputs, control_size
    from .pipeline.common import EMBEDDED_NOTE

    _before_launch(a)
    check_control_args(a)
    start, strength = _start_inputs(a, "inpaint" if a.mask else "img2img")  # bad inputs fail before loading
    if start is not None and a.controlnet:
        raise ValueError(
            "--image/--mask (img2img, inpainting) and --controlnet do not combine; for ControlNet "
            "inpainting use --control-mask"
        )
    single = single_file_kwargs(a)
    task, command = _generate_task(a, start)
    C.pipeline_class(a, task, command, single)  # the folder runs it, and the flags fit what its class can do
    if a.parallel and not launch.is_worker():
        return launch.run(cmd_generate, a)  # every rank runs this function again, rank 0 writes
    if a.model is None and single is None and launch.rank() == 0:
        print(EMBEDDED_NOTE.format(path=DEMO_MODEL), file=sys.stderr)
    t0 = time.perf_counter()
    nets, control = control_inputs(a) if a.controlnet else (None, {})
    pipe = C.load_pipeline(a, task, single, **({"controlnet": nets} if nets is not None else {}))
    loras = C.setup_pipe(pipe, a)
    t_load = time.perf_counter() - t0
    if C.model_size(pipe, a):
        w, h = a.size
    elif start is not None:  # the picture's size, rounded down to the model's multiple
        w, h = V.round_size(*start[0].size, 2 * pipe.vae_scale_factor)
    elif a.controlnet:  # the control picture's aspect at the model's own area
        w, h = control_size(pipe, control)
    else:
        h, w = pipe.output_size({})
    C.size_note(pipe, w, h)
    steps, cfg, negative, seed = C.sampling(pipe.defaults, a)
    extra = {}
    if start is not None:  # img2img / inpainting
        V.check_strength(strength, steps, name="--strength", steps_name="--steps")
        extra = {"image": start[0], "strength": strength, **({"mask_image": start[1]} if a.mask else {})}
    t1 = time.perf_counter()
    kw = dict(
        negative_prompt=negative,
        height=h,
        width=w,
        num_inference_steps=steps,
        true_cfg_scale=cfg,
        **control,
        **extra,
    )
    if start is not None or a.controlnet:  # these draw the picture's / control latents from the generator too
        images = C.one_by_one(lambda **k: pipe(a.prompt, **k), seed, a.n, **kw)
    else:
        images = pipe(a.prompt, generator=C.generators(seed, a.n), num_images_per_prompt=a.n, **kw).images
    t_gen = time.perf_counter() - t1
    w, h = images[0].size  # the size actually made
    meta = {
        "prompt": a.prompt,
        "negative_prompt": negative or "",
        "steps": str(steps),
        "cfg": str(cfg),
        "size": f"{w}x{h}",
        "model": pipe.model_path,
        "generator": "qwenfast",
    }
    if a.controlnet:
        meta["controlnet"] = json.dumps({"nets": a.controlnet, "control": a.control, "mask": a.control_mask})
    if start is not None:
        meta.update(
            task=task, input=str(a.image), strength=str(strength), **({"mask": str(a.mask)} if a.mask else {})
        )
    C.meta_extras(meta, a, loras)
    if launch.rank() != 0:
        return 0
    if a.parallel:
        meta["parallel"] = a.parallel
    paths = C.save_pngs(images, Path(a.output), meta, seed)
    print(
        f"saved {', '.join(map(str, paths))}  ({C.seeds_text(seed, a.n)}, {steps} steps, cfg {cfg}, {w}x{h}; "
        f"load {t_load:.1f}s, generate {t_gen:.2f}s on {pipe.device})"
    )
    return 0


def cmd_edit(a: argparse.Namespace) -> int:
    from . import DEMO_EDIT_MODEL, launch
    from .pipeline.images import open_image

    _before_launch(a)
    images = [
        open_image(p, f"image[{i}]") for i, p in enumerate(a.image)
    ]  # unreadable input fails before loading
    if a.mask and len(images) != 1:
        raise ValueError(f"--mask inpaints one image; got {len(images)}")
    start, strength = _start_inputs(a, "edit-inpaint")
    single = single_file_kwargs(a)
    task, command = ("edit-inpaint", "edit --mask") if start is not None else ("edit", "edit")
    C.pipeline_class(a, task, command, single)  # the folder runs it, and the flags fit what its class can do
    if a.parallel and not launch.is_worker():
        return launch.run(cmd_edit, a)
    if a.model is None and single is None:
        if not Path(DEMO_EDIT_MODEL).is_dir():
            raise ValueError(
                "no embedded edit model in this install; pass --model /path/to/Qwen-Image-Edit-2509 "
                "(or --transformer/--vae/--text-encoder/--tokenizer single files)"
            )
        if launch.rank() == 0:
            C.note(f"no --model given, using the embedded demo edit model ({DEMO_EDIT_MODEL})")
    t0 = time.perf_counter()
    pipe = C.load_pipeline(a, task, single)  # single files: Edit-2509/2511 preprocessing
    caps = pipe.capabilities
    loras = C.setup_pipe(pipe, a)
    t_load = time.perf_counter() - t0
    w, h = C.model_size(pipe, a) or (None, None)
    if w is not None:
        C.size_note(pipe, w, h)
    steps, cfg, negative, seed = C.sampling(pipe.defaults, a)
    kw = dict(negative_prompt=negative, height=h, width=w, num_inference_steps=steps, true_cfg_scale=cfg)
    t1 = time.perf_counter()
    if start is not None:  # edit-inpainting, one call per image
        V.check_strength(strength, steps, name="--strength", steps_name="--steps")
        if w is not None:
            C.note("--size is ignored with --mask: edit inpainting follows the image's size")
        out = C.one_by_one(
            lambda **k: pipe(image=images, prompt=a.prompt, **k),
            seed,
            a.n,
            mask_image=start[1],
            strength=strength,
            **kw,
        )
    else:
        out = pipe(
            image=images, prompt=a.prompt, generator=C.generators(seed, a.n), num_images_per_prompt=a.n, **kw
        ).images
    t_gen = time.perf_counter() - t1
    ow, oh = out[0].size
    meta = {
        "prompt": a.prompt,
        "negative_prompt": negative or "",
        "steps": str(steps),
        "cfg": str(cfg),
        "size": f"{ow}x{oh}",
        "model": pipe.model_path,
        **({"mode": caps.variant} if caps.variant else {}),
        "inputs": json.dumps([str(p) for p in a.image]),
        "generator": "qwenfast",
    }
    if start is not None:
        meta.update(task="edit-inpaint", mask=str(a.mask), strength=str(strength))
    C.meta_extras(meta, a, loras)
    if launch.rank() != 0:
        return 0
    if a.parallel:
        meta["parallel"] = a.parallel
    paths = C.save_pngs(out, Path(a.output), meta, seed)
    print(
        f"saved {', '.join(map(str, paths))}  ({C.seeds_text(seed, a.n)}, {steps} steps, cfg {cfg}, {ow}x{oh}, "
        f"{caps.variant or caps.model_type}; load {t_load:.1f}s, edit {t_gen:.2f}s on {pipe.device})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .config import ConfigError
    from .loading.weights import CheckpointError

    try:
        if args.cmd in ("generate", "edit"):
            C.check_values(args)
            C.check_output(args.output)
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "edit":
            return cmd_edit(args)
        if args.cmd == "layers":
            from .cli_tasks import cmd_layers

            return cmd_layers(args)
        if args.cmd == "doctor":
            from .cli_tools import cmd_doctor

            return cmd_doctor(args)
        if args.cmd == "bench":
            from .cli_tools import cmd_bench

            return cmd_bench(args)
        if args.cmd == "export":
            from .export.cli_export import run as cmd_export

            return cmd_export(args)
        if args.cmd == "serve":
            from .server.run import serve

            return serve(args)
    except V.MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, ValueError, RuntimeError, OSError) as e:
        from .errors import ParallelError

        if (
            isinstance(e, RuntimeError)
            and not isinstance(e, ParallelError)
            and "CUDA" not in str(e)
            and "cuda" not in str(e)
        ):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
