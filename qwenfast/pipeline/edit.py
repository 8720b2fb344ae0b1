"""`QwenImageEditPipeline`: Qwen-Image-Edit (v1), Edit-2509 and Edit-2511, diffusers' images.

One class for all three, because they differ only in preprocessing, which `model_index.json`
names: `QwenImageEditPipeline` (v1, mode "edit") takes one image, seen by the VL encoder and the
VAE at ~1024² area; `QwenImageEditPlusPipeline` (2509 and 2511, mode "edit-plus") takes 1-3 images,
each announced as "Picture N:" in the prompt, seen by the VL encoder at ~384² area and by the VAE
at ~1024². Edit-2511 differs only in its transformer config (`zero_cond_t`: reference tokens are
modulated with t=0), which the model handles. The reference latents ride after the noise tokens
through the same denoise core as text-to-image (`sampling.denoise`, via `PipelineBase._generate`).

Preprocessing reproduces diffusers exactly: sides from `calculate_dimensions` (area target, ratio
kept, multiples of 32), PIL Lanczos resizes, [-1, 1] VAE input, VAE mode (not a sample), the
output size following the last image (first for v1). No torchvision: the Qwen2-VL image processor
runs in PIL and the `<|image_pad|>` tokens are expanded in `TextEncoder.encode_with_images`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from ..models.text_encoder import EDIT_DROP, EDIT_TEMPLATE, VISION_SLOT, TextEncoder, image_digest
from ..options import EngineOptions
from . import sampling as S
from .common import (
    ASSETS,
    Device,
    DType,
    QwenImageOutput,
    engine_options,
    load_folder,
)
from .diffusers_compat import DiffusersCall, loading_args
from .sampling import StepCallback
from .tasks import Capabilities
from .text_to_image import QwenImagePipeline

DEFAULT_EDIT_MODEL = ASSETS / "demo-edit"
MODES = ("edit", "edit-plus")
MAX_IMAGES = {"edit": 1, "edit-plus": 3}
VL_AREA = {"edit": 1024 * 1024, "edit-plus": 384 * 384}
VAE_AREA = 1024 * 1024

# Qwen2-VL's image processor settings (what Qwen-Image-Edit's processor/ folder holds), for models
# loaded from single files, which come without a processor folder.
QWEN2VL_IMAGE_PROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "merge_size": 2, "patch_size": 14, "resample": 3, "rescale_factor": 1 / 255,
    "size": {"longest_edge": 12845056, "shortest_edge": 3136}, "temporal_patch_size": 2,
}  # fmt: skip


def _image_processor_class():
    try:  # transformers 5: the PIL backend, no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor as cls
    return cls


def load_image_processor(folder: Path | None = None):
    cls = _image_processor_class()
    if folder is None:
        return cls(**QWEN2VL_IMAGE_PROCESSOR)
    if not (Path(folder) / "preprocessor_config.json").is_file():
        raise CheckpointError(
            f"missing file {Path(folder) / 'preprocessor_config.json'} (the edit model's image processor)"
        )
    return cls.from_pretrained(str(folder))


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """(width, height) with about `target_area` pixels and aspect `ratio`, each a multiple of 32."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    # diffusers gives 0 for very thin images (and then fails); 32 is the smallest valid side
    return max(32, round(width / 32) * 32), max(32, round(height / 32) * 32)


def check_image_areas(areas: dict, where: str) -> dict:
    """{"vl_area": px, "vae_area": px} (either optional) -> the same dict, or a ValueError naming the field."""
    if not isinstance(areas, dict):
        raise ValueError(
            f"{where}: image_areas must be an object like {{'vl_area': 4096, 'vae_area': 16384}}"
        )
    for k, v in areas.items():
        if k not in ("vl_area", "vae_area"):
            raise ValueError(f"{where}: unknown image_areas field {k!r} (allowed: vl_area, vae_area)")
        if not isinstance(v, int) or isinstance(v, bool) or not 32 * 32 <= v <= 4096 * 4096:
            raise ValueError(
                f"{where}: image_areas.{k} must be a whole number of pixels in [1024, 4096²], got {v!r}"
            )
    return dict(areas)


