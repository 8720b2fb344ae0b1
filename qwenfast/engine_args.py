"""The command line's engine switches: ONE argparse group for `generate`, `edit` and `serve`.

Why here and not in options.py: `EngineOptions` is used by every layer and imports nothing but the
standard library and `errors`; the flags, their help and their defaults belong to the front ends. This
module sits with them (the server may not import cli*.py, so neither front end owns it) and turns the
flags into an `EngineOptions` over the environment's defaults. argparse only; no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import validation as V
from .config import PRESETS, TURBO_SIGMAS
from .options import ATTENTION, CACHE_PRESETS, KERNELS, OFFLOAD, WEIGHTS, EngineOptions

__all__ = [
    "positive_int",
    "add_engine_arguments",
    "engine_options_from_args",
    "check_parallel_args",
    "engine_notes",
    "model_heads",
    "note",
    "on_cpu",
]


def positive_int(s: str) -> int:
    """argparse type: a whole number >= 1, with a message that says what was wrong."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_engine_arguments(parser: argparse.ArgumentParser, *, cuda_graphs_default: bool | None = None) -> None:
    """--device --dtype --offload --fp8 --cuda-graphs/--no-cuda-graphs --kernels --attention --preset.

    `cuda_graphs_default`: None = the options' default (on; $QWENFAST_CUDA_GRAPHS); the server passes
    False (every new prompt length or batch size would be a new capture).
    """
    g = parser.add_argument_group("engine (how it runs: the same switches for generate, edit and serve)")
    g.add_argument("--device", default=None, help="cuda | cpu | cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument(
        "--offload",
        choices=list(OFFLOAD),
        default=None,
        help="smaller GPUs: model = text encoder on the GPU only while encoding; blocks = also stream "
        "the transformer blocks that do not fit --offload-budget from host memory",
    )
    g.add_argument(
        "--offload-budget",
        type=float,
        default=None,
        metavar="GIB",
        help="with --offload blocks: GPU memory to plan for; blocks that fit stay resident, the rest "
        "stream (default: the free GPU memory)",
    )
    g.add_argument(
        "--vram",
        type=float,
        default=None,
        metavar="GIB",
        help="plan for a card with this much memory: offload mode and budget and the VAE's tiling follow "
        "(`qwenfast doctor --vram GIB` prints the plan; default: the free GPU memory)",
    )
    g.add_argument(
        "--weights",
        choices=list(WEIGHTS),
        default=None,
        help="the transformer blocks' weight format: bf16 (default), fp8, int8, or auto = this card's "
        "fastest 8-bit format (FP8 from Ada on, INT8 on Ampere; lossy)",
    )
    g.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 e4m3 GEMMs in the transformer blocks (Hopper/Ada GPUs): faster, not bitwise diffusers",
    )
    g.add_argument(
        "--int8",
        action="store_true",
        help="INT8 W8A8 GEMMs in the transformer blocks (the fast precision of Ampere / GeForce cards): "
        "lossy, not with --fp8",
    )
    g.add_argument(
        "--cuda-graphs",
        dest="cuda_graphs",
        action="store_true",
        default=cuda_graphs_default,
        help="replay the transformer as CUDA graphs"
        + (" (default: on)" if cuda_graphs_default is None else " (default: off for the server)"),
    )
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run eagerly")
    g.add_argument(
        "--graph-slots",
        type=positive_int,
        default=None,
        metavar="N",
        help="transformer graphs kept captured, least recently used out first (default 8; a server's "
        "mixed sizes and batches hold more)",
    )
    g.add_argument(
        "--text-bucket",
        type=int,
        default=None,
        metavar="N",
        help="pad prompts to a multiple of N tokens so one CUDA graph serves a bucket (0: off; `serve "
        "--cuda-graphs` picks 64 where FlashAttention-3 makes the padding free)",
    )
    g.add_argument(
        "--kernels",
        choices=list(KERNELS),
        default=None,
        help="fused-op backend (default: $QWENFAST_KERNELS or auto)",
    )
    g.add_argument(
        "--attention",
        choices=list(ATTENTION),
        default=None,
        help="attention backend (default: $QWENFAST_ATTENTION or auto; fp8: 8-bit, lossy)",
    )
    g.add_argument(
        "--cache",
        choices=["off", *CACHE_PRESETS],
        default=None,
        help="step cache: skip the middle blocks on some steps (lossy; README 'Step caching' has the "
        "measured quality; default off)",
    )
    g.add_argument(
        "--parallel",
        default=None,
        metavar="LAYOUT",
        help="several GPUs for one image: 'cfg=2', 'ulysses=2', 'cfg=2,ulysses=2' (one process per GPU, "
        "started for you; --device cpu: CPU processes over gloo)",
    )
    g.add_argument(
        "--preset",
        choices=list(dict.fromkeys([*PRESETS, *TURBO_SIGMAS])),
        default=None,
        help="sampling recipe for distilled LoRAs (steps, cfg, scheduler shift; Qwen-Image-2.1: turbo-8 "
        "and turbo-4 sigma schedules); --steps/--cfg still win",
    )


