"""`QwenImageImg2ImgPipeline`: restyle an image (diffusers' `pipeline_qwenimage_img2img.py`), plus the
pieces inpainting shares (`inpaint.py`): image and mask preprocessing, the posterior sample of the
image's latents, the strength -> start step rule.

img2img is text-to-image started part-way along the schedule: `strength` picks the first step as
diffusers' `get_timesteps` does (`t_start = int(max(N - min(N * strength, N), 0))`), the starting
latents are the image's latents noised to that step's sigma (`sampling.scale_noise`), and the rest
is the shared denoise core (`PipelineBase._generate` with a `start` hook). Reproduces diffusers 0.42.1
exactly, including where the generator's random numbers go: first the VAE posterior sample of the
image (diffusers samples, it does not take the mode), then the noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import sampling as S
from .common import QwenImageOutput, as_prompt_list, negative_prompts, randn_tensor
from .edit import load_images
from .sampling import StepCallback, TextCond
from .text_to_image import QwenImagePipeline, log


def start_step(num_steps: int, strength: float) -> int:
    """diffusers' `get_timesteps`: how many of the `num_steps` steps img2img skips for `strength`."""
    init_timestep = min(num_steps * strength, num_steps)
    return int(max(num_steps - init_timestep, 0))


def check_strength(strength: float, num_steps: int) -> None:
    """strength in [0, 1] leaving at least one step (diffusers' checks, with what to do instead)."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
        raise ValueError(f"`strength` must be a number in [0.0, 1.0], got {strength!r}")
    left = num_steps - start_step(num_steps, strength)
    if left < 1:
        raise ValueError(f"strength {strength} with {num_steps} steps leaves {left} denoising steps; raise "
                         "`strength` or `num_inference_steps`")  # fmt: skip


def image_tensor(images: list, height: int, width: int) -> torch.Tensor:
    """RGB PIL images -> (k, 3, height, width) float32 in [-1, 1]: diffusers' VaeImageProcessor
    (Lanczos resize to exactly height x width, /255, *2-1)."""
    from PIL import Image

    arr = np.stack([np.asarray(im.resize((width, height), resample=Image.LANCZOS)).astype(np.float32) / 255.0
                    for im in images])  # fmt: skip  # (k, H, W, 3)
    return torch.from_numpy(arr).permute(0, 3, 1, 2) * 2.0 - 1.0


def load_masks(mask: object) -> list:
    """Mask(s): PIL image / path / HxW or HxWxC uint8 array, or a list of them -> PIL images (any mode)."""
    from PIL import Image, UnidentifiedImageError

    if mask is None:
        raise ValueError("`mask_image` is required: white (>= 50% grey) pixels are repainted, black ones kept")
    items = mask if isinstance(mask, (list, tuple)) else [mask]
    out = []
    for i, m in enumerate(items):
        where = f"mask_image[{i}]" if isinstance(mask, (list, tuple)) else "mask_image"
        if isinstance(m, np.ndarray):
            if m.dtype != np.uint8 or m.ndim not in (2, 3) or (m.ndim == 3 and m.shape[2] not in (1, 3, 4)):
                raise ValueError(f"{where}: arrays must be HxW (or HxWx1/3/4) uint8, got {m.dtype} {m.shape}")
            m = Image.fromarray(m[..., 0] if m.ndim == 3 and m.shape[2] == 1 else m)
        elif isinstance(m, (str, Path)):
            try:
                with Image.open(m) as f:
                    f.load()
                    m = f.copy()  # its own mode: "L", "RGB" or "RGBA" (luminance is used, as diffusers does)
            except FileNotFoundError:
                raise ValueError(f"{where}: no such file {str(m)!r}") from None
            except (UnidentifiedImageError, OSError) as e:
                raise ValueError(f"{where}: {str(m)!r} is not a readable image ({e})") from None
        elif not isinstance(m, Image.Image):
            raise TypeError(f"{where} must be a PIL image, a path or a uint8 array, got {type(m).__name__}")
        out.append(m)
    if not out:
        raise ValueError("`mask_image` is an empty list")
    return out


def mask_tensor(masks: list, height: int, width: int) -> torch.Tensor:
    """Masks -> (k, 1, height, width) of 0/1: diffusers' mask processor (Lanczos resize, then greyscale,
    then binarised at 0.5), so soft edges become hard at half grey. 1 = repaint."""
    from PIL import Image

    arr = np.stack([np.asarray(m.resize((width, height), resample=Image.LANCZOS).convert("L")).astype(np.float32)
                    / 255.0 for m in masks])  # fmt: skip  # (k, H, W)
    t = torch.from_numpy(arr)[:, None]
    return (t >= 0.5).to(torch.float32)


def latent_mask(masks: list, h: int, w: int, batch: int, device, dtype) -> torch.Tensor:
    """Masks -> packed (batch, h/2 * w/2, 64) on the latent grid h x w: diffusers' `prepare_mask_latents`
    (pixel mask of 8h x 8w, nearest-neighbour down to h x w, repeated over the 16 latent channels)."""
    m = F.interpolate(mask_tensor(masks, 8 * h, 8 * w), size=(h, w)).to(device, dtype)  # (k, 1, h, w)
    return S.pack_latents(tile_rows(m, batch, "masks").repeat(1, 16, 1, 1))


def tile_rows(t: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    """k rows -> `batch` rows as diffusers repeats them (whole-batch copies); k must divide batch."""
    k = t.shape[0]
    if k > batch or batch % k:
        raise ValueError(f"{k} {what} cannot be spread over {batch} images; give 1 {what[:-1]} or one per image")
    return t if k == batch else torch.cat([t] * (batch // k))


class ImageLatents:
    """VAE latents of the input image(s), as diffusers' `_encode_vae_image` makes them: a posterior
    *sample* drawn from the caller's generator (one per image row when it is a list), normalised by
    the VAE's latents_mean / latents_std."""

    @staticmethod
    def encode(pipe, x: torch.Tensor, generator) -> torch.Tensor:
        """x (k, 3, H, W) in [-1, 1] -> (k, 16, H/8, W/8) in the pipeline's dtype."""
        vcfg = pipe.vae.cfg
        x = x.to(pipe.device, pipe.dtype)
        rows = [(x[i : i + 1], generator[i]) for i in range(x.shape[0])] if isinstance(generator, list) else [(x, generator)]
        zs = []
        with pipe._vae_resident():
            for xi, g in rows:
                mean, logvar = pipe.vae.encode(xi.to(pipe.vae_dtype))  # (r, 16, h, w) each
                noise = randn_tensor(tuple(mean.shape), g, mean.device, mean.dtype)
                zs.append(mean + torch.exp(0.5 * logvar) * noise)
        z = torch.cat(zs).to(pipe.dtype)
        mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vcfg.latents_std).view(1, -1, 1, 1).to(z.device, z.dtype)
        return (z - mean) * inv_std


