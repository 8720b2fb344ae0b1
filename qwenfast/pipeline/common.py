"""Small pieces every pipeline shares: devices and dtypes, folder loading, noise, prompt lists, output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import CheckpointError
from ..loading.diffusers_folder import inspect_folder, load_scheduler_config, load_transformer, load_vae
from ..models.text_encoder import TextEncoder
from ..options import OFFLOAD, EngineOptions

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# The embedded default: a small trained Qwen-Image for 128x128 pictures of shapes (tools/train_demo.py).
DEFAULT_MODEL = ASSETS / "demo-t2i"
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
Device = str | torch.device | None  # None: CUDA when there is one
DType = str | torch.dtype | None  # "bf16" | "fp16" | "fp32" | a torch dtype; None: bf16 on CUDA, fp32 on CPU
Generators = torch.Generator | list[torch.Generator] | None
EMBEDDED_NOTE = (
    "note: no --model given, using the embedded demo model ({path}): a small Qwen-Image trained on 128x128 "
    "pictures of coloured shapes (prompts like 'a small red star at the top left, white background'); "
    "pass --model /path/to/Qwen-Image for real images."
)


@dataclass
class QwenImageOutput:
    images: Any  # list[PIL.Image] | np.ndarray (B, H, W, 3) in [0, 1] | torch.Tensor | packed latents
    info: dict = field(default_factory=dict)


def load_folder(
    path: str | Path,
    device: Device,
    dtype: DType,
    offload: str,
    kinds: tuple[str, ...],
    wrong_kind: str,
    fp8: bool = False,
    options: EngineOptions | None = None,
) -> SimpleNamespace:
    """Check a diffusers folder and load its components where an offload mode wants them (offloaded
    parts on the CPU, so the GPU never holds them all). Also reads the optional qwenfast.json (`extra`:
    sampling defaults, image areas). `wrong_kind` says what to use when the folder's kind is not in
    `kinds`. `fp8`: the transformer's block Linears are quantised to FP8 while streaming in.
    `options`: the engine options, planned for memory before anything loads (`plan_options`: their
    `vram_gib`, else the free GPU memory; their offload and fp8 then win over the arguments); the
    planned options come back as `.options`."""
    if options is not None:
        options, _ = _plan_folder(options, Path(path), resolve_device(device), dtype)
        offload, fp8 = options.offload, options.fp8
    if offload not in OFFLOAD:
        raise ValueError(f"offload must be one of {OFFLOAD}, got {offload!r}")
    path = Path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kind, problems = inspect_folder(path)
    if problems:
        raise CheckpointError(
            f"{path} is not a complete Qwen-Image model folder:\n  - " + "\n  - ".join(problems)
        )
    if kind not in kinds:
        raise CheckpointError(f"{path} is a Qwen-Image {kind} model; {wrong_kind}")
    cpu = torch.device("cpu")
    extra = json.loads((path / "qwenfast.json").read_text()) if (path / "qwenfast.json").is_file() else {}
    return SimpleNamespace(
        path=path,
        device=dev,
        kind=kind,
        extra=extra,
        options=options,
        transformer=load_transformer(path / "transformer", cpu if offload == "blocks" else dev, dt, fp8=fp8),
        vae=load_vae(path / "vae", dev, dt),
        te=TextEncoder.from_pretrained(
            path / "text_encoder", path / "tokenizer", cpu if offload != "none" else dev, dt
        ),
        sched=load_scheduler_config(path / "scheduler"),
    )


def plan_before_load(
    opts: EngineOptions, sizes_of: Any, device: torch.device, dtype: DType, defaults: dict | None = None
) -> tuple[EngineOptions, Any]:
    """`plan_options` before a model loads (`sizes_of()`: its `ModelSizes` from file headers), for a call
    of the model's default size (`defaults`: its qwenfast.json defaults; 1024² with CFG otherwise)."""
    if opts.vram_gib is None and opts.weights != "auto" and device.type != "cuda":
        return opts, None
    d = {"height": 1024, "width": 1024, "true_cfg_scale": 4.0, **(defaults or {})}
    return plan_options(
        opts,
        sizes_of,
        device,
        height=int(d["height"]),
        width=int(d["width"]),
        cfg=float(d.get("true_cfg_scale") or 1) > 1,
        free_memory=True,
        dtype=resolve_dtype(dtype, device),
    )


def _plan_folder(
    opts: EngineOptions, path: Path, device: torch.device, dtype: DType
) -> tuple[EngineOptions, Any]:
    """`plan_before_load` for a model folder (sizes from its safetensors headers)."""
    from ..loading.sizes import folder_sizes

    extra = json.loads((path / "qwenfast.json").read_text()) if (path / "qwenfast.json").is_file() else {}
    return plan_before_load(
        opts, lambda: folder_sizes(path, resolve_dtype(dtype, device)), device, dtype, extra.get("defaults")
    )