def engine_options_from_args(a: argparse.Namespace, **extra: Any) -> EngineOptions:
    """EngineOptions from `add_engine_arguments`' flags over the environment's defaults. `--fp8` is an
    option of the load: the transformer streams in as FP8 (LoRAs then run beside the FP8 GEMMs)."""
    if getattr(a, "fp8", False):
        extra.setdefault("fp8", True)
    if getattr(a, "int8", False):
        extra.setdefault("int8", True)
    if getattr(a, "offload_budget", None) is not None:
        extra.setdefault("offload_budget", a.offload_budget)
    for flag, field in (
        ("vram", "vram_gib"),
        ("weights", "weights"),
        ("graph_slots", "graph_slots"),
        ("text_bucket", "text_bucket"),
    ):
        if getattr(a, flag, None) is not None:
            extra.setdefault(field, getattr(a, flag))
    return EngineOptions.from_env(
        offload=a.offload,
        cuda_graphs=a.cuda_graphs,
        kernels=a.kernels,
        attention=a.attention,
        cache=getattr(a, "cache", None),
        parallel=getattr(a, "parallel", None),
        **extra,
    )


# ---------------------------------------------------------------------------------------------
# checks of the engine flags before anything loads (the CLI and `serve` alike)


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


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
        note(
            f"--preset {a.preset} is the sampling recipe of a distilled LoRA (few steps, no CFG); without "
            "--lora the base model runs it and gives blurry images: add --lora PATH (e.g. the matching "
            "Lightning / turbo LoRA), or leave --preset out"
        )
    weights = getattr(a, "weights", None)
    fp8 = bool(a.fp8) or weights == "fp8"  # --weights fp8 is --fp8
    int8 = bool(getattr(a, "int8", False)) or weights == "int8"
    if not on_cpu(a):
        if fp8:
            import torch

            from .runtime.arch import NONE, arch

            card = arch(torch.device(a.device) if a.device else None)
            if card is not NONE and not card.fp8_gemm:
                note(
                    f"FP8 weights on {card.name} ({card.family}, no FP8 tensor cores): the FP8 weights stay in memory "
                    "(half of bf16) and each layer multiplies in bf16 after dequantising them (weight-only); "
                    "faster here: --int8"
                )
        return
    if a.offload not in (None, "none"):
        note(
            f"--offload {a.offload} does nothing on the CPU (the weights already live in host memory); "
            "running without it"
        )
        a.offload, a.offload_budget = None, None
    if getattr(a, "vram", None) is not None:
        note(
            f"--vram {a.vram:g} does nothing on the CPU (there is no GPU memory to plan for); running without it"
        )
        a.vram = None
    if weights == "auto":
        note("--weights auto on the CPU keeps bf16 (no 8-bit matrix units to gain from)")
    if int8:
        note(
            "--int8 on the CPU is emulated (the codes are multiplied in fp32): the images change as with INT8 "
            "on a GPU, but nothing gets faster"
        )
    if fp8:
        note(
            "--fp8 on the CPU is emulated (the weights are rounded to FP8 e4m3 and multiplied in fp32): the "
            "images change as with FP8 on a GPU, but nothing gets faster; FP8 speed needs an Ada/Hopper GPU"
        )


def model_heads(model: str | None, transformer_file: str | None = None) -> int | None:
    """The attention head count from `MODEL/transformer/config.json` (the embedded demo when None);
    None when it cannot be read before loading (single files, a folder without that config)."""
    if transformer_file is not None:
        return None
    from .about import DEMO_MODEL

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
        raise ValueError(
            f"--parallel {a.parallel}: {e}" if not str(e).startswith("--parallel") else str(e)
        ) from None
    V.check_parallel(layout.cfg, layout.ulysses, model_heads(a.model, getattr(a, "transformer", None)))
