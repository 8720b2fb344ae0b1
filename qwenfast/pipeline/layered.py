"""`QwenImageLayeredPipeline`: split a picture into RGBA layers (Qwen-Image-Layered), with diffusers'
call arguments and diffusers' images.

What differs from text-to-image is conditioning only, and it all goes into the shared denoise core:
- the noise is `layers + 1` frames (frame 0 is the recomposed picture, dropped at the end) packed one
  after another, and the input picture's VAE latents (posterior mode) are appended as reference
  tokens; RoPE puts the frames at 0..layers and the picture at frame -1 (`use_layer3d_rope`);
- every forward gets `additional_t_cond` = 0 ("RGB") (`use_additional_t_cond`);
- the schedule is linspace(1, 0, N + 1)[:-1] shifted with mu = sqrt(picture tokens / 256) instead of
  the image-length rule, and true CFG does not renormalise unless `cfg_normalize=True`;
- the VAE is the RGBA variant (`input_channels` 4): the picture goes in as RGBA, layers come out RGBA.

An empty prompt ("" / " " / None) is replaced by a caption the Qwen2.5-VL text encoder writes for the
picture (diffusers' `get_image_caption`, greedy with the checkpoint's generation config).

diffusers 0.42.1 groups a batch's decoded layers with a stride of `layers + 1` instead of `layers`,
so for batches > 1 its per-sample lists are shifted; here sample b gets exactly its own layers (the
flat order of the images is the same).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..options import EngineOptions
from . import sampling as S
from .base import PipelineBase
from .common import (
    Device,
    DType,
    QwenImageOutput,
    engine_options,
    load_folder,
    postprocess,
    randn_tensor,
)
from .diffusers_compat import DiffusersCall, loading_args
from .edit import calculate_dimensions, load_image_processor
from .images import pil_image
from .sampling import StepCallback
from .tasks import Capabilities

log = logging.getLogger("qwenfast")

RESOLUTIONS = (640, 1024)
# diffusers' caption prompts (pipeline_qwenimage_layered.py, verbatim)
CAPTION_EN = """<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n# Image Annotator\nYou are a professional
image annotator. Please write an image caption based on the input image:\n1. Write the caption using natural,
descriptive language without structured formats or rich text.\n2. Enrich caption details by including: \n - Object
attributes, such as quantity, color, shape, size, material, state, position, actions, and so on\n - Vision Relations
between objects, such as spatial relations, functional relations, possessive relations, attachment relations, action
relations, comparative relations, causal relations, and so on\n - Environmental details, such as weather, lighting,
colors, textures, atmosphere, and so on\n - Identify the text clearly visible in the image, without translation or
explanation, and highlight it in the caption with quotation marks\n3. Maintain authenticity and accuracy:\n - Avoid
generalizations\n - Describe all visible information in the image, while do not add information not explicitly shown in
the image\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"""  # noqa: E501
CAPTION_CN = """<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n# 图像标注器\n你是一个专业的图像标注器。请基于输入图像，撰写图注:\n1.
使用自然、描述性的语言撰写图注，不要使用结构化形式或富文本形式。\n2. 通过加入以下内容，丰富图注细节：\n - 对象的属性：如数量、颜色、形状、大小、位置、材质、状态、动作等\n -
对象间的视觉关系：如空间关系、功能关系、动作关系、从属关系、比较关系、因果关系等\n - 环境细节：例如天气、光照、颜色、纹理、气氛等\n - 文字内容：识别图像中清晰可见的文字，不做翻译和解释，用引号在图注中强调\n3.
保持真实性与准确性：\n - 不要使用笼统的描述\n -
描述图像中所有可见的信息，但不要加入没有在图像中出现的内容\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"""  # noqa: E501


class QwenImageLayeredPipeline(PipelineBase):
    """`QwenImageLayeredPipeline.from_pretrained(path)(image, "a cat on a sofa", layers=4).images[0]`
    -> a list of `layers` RGBA PIL images (one list per output)."""

    folder_kinds = ("layered",)
    checkpoints = "a layered model (Qwen-Image-Layered)"
    CAPABILITIES = Capabilities(
        "qwen-image-layered", tasks=("layered",), max_images=1, rgba=True, parallel=()
    )

    def __init__(self, transformer, vae, text_encoder, scheduler_config, *, image_processor=None, **kwargs):
        super().__init__(transformer, vae, text_encoder, scheduler_config, **kwargs)
        cfg = transformer.cfg
        if not (cfg.use_layer3d_rope and cfg.use_additional_t_cond):
            raise ValueError(
                "QwenImageLayeredPipeline needs a Qwen-Image-Layered transformer (use_layer3d_rope and "
                "use_additional_t_cond in its config)"
            )
        self.image_processor = image_processor  # Qwen2-VL image processor, for captions only
        self.defaults.pop("height", None)  # the size follows the picture and `resolution`
        self.defaults.pop("width", None)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: Device = None,
        dtype: DType = None,
        offload: str | None = None,
        *,
        options: EngineOptions | None = None,
        fp8: bool | None = None,
        cuda_graphs: bool | None = None,
        cache: object = None,
        **kwargs,
    ) -> QwenImageLayeredPipeline:
        """Load a Qwen-Image-Layered diffusers folder (or hub repo id); engine options and diffusers'
        keyword arguments (`torch_dtype=`, ...) as `QwenImagePipeline.from_pretrained`."""
        path, dtype = loading_args(cls.__name__, path, dtype, kwargs)
        opts = engine_options(
            options, {"offload": offload, "fp8": fp8, "cuda_graphs": cuda_graphs, "cache": cache}
        )
        f = load_folder(
            path,
            device,
            dtype,
            opts.offload,
            cls.folder_kinds,
            "QwenImageLayeredPipeline runs Qwen-Image-Layered checkpoints",
            options=opts,
        )
        return cls(
            f.transformer,
            f.vae,
            f.te,
            f.sched,
            image_processor=load_image_processor(f.path / "processor"),
            model_path=str(f.path),
            defaults=f.extra.get("defaults"),
            options=f.options,
            device=f.device,
            extra=f.extra,
        )

    # ---------------------------------------------------------------- conditioning
    def picture(self, image, resolution: int):
        """-> (resized PIL picture, (height, width)) as diffusers: ~resolution² area, sides multiples of 32."""
        from PIL import Image

        if (
            not isinstance(resolution, int)
            or isinstance(resolution, bool)
            or resolution % 32
            or not 64 <= resolution <= 2048
        ):
            raise ValueError(
                f"resolution must be a multiple of 32 in 64..2048 (the model was trained at {RESOLUTIONS}; "
                f"640 is recommended), got {resolution!r}"
            )
        if (
            resolution not in RESOLUTIONS
        ):  # diffusers refuses these; smaller ones are handy for tests and drafts
            log.warning(
                "resolution %s is not one of Qwen-Image-Layered's buckets %s", resolution, RESOLUTIONS
            )
        if isinstance(image, (list, tuple)):
            if len(image) != 1:
                raise ValueError(
                    "QwenImageLayeredPipeline decomposes one picture per call (batch with a prompt list)"
                )
            image = image[0]
        im = pil_image(image, "image")
        cw, ch = calculate_dimensions(resolution * resolution, im.width / im.height)
        return im.resize((cw, ch), resample=Image.LANCZOS), (ch, cw)

    def encode_picture(self, im) -> torch.Tensor:
        """PIL picture -> packed (1, n, 64) latents: posterior mode, (z - mean) / std in the VAE dtype."""
        c = self.vae.cfg
        mode = {3: "RGB", 4: "RGBA"}.get(c.input_channels)
        if mode is None:
            raise ValueError(
                f"the VAE takes {c.input_channels} channels; Qwen-Image-Layered's takes 4 (RGBA)"
            )
        a = np.array(im if im.mode == mode else im.convert(mode)).astype(np.float32) / 255.0
        x = (torch.from_numpy(a).permute(2, 0, 1)[None] * 2.0 - 1.0).to(self.device, self.dtype)
        with self._vae_resident():
            z, _ = self.vae.encode(x.to(self.vae_dtype))  # (1, 16, h, w)
        mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(c.latents_std).view(1, -1, 1, 1).to(z.device, z.dtype)
        return S.pack_latents((z - mean) / std).to(self.dtype)

    @torch.no_grad()
    def caption(self, im, use_en_prompt: bool = False) -> str:
        """The text encoder's caption of a PIL picture (diffusers' `get_image_caption`)."""
        from ..models.text_encoder import IMAGE_PAD

        if self.image_processor is None:
            raise ValueError("captions need the model's processor/ folder; give a prompt instead")
        te = self.text_encoder
        vis = self.image_processor(images=[im], return_tensors="pt")
        grid = vis["image_grid_thw"]
        text = CAPTION_EN if use_en_prompt else CAPTION_CN
        n = int(grid[0].prod()) // self.image_processor.merge_size**2
        tok = te.tokenizer([text.replace(IMAGE_PAD, IMAGE_PAD * n)], padding=True, return_tensors="pt").to(
            te.device
        )
        kw = {"pixel_values": vis["pixel_values"].to(te.device), "image_grid_thw": grid.to(te.device)}
        if "mm_token_type_ids" in inspect.signature(te.model.forward).parameters:  # transformers 5: the RoPE
            image_id = (
                te.model.config.image_token_id
            )  # index follows it (Qwen2VLProcessor makes it: 1 = image)
            kw["mm_token_type_ids"] = (tok.input_ids == image_id).long()
        with te.resident():
            out = te.model.generate(
                input_ids=tok.input_ids, attention_mask=tok.attention_mask, max_new_tokens=512, **kw
            )
        new = out[:, tok.input_ids.shape[1] :]
        return te.tokenizer.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)[
            0
        ].strip()

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        layers: int = 4,
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
        resolution: int = 640,
        cfg_normalize: bool = False,
        use_en_prompt: bool = False,
        scheduler_overrides: dict | None = None,
        callback: StepCallback | None = None,
    ) -> QwenImageOutput | tuple:
        """diffusers' arguments, in its order. `images[b]` is the list of `layers` RGBA layers of
        output b (PIL, or an (layers, H, W, 4) array for "np"); "latent" gives the packed latents of
        all frames. An empty prompt is replaced by the text encoder's caption of the picture, unless
        `prompt_embeds` are given (diffusers captions then too, and does not use the caption)."""
        if image is None:
            raise ValueError("image is required: the picture to split into layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= 16:
            raise ValueError(f"`layers` must be an integer in 1..16, got {layers!r}")
        im, (height, width) = self.picture(image, resolution)
        if prompt_embeds is None and (prompt is None or prompt == "" or prompt == " "):
            prompt = self.caption(im, use_en_prompt)
            log.info("caption: %s", prompt)
        d = self.defaults
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
                max_sequence_length,
                prompt_embeds,
                prompt_embeds_mask,
                negative_prompt_embeds,
                negative_prompt_embeds_mask,
            )
            B = k * n
            ref = self.encode_picture(im).expand(B, -1, -1)  # (B, m, 64)
            F = layers + 1  # frame 0: the recomposed picture
            frame_tokens = (h // 2) * (w // 2)
            if latents is None:
                noise = randn_tensor((B, F, 16, h, w), generator, self.device, self.dtype)
                x = S.pack_latents(noise.reshape(B * F, 16, h, w)).reshape(B, F * frame_tokens, 64)
            else:
                if tuple(latents.shape) != (B, F * frame_tokens, 64):
                    raise ValueError(
                        f"latents must have shape {(B, F * frame_tokens, 64)} (packed), got "
                        f"{tuple(latents.shape)}"
                    )
                x = latents.to(self.device, self.dtype)
            img_shapes = [(1, h // 2, w // 2)] * F + [(1, height // 16, width // 16)]
            if sigmas is None:
                sigmas = np.linspace(1.0, 0, steps + 1)[:-1]
            mu = (ref.shape[1] / (256 * 256 / 16 / 16)) ** 0.5
            sig = S.get_sigmas(
                self.scheduler_config_for(scheduler_overrides), steps, x.shape[1], list(sigmas), mu=mu
            )
            x = self._denoise(
                x,
                sig.to(self.device),
                img_shapes,
                cond,
                uncond,
                cfg_scale,
                ref,
                callback,
                cfg_normalize,
                call.step_end,
            )
        if output_type == "latent":
            return call.output(QwenImageOutput(images=x), return_dict)
        z = x.view(B, F, frame_tokens, 64)[:, 1:].reshape(B * layers, frame_tokens, 64)
        with self._engine():
            imgs = postprocess(self.decode_latents(z, h, w), output_type)  # (B * layers) images
        return call.output(
            QwenImageOutput(images=[imgs[b * layers : (b + 1) * layers] for b in range(B)]), return_dict
        )

    def _denoise(
        self, x, sig, img_shapes, cond, uncond, cfg_scale, ref, callback, cfg_normalize, step_end=None
    ) -> torch.Tensor:
        """The shared denoise core with `additional_t_cond` bound, split into chunks on CUDA OOM."""
        if self._parallel is not None:
            raise RuntimeError(
                "QwenImageLayeredPipeline does not support parallel options yet; run on one GPU"
            )
        rgb: dict[int, torch.Tensor] = {}

        def forward(x, emb, mask, t, shapes, step=None):
            if x.shape[0] not in rgb:  # is_rgb = 0 for every row, as diffusers
                rgb[x.shape[0]] = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            return self._forward(x, emb, mask, t, shapes, step, additional_t_cond=rgb[x.shape[0]])

        with self._engine():
            return self._denoise_batch(
                forward,
                x,
                sig,
                img_shapes,
                cond,
                uncond,
                cfg_scale,
                ref,
                callback,
                guidance=S.true_cfg if cfg_normalize else S.plain_cfg,
                step_end=step_end,
            )