class MaskBlend:
    """The per-step inpainting blend of diffusers (a `denoise` blend hook): after step i the kept
    region (mask 0) is the image's latents noised to the next sigma (clean after the last step), the
    repainted region (mask 1) is the model's. Tensors are packed (B, N, 64)."""

    def __init__(self, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor, sigmas: torch.Tensor):
        self.image, self.noise, self.mask, self.sigmas = image, noise, mask, sigmas

    def rows(self, i: int, j: int) -> MaskBlend:
        return MaskBlend(self.image[i:j], self.noise[i:j], self.mask[i:j], self.sigmas)

    def __call__(self, step: int, x: torch.Tensor) -> torch.Tensor:
        proper = self.image
        if step < len(self.sigmas) - 2:
            proper = S.scale_noise(self.image, self.sigmas[step + 1], self.noise)
        return (1 - self.mask) * proper + self.mask * x


def inpaint_start(image_latents: torch.Tensor, mask: torch.Tensor | None, strength: float):
    """The `_generate` start hook: sigmas from the strength's first step, the noised image as the first
    latents, and (with a mask) the per-step blend. image_latents, mask: packed (B, N, 64)."""

    def start(noise: torch.Tensor, sigmas: torch.Tensor):
        sig = sigmas[start_step(len(sigmas) - 1, strength) :]
        x = S.scale_noise(image_latents, sig[0], noise)
        return x, sig, None if mask is None else MaskBlend(image_latents, noise, mask, sig)

    return start


