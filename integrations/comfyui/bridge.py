"""What the qwenfast nodes need from ComfyUI, and ComfyUI's tensor formats.

Everything ComfyUI-specific is imported lazily and optionally, so the pack imports (and CI tests its
node contracts) without ComfyUI installed: inside ComfyUI the progress bar and the interrupt button
work; outside, they are no-ops.

ComfyUI's formats (as its own nodes make them):
- IMAGE: float32 (B, H, W, C) in [0, 1], C = 3.
- LATENT: {"samples": ...}. For Qwen-Image, ComfyUI's latent format is `latent_formats.Wan21`
  (16 channels, `latent_dimensions = 3`): its samplers return (B, 16, 1, h, w) (an empty 4-D
  (B, 16, h, w) latent from EmptySD3LatentImage is unsqueezed at dim 2 by
  `comfy.sample.fix_empty_latent_channels`), and samples are stored *un-normalised*, in the VAE's
  own space: `process_in` ((x - mean) / std) runs only inside the sampler and `process_out` on the
  way out, so VAEDecode decodes `samples` directly. qwenfast's packed latents are the normalised
  ones, so we convert with the model's `latents_mean` / `latents_std`.
- CONDITIONING: [[cond (B, L, D), {"attention_mask": (B, L) (absent when all tokens are real), ...}]]
  (what ComfyUI's Qwen-Image text encoder returns after dropping the prompt template).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("qwenfast.comfyui")


# ---------------------------------------------------------------------------------------------
# ComfyUI hooks (optional)


@contextlib.contextmanager
def standalone_precision() -> Iterator[None]:
    """Run qwenfast at the float32 matmul precision it has outside ComfyUI (torch's default, "highest"),
    restored after: ComfyUI sets "high" (TF32) process-wide when it is imported, and a pipeline built or
    run under it (LoRA fusion, float32 products, CUDA graphs captured then) gives bf16 images up to 17/255
    away from `qwenfast generate`'s for the same seed (measured on an H100). The nodes use it as a
    decorator on their whole bodies (loading, LoRA fusion, sampling)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)



def _comfy(module: str):
    """comfy.<module>, or None outside ComfyUI."""
    try:
        import importlib

        return importlib.import_module(f"comfy.{module}")
    except ImportError:
        return None


class StepHook:
    """The per-step callback: ComfyUI's progress bar, its interrupt button (checked between steps:
    `throw_exception_if_processing_interrupted` raises ComfyUI's InterruptProcessingException, which
    leaves the denoise loop at once), and the final latents kept for the LATENT output."""

    def __init__(self, total: int):
        utils = _comfy("utils")
        self.bar = utils.ProgressBar(total) if utils is not None and hasattr(utils, "ProgressBar") else None
        mm = _comfy("model_management")
        self.interrupt = getattr(mm, "throw_exception_if_processing_interrupted", None) if mm is not None else None
        self.last: torch.Tensor | None = None

    def check(self) -> None:
        if self.interrupt is not None:
            self.interrupt()

    def __call__(self, i: int, n: int, x: torch.Tensor) -> None:  # x: (B, N, 64) after step i
        if self.bar is not None:
            self.bar.update_absolute(i + 1, n)
        if i == n - 1:
            self.last = x.detach().clone()
        self.check()


def model_path(name: str, folder: str) -> str:
    """A file or folder name -> a path: absolute / existing paths as given, else looked up in ComfyUI's
    models folder `folder` (`folder_paths`), with a message that says where it looked."""
    name = name.strip()
    if not name:
        raise ValueError(f"empty {folder} name")
    if os.path.isabs(name) or os.path.exists(name):
        if not os.path.exists(name):
            raise ValueError(f"no such file or folder: {name}")
        return name
    try:
        import folder_paths  # ComfyUI's

        full = folder_paths.get_full_path(folder, name)
        if full:
            return full
        for base in folder_paths.get_folder_paths(folder):  # folders (diffusers models) too
            if os.path.exists(os.path.join(base, name)):
                return os.path.join(base, name)
        where = f"ComfyUI's models/{folder} folders ({', '.join(folder_paths.get_folder_paths(folder))})"
    except (ImportError, KeyError):
        where = "the working directory"
    raise ValueError(f"{name!r} not found: give an absolute path, or put it into {where}")


def file_choices(folder: str) -> list[str]:
    """Names ComfyUI knows in a models folder (for the node UIs' hints); [] outside ComfyUI."""
    try:
        import folder_paths

        return list(folder_paths.get_filename_list(folder))
    except (ImportError, KeyError):
        return []