def engine_options(options: EngineOptions | None, shortcuts: dict[str, Any]) -> EngineOptions:
    """`options` (default: from the environment) with keyword shortcuts (None = not given) applied."""
    base = options if options is not None else EngineOptions.from_env()
    given = {k: v for k, v in shortcuts.items() if v is not None}
    return base.replace(**given) if given else base


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    return dev


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}  # fmt: skip


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def randn_tensor(
    shape: tuple[int, ...], generator: Generators, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """diffusers' `randn_tensor`: draw where the generator lives (CPU generators draw on CPU), then move.

    A list of generators draws one sample each. Same generator + same shape/dtype = same noise as diffusers.
    """
    rand_device = device
    if generator is not None:
        gdev = (generator[0] if isinstance(generator, list) else generator).device
        if gdev.type != device.type:
            if gdev.type != "cpu":
                raise ValueError(f"cannot draw a {device} tensor from a {gdev.type} generator")
            rand_device = torch.device("cpu")
    if isinstance(generator, list) and len(generator) == 1:
        generator = generator[0]
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]} images")
        one = (1, *shape[1:])
        return torch.cat(
            [torch.randn(one, generator=g, device=rand_device, dtype=dtype) for g in generator]
        ).to(device)
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype).to(device)


def as_prompt_list(prompt: str | list[str], name: str) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError(f"`{name}` is an empty list; give at least one prompt")
    raise TypeError(f"`{name}` must be a string or a list of strings, got {type(prompt).__name__}")


def negative_prompts(prompts: list[str], negative_prompt: str | list[str] | None) -> list[str] | None:
    """The negative prompt(s) as a list matching `prompts` (one is repeated), or None."""
    if negative_prompt is None:
        return None
    negs = as_prompt_list(negative_prompt, "negative_prompt")
    if len(negs) == 1 and len(prompts) > 1:
        negs = negs * len(prompts)
    if len(negs) != len(prompts):
        raise ValueError(f"got {len(negs)} negative prompts for {len(prompts)} prompts")
    return negs


def postprocess(image: torch.Tensor, output_type: str):
    """(B, 3, H, W) in [-1, 1] -> PIL list, (B, H, W, 3) float32 array in [0, 1], or a [0, 1] tensor."""
    image = (image * 0.5 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return image
    arr = image.cpu().permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return arr
    from PIL import Image

    return [Image.fromarray(a) for a in (arr * 255).round().astype("uint8")]


def plan_options(
    opts: EngineOptions,
    sizes_of: Any,
    device: torch.device,
    *,
    height: int = 1024,
    width: int = 1024,
    cfg: bool = True,
    eight_bit_sizes: bool = False,
    table_bytes: int = 0,
    current_offload: str = "none",
    free_memory: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[EngineOptions, Any]:
    """`opts` with `weights="auto"` made concrete for `device`'s card and, when `vram_gib` is set (or,
    with `free_memory`, when the model would not fit the free GPU memory), the memory plan's offload
    mode and budget applied (runtime/tiers.py). `sizes_of()`: the model's `ModelSizes` (called only
    when a plan is made). Returns (options, the `VramPlan` or None). An offload already in force
    (`current_offload`) is kept when the plan wants less: offload goes one way."""
    from ..errors import OptionsError
    from ..runtime.arch import arch
    from ..runtime.memory import GiB, default_budget
    from ..runtime.tiers import TooSmall, plan, weights_for

    card = arch(device)
    if opts.weights == "auto":
        opts = opts.replace(weights="fp8" if opts.fp8 else "int8" if opts.int8 else weights_for(card, "auto"))
    vram = opts.vram_gib
    if (
        vram is None
        and free_memory
        and device.type == "cuda"
        and opts.offload == "none"
        and opts.parallel is None
    ):
        vram = default_budget(device, fraction=1.0) / GiB
    if vram is None:
        return opts, None
    fmt = "fp8" if opts.fp8 else "int8" if opts.int8 else "bf16"
    try:
        p = plan(
            sizes_of(),
            vram,
            weights=fmt,
            card=card,
            height=height,
            width=width,
            cfg=cfg,
            eight_bit_sizes=eight_bit_sizes,
            table_bytes=table_bytes,
            dtype=dtype,
            graphs=opts.cuda_graphs and device.type == "cuda",
        )
    except TooSmall as e:
        raise OptionsError(f"vram_gib={vram:g}: {e}") from None
    if opts.vram_gib is None and p.offload == "none":
        return opts, None  # it fits as asked: nothing changes
    changes = p.options()
    if OFFLOAD.index(current_offload) > OFFLOAD.index(changes["offload"]):
        changes.update(offload=current_offload, offload_budget=vram if current_offload == "blocks" else None)
    if changes["offload"] == "blocks" and opts.cache not in (None, "off"):
        raise OptionsError(
            f"{vram:g} GiB needs the transformer blocks streamed from host memory, and the step cache does not run "
            "with streamed blocks: drop the cache option, or plan for more memory (vram_gib / --vram)"
        )
    if opts.vram_gib is None:
        import warnings

        warnings.warn(
            f"the model does not fit the {vram:.1f} GiB of free GPU memory: offload='{changes['offload']}' "
            f"({p.resident_blocks} of {p.num_blocks} transformer blocks resident); set vram_gib / --vram to plan "
            "for another amount",
            stacklevel=3,
        )
    return opts.replace(**changes), p