class QwenImageImg2ImgPipeline(QwenImagePipeline):
    """Image-to-image with a text-to-image model: `pipe(prompt, image=im, strength=0.6)`.

    Same arguments and images as diffusers' `QwenImageImg2ImgPipeline` (diffusers' `guidance_scale`,
    `prompt_embeds` and callbacks are not taken; `callback` is qwenfast's step callback). The image is
    resized to height x width (default: the model's default size, 1024² for Qwen-Image, as diffusers).
    """

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        image=None,
        height: int | None = None,
        width: int | None = None,
        strength: float = 0.6,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        max_sequence_length: int = 512,
        scheduler_overrides: dict | None = None,
        callback: StepCallback | None = None,
    ) -> QwenImageOutput:
        """`image`: a PIL image / path / HxWx3 uint8 array (or a list, one per image of the batch).
        `strength` in [0, 1]: how much of the schedule runs (1 = all of it: the image is ignored).
        `latents`: packed (B, N, 64) starting latents used as they are (diffusers' meaning here)."""
        return self._img2img(prompt, negative_prompt, true_cfg_scale, image, None, height, width, strength,
                             num_inference_steps, sigmas, num_images_per_prompt, generator, latents, output_type,
                             max_sequence_length, scheduler_overrides, callback)  # fmt: skip

    def _img2img(self, prompt, negative_prompt, true_cfg_scale, image, mask_image, height, width, strength, steps,
                 sigmas, n, generator, latents, output_type, max_sequence_length, scheduler_overrides,
                 callback) -> QwenImageOutput:  # fmt: skip
        """img2img (mask_image None) and inpainting: the shared body of both calls."""
        if image is None:
            raise ValueError("`image` is required (the picture to start from)")
        d = self.defaults
        height = d["height"] if height is None else height
        width = d["width"] if width is None else width
        steps = d["num_inference_steps"] if steps is None else steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        prompts = as_prompt_list(prompt, "prompt")
        h, w = self._check(height, width, steps, n, output_type, max_sequence_length, sigmas)
        check_strength(strength, len(sigmas) if sigmas is not None else steps)
        images = load_images(image)
        masks = load_masks(mask_image) if mask_image is not None else None
        B = len(prompts) * n
        if isinstance(generator, list) and len(generator) != B:
            raise ValueError(f"got {len(generator)} generators for a batch of {B} images")
        negs = negative_prompts(prompts, negative_prompt)
        do_cfg = cfg_scale > 1 and negs is not None
        if cfg_scale > 1 and negs is None:
            log.info("true_cfg_scale=%s but no negative_prompt: classifier-free guidance is off", cfg_scale)
        cond = TextCond(*self.encode_prompt(prompts, n, max_sequence_length))
        uncond = TextCond(*self.encode_prompt(negs, n, max_sequence_length)) if do_cfg else None
        if latents is not None and masks is not None:  # diffusers 0.42.1 fails on it too
            raise ValueError("`latents` is not supported for inpainting; give `generator` (a seed) instead")
        if latents is None:  # diffusers: given latents are the start point, and the image is not encoded
            z = ImageLatents.encode(self, image_tensor(images, 8 * h, 8 * w), generator)  # (k, 16, h, w)
            packed = S.pack_latents(tile_rows(z, B, "images"))
            mask = None if masks is None else latent_mask(masks, h, w, B, self.device, self.dtype)
            start = inpaint_start(packed, mask, strength)
        else:
            start = _sliced(strength)
        return self._generate(B=B, h=h, w=w, cond=cond, uncond=uncond, cfg_scale=cfg_scale, steps=steps,
                              generator=generator, latents=latents, output_type=output_type, sigmas=sigmas,
                              scheduler_overrides=scheduler_overrides, callback=callback, start=start)  # fmt: skip


def _sliced(strength: float):
    """Start hook for caller-given latents: only the schedule is cut, the latents are used as they are."""

    def start(x: torch.Tensor, sigmas: torch.Tensor):
        return x, sigmas[start_step(len(sigmas) - 1, strength) :], None

    return start