def load_images(image: object) -> list:
    """PIL image / path / HxWx3 uint8 array, or a list of them -> list of PIL images."""
    from PIL import Image, UnidentifiedImageError

    items = image if isinstance(image, (list, tuple)) else [image]
    out = []
    for i, im in enumerate(items):
        where = f"image[{i}]" if isinstance(image, (list, tuple)) else "image"
        if isinstance(im, (str, Path)):
            try:
                with Image.open(im) as f:
                    f.load()
                    im = f.copy()
            except FileNotFoundError:
                raise ValueError(f"{where}: no such file {str(im)!r}") from None
            except (UnidentifiedImageError, OSError) as e:
                raise ValueError(f"{where}: {str(im)!r} is not a readable image ({e})") from None
        elif isinstance(im, np.ndarray):
            if im.dtype != np.uint8 or im.ndim != 3 or im.shape[2] not in (3, 4):
                raise ValueError(f"{where}: arrays must be HxWx3 (or 4) uint8, got {im.dtype} {im.shape}")
            im = Image.fromarray(im)
        elif not isinstance(im, Image.Image):
            raise TypeError(
                f"{where} must be a PIL image, a path or an HxWx3 uint8 array, got {type(im).__name__}"
            )
        if im.width < 1 or im.height < 1:
            raise ValueError(f"{where} is empty ({im.width}x{im.height})")
        out.append(im if im.mode == "RGB" else im.convert("RGB"))
    return out


