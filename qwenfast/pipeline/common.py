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
) -> SimpleNamespace:
    """Check a diffusers folder and load its components where an offload mode wants them (offloaded
    parts on the CPU, so the GPU never holds them all). Also reads the optional qwenfast.json (`extra`:
    sampling defaults, image areas). `wrong_kind` says what to use when the folder's kind is not in
    `kinds`. `fp8`: the transformer's block Linears are quantised to FP8 while streaming in."""
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
        transformer=load_transformer(path / "transformer", cpu if offload == "blocks" else dev, dt, fp8=fp8),
        vae=load_vae(path / "vae", dev, dt),
        te=TextEncoder.from_pretrained(
            path / "text_encoder", path / "tokenizer", cpu if offload != "none" else dev, dt
        ),
        sched=load_scheduler_config(path / "scheduler"),
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
