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

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import sampling as S
from .common import QwenImageOutput, randn_tensor
from .diffusers_compat import DiffusersCall
from .images import IMAGE_LATENTS, MASK, open_image, preprocess
from .sampling import StepCallback
from .tasks import Capabilities
from .text_to_image import QwenImagePipeline


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
        raise ValueError(
            f"strength {strength} with {num_steps} steps leaves {left} denoising steps; raise "
            "`strength` or `num_inference_steps`"
        )


def image_tensor(images: list, height: int, width: int) -> torch.Tensor:
    """RGB PIL images -> (k, 3, height, width) float32 in [-1, 1]: diffusers' VaeImageProcessor
    (Lanczos resize to exactly height x width, /255, *2-1)."""
    from PIL import Image

    arr = np.stack(
        [
            np.asarray(im.resize((width, height), resample=Image.LANCZOS)).astype(np.float32) / 255.0
            for im in images
        ]
    )  # (k, H, W, 3)
    return torch.from_numpy(arr).permute(0, 3, 1, 2) * 2.0 - 1.0


def load_masks(mask: object) -> list:
    """Mask(s) -> a list, paths opened as PIL images (the CLI's `--mask`); arrays, tensors and PIL
    images stay as they are (`mask_tensor` reads them as diffusers does)."""
    if mask is None:
        raise ValueError(
            "`mask_image` is required: white (>= 50% grey) pixels are repainted, black ones kept"
        )
    items = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if not items:
        raise ValueError("`mask_image` is an empty list")
    many = isinstance(mask, (list, tuple))
    return [open_image(m, f"mask_image[{i}]" if many else "mask_image") for i, m in enumerate(items)]


def mask_tensor(mask: object, height: int, width: int) -> torch.Tensor:
    """A mask (PIL / path / array / tensor, or a list; see `images.py`) -> (k, 1, height, width) of 0/1:
    diffusers' mask processor (resize, greyscale, binarised at 0.5: soft edges become hard at half
    grey, and a 0/1 or 0/255 array both work). 1 = repaint."""
    if mask is None:
        raise ValueError(
            "`mask_image` is required: white (>= 50% grey) pixels are repainted, black ones kept"
        )
    m = preprocess(mask, height, width, MASK, where="mask_image")
    if m.shape[1] != 1:
        raise ValueError(
            f"mask_image has {m.shape[1]} channels after diffusers' mask processing; give one channel"
        )
    return m


def latent_mask(mask: torch.Tensor, h: int, w: int, batch: int, device, dtype) -> torch.Tensor:
    """A pixel mask (k, 1, 8h, 8w) from `mask_tensor` -> packed (batch, h/2 * w/2, 64) on the latent grid
    h x w: diffusers' `prepare_mask_latents` (nearest-neighbour down to h x w, 16 latent channels)."""
    m = F.interpolate(mask, size=(h, w)).to(device, dtype)  # (k, 1, h, w)
    return S.pack_latents(tile_rows(m, batch, "masks").repeat(1, 16, 1, 1))