class QwenImageEditPipeline(QwenImagePipeline):
    """Image editing. `QwenImageEditPipeline.from_pretrained(path)(image, "make it red").images[0]`.

    `mode` is "edit" (Qwen-Image-Edit v1) or "edit-plus" (Edit-2509 / Edit-2511), read from
    `model_index.json`; for single-file checkpoints it defaults to "edit-plus".
    """

    folder_kinds = MODES
    checkpoints = "an edit model (Qwen-Image-Edit, -2509, -2511)"
    # Edit-2509/2511's; a loaded model answers for its folder (`_capabilities_of`: MAX_IMAGES by mode)
    CAPABILITIES = Capabilities(
        "qwen-image-edit-plus",
        tasks=("edit",),
        max_images=MAX_IMAGES["edit-plus"],
        single_files=True,
        variant="edit-plus",
    )

    def __init__(
        self,
        transformer,
        vae,
        text_encoder: TextEncoder,
        scheduler_config,
        *,
        model_path: str = "",
        defaults: dict | None = None,
        mode: str = "edit-plus",
        image_processor=None,
        image_areas: dict | None = None,
        options: EngineOptions | None = None,
        device=None,
        extra: dict | None = None,
    ):
        super().__init__(
            transformer,
            vae,
            text_encoder,
            scheduler_config,
            model_path=model_path,
            defaults=defaults,
            options=options,
            device=device,
            extra=extra,
        )
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        # pixel areas the reference images are resized to (the released models: VL_AREA / VAE_AREA);
        # a model trained at another scale (the 128² demo) says so in qwenfast.json "image_areas"
        self.image_areas = check_image_areas(image_areas or {}, model_path or "image_areas")
        self.image_processor = image_processor if image_processor is not None else load_image_processor()
        self.latent_cache_size = 16
        self._latent_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.defaults.pop("height", None)  # the output size follows the input image unless given
        self.defaults.pop("width", None)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: Device = None,
        dtype: DType = None,
        offload: str | None = None,
        *,
        options: EngineOptions | None = None,
        fp8: bool | None = None,
        cuda_graphs: bool | None = None,
        cache: object = None,
        **kwargs,
    ) -> QwenImageEditPipeline:
        """Load a diffusers-layout edit folder or hub repo id (None = the embedded demo edit model).

        Engine options, the `offload` / `fp8` / `cuda_graphs` shortcuts and diffusers' keyword
        arguments (`torch_dtype=`, ...) as for `QwenImagePipeline.from_pretrained`.
        """
        path, dtype = loading_args(cls.__name__, path, dtype, kwargs)
        opts = engine_options(
            options, {"offload": offload, "fp8": fp8, "cuda_graphs": cuda_graphs, "cache": cache}
        )
        f = load_folder(
            path if path is not None else DEFAULT_EDIT_MODEL,
            device,
            dtype,
            opts.offload,
            MODES,
            "QwenImageEditPipeline runs Qwen-Image-Edit checkpoints (use QwenImagePipeline, or "
            "qwenfast.from_pretrained which picks the class)",
            fp8=opts.fp8,
            options=opts,
        )
        return cls(
            f.transformer,
            f.vae,
            f.te,
            f.sched,
            model_path=str(f.path),
            defaults=f.extra.get("defaults"),
            mode=f.kind,
            image_processor=load_image_processor(f.path / "processor"),
            image_areas=f.extra.get("image_areas"),
            options=f.options,
            device=f.device,
            extra=f.extra,
        )

    @classmethod
    def from_single_files(cls, *args, mode: str = "edit-plus", **kwargs) -> QwenImageEditPipeline:
        """ComfyUI single files (see `QwenImagePipeline.from_single_files`). Single files do not say
        which edit model they are: `mode="edit"` for Qwen-Image-Edit v1, else Edit-2509/2511."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        pipe = super().from_single_files(*args, **kwargs)
        pipe.mode = mode
        return pipe

    def _capabilities_of(self, cls: type) -> Capabilities:
        """The rule of the edit classes: the model type, and at most MAX_IMAGES[mode] images, by folder."""
        c = cls.CAPABILITIES
        return replace(
            c,
            model_type=f"qwen-image-{self.mode}",
            variant=self.mode,
            max_images=min(c.max_images, MAX_IMAGES[self.mode]),
        )

    # ---------------------------------------------------------------- preprocessing
    def prepare_images(self, images: list) -> tuple[list, list, tuple[int, int]]:
        """-> (VL images, VAE images (both PIL, resized as diffusers does), default output (width, height))."""
        from PIL import Image

        vl_area = self.image_areas.get("vl_area", VL_AREA[self.mode])
        vae_area = self.image_areas.get("vae_area", VAE_AREA)
        vl, vae_in = [], []
        for im in images:
            ratio = im.width / im.height
            cw, ch = calculate_dimensions(vl_area, ratio)
            vw, vh = calculate_dimensions(vae_area, ratio)
            vl.append(im.resize((cw, ch), resample=Image.LANCZOS))
            vae_in.append(vl[-1] if self.mode == "edit" else im.resize((vw, vh), resample=Image.LANCZOS))
        ref = images[0] if self.mode == "edit" else images[-1]
        return vl, vae_in, calculate_dimensions(vae_area, ref.width / ref.height)

    def encode_images(self, vae_in: list, batch: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """VAE-encode reference images -> packed latents (batch, sum of tokens, 64) and their shapes.

        Latents are cached by image content (LRU): editing one picture with several prompts, or a
        server batch of edits of the same picture, encodes it once.
        """
        packed, shapes = [], []
        for im in vae_in:
            key = (image_digest([im]), self.vae_dtype, str(self.device))
            z = self._latent_cache.get(key)
            if z is None:
                z = self._encode_image(im)
                self._latent_cache[key] = z
                while len(self._latent_cache) > self.latent_cache_size:
                    self._latent_cache.popitem(last=False)
            self._latent_cache.move_to_end(key)
            packed.append(S.pack_latents(z).expand(batch, -1, -1))
            shapes.append((1, z.shape[2] // 2, z.shape[3] // 2))
        return torch.cat(packed, dim=1), shapes

    def _encode_image(self, im) -> torch.Tensor:
        """PIL RGB -> normalised latents (1, 16, h/8, w/8): the posterior's mode, as diffusers uses."""
        vcfg, vdt = self.vae.cfg, self.vae_dtype
        arr = np.asarray(im, dtype=np.float32) / 255.0  # (h, w, 3)
        x = torch.from_numpy(arr).permute(2, 0, 1)[None] * 2.0 - 1.0
        with self._vae_resident():
            z, _ = self.vae.encode(x.to(self.device, vdt))
        mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1).to(z)
        std = torch.tensor(vcfg.latents_std).view(1, -1, 1, 1).to(z)
        return ((z - mean) / std).to(self.dtype)

    def prompt_text(self, prompt: str, n_images: int) -> str:
        if self.mode == "edit":
            return VISION_SLOT + prompt
        return "".join(f"Picture {i + 1}: {VISION_SLOT}" for i in range(n_images)) + prompt

    def encode_edit_prompt(self, prompts: list[str], vl_images: list, num_images_per_prompt: int = 1):
        texts = [self.prompt_text(p, len(vl_images)) for p in prompts]
        emb, mask = self.text_encoder.encode_with_images(
            texts, vl_images, self.image_processor, EDIT_TEMPLATE, EDIT_DROP
        )
        return self._repeat(emb, mask, num_images_per_prompt)

    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width) of a call: given, or following the (last) input image, as `__call__` does."""
        images = load_images(call_args["image"])
        ref = images[0] if self.mode == "edit" else images[-1]
        dw, dh = calculate_dimensions(self.image_areas.get("vae_area", VAE_AREA), ref.width / ref.height)
        height, width = call_args.get("height") or dh, call_args.get("width") or dw
        mult = self.vae_scale_factor * 2
        return (
            (height // mult * mult, width // mult * mult)
            if height >= mult and width >= mult
            else (height, width)
        )

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
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
        """Edit `image` (one PIL image / path / uint8 array, or a list: 1 for v1, 1-3 for 2509/2511).

        diffusers' edit arguments (`QwenImageEditPipeline` / `QwenImageEditPlusPipeline`, in their order);
        `prompt` may also be a list (each prompt edits the same images), which diffusers does not
        allow. `max_sequence_length` is only checked, as in diffusers (edit prompts, and given
        `prompt_embeds`, are not truncated). `prompt_embeds` must come from this edit model's encoder
        with the same images (they hold the image tokens); the images still give the reference latents.
        """
        if image is None:
            raise ValueError("`image` is required (the picture(s) to edit)")
        images = load_images(image)
        if not 1 <= len(images) <= MAX_IMAGES[self.mode]:
            kind = (
                "Qwen-Image-Edit (v1) takes exactly 1 image"
                if self.mode == "edit"
                else "Edit-2509/2511 take 1 to 3 images"
            )
            raise ValueError(f"got {len(images)} images; {kind}")
        vl_images, vae_in, _ = self.prepare_images(images)
        d = self.defaults
        height, width = self.output_size({"image": images, "height": height, "width": width})
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        h, w = self._check(
            height, width, steps, num_images_per_prompt, output_type, max_sequence_length, sigmas
        )
        n = num_images_per_prompt
        with DiffusersCall(
            self, guidance_scale, attention_kwargs, callback_on_step_end, callback_on_step_end_tensor_inputs
        ) as call:
            cond, uncond, k = self._prompt_conds(
                prompt,
                negative_prompt,
                cfg_scale,
                n,
                None,
                prompt_embeds,
                prompt_embeds_mask,
                negative_prompt_embeds,
                negative_prompt_embeds_mask,
                encode=lambda texts: self.encode_edit_prompt(texts, vl_images, n),
            )
            B = k * n
            out = self._generate(
                B=B,
                h=h,
                w=w,
                cond=cond,
                uncond=uncond,
                cfg_scale=cfg_scale,
                steps=steps,
                generator=generator,
                latents=latents,
                output_type=output_type,
                sigmas=sigmas,
                scheduler_overrides=scheduler_overrides,
                callback=callback,
                ref=self.encode_images(vae_in, B),
                step_end=call.step_end,
            )
        return call.output(out, return_dict)


# diffusers' name for the Edit-2509 / Edit-2511 pipeline: one class here, which reads the edit model
# (v1 or 2509/2511) from the folder's model_index.json
QwenImageEditPlusPipeline = QwenImageEditPipeline
