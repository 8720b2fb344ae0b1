"""Inpainting: `QwenImageInpaintPipeline` (text-to-image models) and `QwenImageEditInpaintPipeline`
(edit models), with diffusers 0.42.1's arguments and images (`pipeline_qwenimage_inpaint.py`,
`pipeline_qwenimage_edit_inpaint.py`).

Mask semantics are diffusers': white (>= 50% grey after the resize) = repaint, black = keep; soft
edges are binarised at half grey, as diffusers' mask processor does. Inpainting is img2img
(`img2img.py`: strength -> first step, noised image latents as the start) plus one per-step hook of
the denoise core: after each step the kept region is put back at the next noise level
(`img2img.MaskBlend`). Edit inpainting also feeds the image's latents as the reference tokens, as
the edit model expects. diffusers' `masked_image_latents` is accepted and unused (diffusers
computes it but its loop never reads it); `padding_mask_crop` is not supported.
"""

from __future__ import annotations

import torch

from .common import QwenImageOutput, as_prompt_list, negative_prompts
from .edit import QwenImageEditPipeline, load_images
from .img2img import (
    ImageLatents,
    QwenImageImg2ImgPipeline,
    check_strength,
    image_tensor,
    inpaint_start,
    latent_mask,
    load_masks,
    tile_rows,
)
from .sampling import StepCallback, TextCond, pack_latents
from .text_to_image import log


def _no_crop(padding_mask_crop) -> None:
    if padding_mask_crop is not None:
        raise ValueError("`padding_mask_crop` is not supported by qwenfast; crop the image and the mask to the "
                         "region first, inpaint, and paste the result back")  # fmt: skip


class QwenImageInpaintPipeline(QwenImageImg2ImgPipeline):
    """Inpainting with a text-to-image model: `pipe(prompt, image=im, mask_image=m, strength=0.85)`.

    `mask_image`: white = repaint, black = keep (PIL / path / uint8 array, or a list matching the
    images); it is resized to the output size like the image. The output is height x width (default:
    the model's default size, as diffusers).
    """

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        image=None,
        mask_image=None,
        masked_image_latents=None,
        height: int | None = None,
        width: int | None = None,
        padding_mask_crop: int | None = None,
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
        _no_crop(padding_mask_crop)
        return self._img2img(prompt, negative_prompt, true_cfg_scale, image, load_masks(mask_image), height, width,
                             strength, num_inference_steps, sigmas, num_images_per_prompt, generator, latents,
                             output_type, max_sequence_length, scheduler_overrides, callback)  # fmt: skip


class QwenImageEditInpaintPipeline(QwenImageEditPipeline):
    """Inpainting with an edit model: `pipe(image, "make it a cat", mask_image=m, strength=1.0)`.

    One image; the output follows its aspect at the model's area (~1024²), as diffusers (`height` and
    `width` are ignored there too). On Edit v1 folders this is diffusers' pipeline exactly; on
    Edit-2509/2511 folders the prompt and reference image follow those models' preprocessing
    ("Picture 1:", VL image at ~384²), which diffusers has no inpainting pipeline for.
    """

    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width): the image's aspect at the model's VAE area, whatever height/width say."""
        return super().output_size({"image": call_args["image"]})

    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        mask_image=None,
        masked_image_latents=None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        padding_mask_crop: int | None = None,
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
        _no_crop(padding_mask_crop)
        if prompt is None:
            raise ValueError("`prompt` is required (the edit instruction for the masked region)")
        if image is None:
            raise ValueError("`image` is required (the picture to inpaint)")
        images, masks = load_images(image), load_masks(mask_image)
        if len(images) != 1 or len(masks) != 1:
            raise ValueError(f"edit inpainting takes exactly 1 image and 1 mask, got {len(images)} and {len(masks)}")
        if latents is not None:  # diffusers 0.42.1 fails on it too
            raise ValueError("`latents` is not supported for inpainting; give `generator` (a seed) instead")
        vl_images, vae_in, _ = self.prepare_images(images)
        out_h, out_w = self.output_size({"image": images})
        if (height is not None and height != out_h) or (width is not None and width != out_w):
            log.info("edit inpainting follows the image's size (%dx%d); height/width are ignored", out_w, out_h)
        d = self.defaults
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        prompts = as_prompt_list(prompt, "prompt")
        n = num_images_per_prompt
        h, w = self._check(out_h, out_w, steps, n, output_type, max_sequence_length, sigmas)
        check_strength(strength, len(sigmas) if sigmas is not None else steps)
        B = len(prompts) * n
        if isinstance(generator, list) and len(generator) != B:
            raise ValueError(f"got {len(generator)} generators for a batch of {B} images")
        negs = negative_prompts(prompts, negative_prompt)
        do_cfg = cfg_scale > 1 and negs is not None
        cond = TextCond(*self.encode_edit_prompt(prompts, vl_images, n))
        uncond = TextCond(*self.encode_edit_prompt(negs, vl_images, n)) if do_cfg else None
        z = ImageLatents.encode(self, image_tensor(vae_in, 8 * h, 8 * w), generator)  # (1, 16, h, w): a sample
        packed = pack_latents(tile_rows(z, B, "images"))  # the reference tokens and the kept region's target
        mask = latent_mask(masks, h, w, B, self.device, self.dtype)
        return self._generate(B=B, h=h, w=w, cond=cond, uncond=uncond, cfg_scale=cfg_scale, steps=steps,
                              generator=generator, latents=None, output_type=output_type, sigmas=sigmas,
                              scheduler_overrides=scheduler_overrides, callback=callback,
                              ref=(packed, [(1, h // 2, w // 2)]), start=inpaint_start(packed, mask, strength))  # fmt: skip