def tile_rows(t: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    """k rows -> `batch` rows as diffusers repeats them (whole-batch copies); k must divide batch."""
    k = t.shape[0]
    if k > batch or batch % k:
        raise ValueError(
            f"{k} {what} cannot be spread over {batch} images; give 1 {what[:-1]} or one per image"
        )
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
        rows = (
            [(x[i : i + 1], generator[i]) for i in range(x.shape[0])]
            if isinstance(generator, list)
            else [(x, generator)]
        )
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

    diffusers' `QwenImageImg2ImgPipeline` arguments (in its order) and images; `callback` is
    qwenfast's step callback. The image is resized to height x width (default: the model's default
    size, 1024² for Qwen-Image, as diffusers); arrays and tensors mean what they mean in diffusers
    (`images.py`), and a (k, 16, h, w) tensor is taken as the image's latents, as diffusers does.
    """

    CAPABILITIES = Capabilities("qwen-image", tasks=("img2img",), max_images=1, single_files=True)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        image=None,
        height: int | None = None,
        width: int | None = None,
        strength: float = 0.6,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
        max_sequence_length: int = 512,
        scheduler_overrides: dict | None = None,
        callback: StepCallback | None = None,
    ) -> QwenImageOutput | tuple:
        """`image`: PIL image / path / array / tensor, or a list (one per image of the batch).
        `strength` in [0, 1]: how much of the schedule runs (1 = all of it: the image is ignored).
        `latents`: packed (B, N, 64) starting latents used as they are (diffusers' meaning here)."""
        return self._img2img({k: v for k, v in locals().items() if k != "self"})

    def _img2img(self, a: dict, mask_image=None, inpaint: bool = False) -> QwenImageOutput | tuple:
        """img2img and (`inpaint`) inpainting: the shared body of both calls; `a`: the call's arguments."""
        if a["image"] is None:
            raise ValueError("`image` is required (the picture to start from)")
        d = self.defaults
        height = d["height"] if a["height"] is None else a["height"]
        width = d["width"] if a["width"] is None else a["width"]
        steps = d["num_inference_steps"] if a["num_inference_steps"] is None else a["num_inference_steps"]
        cfg_scale = d["true_cfg_scale"] if a["true_cfg_scale"] is None else a["true_cfg_scale"]
        n, sigmas, strength, generator = (
            a["num_images_per_prompt"],
            a["sigmas"],
            a["strength"],
            a["generator"],
        )
        h, w = self._check(height, width, steps, n, a["output_type"], a["max_sequence_length"], sigmas)
        check_strength(strength, len(sigmas) if sigmas is not None else steps)
        px = preprocess(a["image"], height, width, IMAGE_LATENTS, where="image")  # (k, 3, 8h, 8w) or latents
        given_z = px.shape[1] == IMAGE_LATENTS.latent_channels
        if given_z and (inpaint or tuple(px.shape[-2:]) != (h, w)):
            raise ValueError(
                f"a {IMAGE_LATENTS.latent_channels}-channel image tensor is taken as image latents, which "
                f"img2img takes at the latent size {h}x{w} only; give the picture itself"
                + (" for inpainting" if inpaint else "")
            )
        if not given_z and px.shape[1] != 3:
            raise ValueError(f"image has {px.shape[1]} channels; give RGB pictures (3 channels)")
        mask = mask_tensor(mask_image, height, width) if inpaint else None  # (k, 1, 8h, 8w)
        if a["latents"] is not None and inpaint:  # diffusers 0.42.1 fails on it too
            raise ValueError("`latents` is not supported for inpainting; give `generator` (a seed) instead")
        with DiffusersCall(
            self,
            a["guidance_scale"],
            a["attention_kwargs"],
            a["callback_on_step_end"],
            a["callback_on_step_end_tensor_inputs"],
        ) as call:
            cond, uncond, k = self._prompt_conds(
                a["prompt"],
                a["negative_prompt"],
                cfg_scale,
                n,
                a["max_sequence_length"],
                a["prompt_embeds"],
                a["prompt_embeds_mask"],
                a["negative_prompt_embeds"],
                a["negative_prompt_embeds_mask"],
            )
            B = k * n
            if isinstance(generator, list) and len(generator) != B:
                raise ValueError(f"got {len(generator)} generators for a batch of {B} images")
            if (
                a["latents"] is None
            ):  # diffusers: given latents are the start point, and the image is not encoded
                z = (
                    px.to(self.device, self.dtype) if given_z else ImageLatents.encode(self, px, generator)
                )  # (k, 16, h, w)
                packed = S.pack_latents(tile_rows(z, B, "images"))
                lmask = None if mask is None else latent_mask(mask, h, w, B, self.device, self.dtype)
                start = inpaint_start(packed, lmask, strength)
            else:
                start = _sliced(strength)
            out = self._generate(
                B=B,
                h=h,
                w=w,
                cond=cond,
                uncond=uncond,
                cfg_scale=cfg_scale,
                steps=steps,
                generator=generator,
                latents=a["latents"],
                output_type=a["output_type"],
                sigmas=sigmas,
                scheduler_overrides=a["scheduler_overrides"],
                callback=a["callback"],
                start=start,
                step_end=call.step_end,
            )
        return call.output(out, a["return_dict"])


def _sliced(strength: float):
    """Start hook for caller-given latents: only the schedule is cut, the latents are used as they are."""

    def start(x: torch.Tensor, sigmas: torch.Tensor):
        return x, sigmas[start_step(len(sigmas) - 1, strength) :], None

    return start