# ---------------------------------------------------------------------------------------------
# Tensor formats


def images_to_comfy(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> ComfyUI IMAGE (B, H, W, 3) float32 on the CPU."""
    return images.permute(0, 2, 3, 1).float().cpu().contiguous()


def comfy_to_pil(image: torch.Tensor) -> list:
    """ComfyUI IMAGE (B, H, W, C) in [0, 1] -> PIL RGB images (rounded to 8 bits, as ComfyUI's savers do)."""
    from PIL import Image

    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"IMAGE must be a (batch, height, width, channels) tensor, got {getattr(image, 'shape', image)}")
    arr = (image[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    if arr.shape[-1] == 1:
        arr = arr.repeat(3, axis=-1)
    return [Image.fromarray(a, "RGB") for a in arr]


def _stats(pipe, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = pipe.vae.cfg
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1).to(like.device)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1).to(like.device)
    return mean, std  # (1, 16, 1, 1)


def packed_to_comfy(pipe, x: torch.Tensor, h: int, w: int) -> dict:
    """qwenfast packed normalised latents (B, h/2*w/2, 64) -> ComfyUI LATENT {"samples": (B, 16, 1, h, w)},
    un-normalised (VAE space), float32 on the CPU."""
    from qwenfast.pipeline.sampling import unpack_latents

    z = unpack_latents(x.float(), h, w)  # (B, 16, h, w), normalised
    mean, std = _stats(pipe, z)
    return {"samples": (z * std + mean).unsqueeze(2).cpu()}


def comfy_to_packed(pipe, samples: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """ComfyUI LATENT samples (B, 16, h, w) or (B, 16, 1, h, w), VAE space -> (packed normalised
    (B, h/2*w/2, 64), h, w)."""
    from qwenfast.pipeline.sampling import pack_latents

    z = latent_4d(samples)
    h, w = z.shape[-2:]
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even (pixel sizes multiples of 16), got {h}x{w}")
    mean, std = _stats(pipe, z)
    return pack_latents(((z.float() - mean) / std).to(pipe.dtype)), h, w


def latent_4d(samples: torch.Tensor) -> torch.Tensor:
    """(B, 16, h, w) or (B, 16, 1, h, w) -> (B, 16, h, w); clear errors for video latents or other models."""
    if not isinstance(samples, torch.Tensor):
        raise ValueError(f"LATENT['samples'] must be a tensor, got {type(samples).__name__}")
    if samples.ndim == 5:
        if samples.shape[2] != 1:
            raise ValueError(f"a Qwen-Image latent has one frame; got {samples.shape[2]} frames {tuple(samples.shape)} "
                             "(a video latent, or several images VAE-encoded as one video: encode them one by one)")
        samples = samples[:, :, 0]
    if samples.ndim != 4 or samples.shape[1] != 16:
        raise ValueError(f"expected a Qwen-Image LATENT (batch, 16, [1,] h, w), got {tuple(samples.shape)}")
    return samples


def conditioning_to_embeds(cond, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ComfyUI CONDITIONING -> (embeddings (B, L, D), mask (B, L) or None) for `prompt_embeds=`."""
    if not isinstance(cond, (list, tuple)) or not cond:
        raise ValueError(f"{where}: expected a ComfyUI CONDITIONING (a list of [tensor, dict]), got {type(cond).__name__}")
    if len(cond) > 1:
        raise ValueError(f"{where}: the qwenfast sampler takes one conditioning entry, got {len(cond)} "
                         "(combined / area conditionings are not supported)")  # fmt: skip
    emb, extra = cond[0][0], (cond[0][1] if len(cond[0]) > 1 else {})
    if extra.get("reference_latents"):
        raise ValueError(f"{where}: this conditioning carries reference images (an edit encode); use the "
                         "'QwenFast Edit' node with the images instead")  # fmt: skip
    if not isinstance(emb, torch.Tensor) or emb.ndim != 3:
        raise ValueError(f"{where}: conditioning tensor must be (batch, tokens, dim), got {getattr(emb, 'shape', emb)}")
    mask = extra.get("attention_mask")
    return emb, mask


def embeds_to_conditioning(emb: torch.Tensor, mask: torch.Tensor | None) -> list:
    """(emb (B, L, D), mask or None) -> ComfyUI CONDITIONING, tensors on the CPU, dtype kept."""
    extra: dict = {"pooled_output": None}
    if mask is not None and not bool(mask.all()):
        extra["attention_mask"] = mask.cpu()
    return [[emb.cpu(), extra]]


def display_name(path: str) -> str:
    return Path(path).name or str(path)
