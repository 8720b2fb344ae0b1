"""The qwenfast ComfyUI nodes (classic node API: INPUT_TYPES / RETURN_TYPES / FUNCTION / CATEGORY).

The model travels between nodes as a `QwenFastModel` handle (type "QWENFAST_MODEL"): the loaded
pipeline plus the LoRA set this branch of the graph wants. LoRA nodes only return a new handle; the
sampler makes the pipeline's fused LoRAs exactly that set before sampling (`pipe.set_loras`, which
changes only what differs), so stacking is chaining LoRA nodes, and changing a strength or bypassing
a LoRA node re-runs only the sampler (hot swap: no reload). FP8 is one-way and bakes LoRAs in, so
the loader's `fp8` switch is applied by the sampler after the first LoRA set is fused.

The sampler runs qwenfast's pipeline (the same denoise core `qwenfast generate` runs: same seed ->
same image) and returns ComfyUI's LATENT and IMAGE (see bridge.py for the formats). Image i of a batch
uses seed + i (its own generator), as `qwenfast generate --n` and the server: image 2 of seed 7 is
the image of seed 8 alone (qwenfast.validation.image_seeds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import bridge

log = logging.getLogger("qwenfast.comfyui")
CATEGORY = "qwenfast"
MAX_SEED = 0xFFFFFFFFFFFFFFFF  # ComfyUI's seed range (torch.Generator takes the whole uint64 range)
MAX_SIDE = 8192


@dataclass(frozen=True)
class QwenFastModel:
    """A loaded qwenfast pipeline + the LoRAs [(path, strength, name)] and FP8 wish of this graph branch."""

    pipe: Any
    loras: tuple = ()
    fp8: bool = False
    label: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def prepared(self):
        """The pipeline with this handle's LoRA set fused (and FP8 after it, if asked). Returns the pipeline."""
        pipe = self.pipe
        want = {name: float(s) for _, s, name in self.loras}
        if pipe.options.fp8:
            if dict(pipe.loras) != want:
                raise ValueError("this model runs in FP8, which bakes LoRAs in: the LoRA set cannot change "
                                 f"(fused: {dict(pipe.loras)}, asked: {want}); reload the model (change the "
                                 "loader) or turn fp8 off")  # fmt: skip
            return pipe
        pipe.set_loras([tuple(x) for x in self.loras])
        if self.fp8:
            pipe.configure(fp8=True)
        return pipe


def _load(model: str, transformer: str, vae: str, text_encoder: str, tokenizer: str, mode: str,
          device: str, dtype: str, opts) -> Any:  # fmt: skip
    import qwenfast
    from qwenfast.pipeline.edit import QwenImageEditPipeline
    from qwenfast.pipeline.text_to_image import QwenImagePipeline

    dev = None if device == "auto" else device
    dt = None if dtype == "auto" else dtype
    singles = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
    if any(v.strip() for v in singles.values()):
        missing = [k for k, v in singles.items() if not v.strip()]
        if missing:
            raise ValueError(f"single files need transformer, vae, text_encoder and tokenizer; missing {missing}")
        files = {
            "transformer": bridge.model_path(transformer, "diffusion_models"),
            "vae": bridge.model_path(vae, "vae"),
            "text_encoder": bridge.model_path(text_encoder, "text_encoders"),
            "tokenizer": bridge.model_path(tokenizer, "text_encoders"),
        }
        if mode in ("edit", "edit-plus"):
            return QwenImageEditPipeline.from_single_files(**files, device=dev, dtype=dt, options=opts, mode=mode)
        return QwenImagePipeline.from_single_files(**files, device=dev, dtype=dt, options=opts)
    name = model.strip()
    path = {"": qwenfast.DEMO_MODEL, "demo": qwenfast.DEMO_MODEL, "demo-edit": qwenfast.DEMO_EDIT_MODEL}.get(name)
    if path is None:
        path = bridge.model_path(name, "diffusers")
    return qwenfast.from_pretrained(path, device=dev, dtype=dt, options=opts)


class QwenFastLoader:
    """A Qwen-Image model (diffusers folder, or ComfyUI split / FP8 files) -> a qwenfast engine."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("QWENFAST_MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        from qwenfast.config import PRESETS
        from qwenfast.runtime.cache import CACHE_PRESETS as CACHE

        return {
            "required": {
                "model": ("STRING", {"default": "demo", "tooltip": "diffusers folder (absolute, or a name under "
                                     "models/diffusers); 'demo' / 'demo-edit' = the embedded 128x128 demo models; "
                                     "ignored when single files are given"}),  # fmt: skip
                "device": (["auto", "cuda", "cpu"], {"default": "auto"}),
                "dtype": (["auto", "bf16", "fp16", "fp32"], {"default": "auto", "tooltip": "auto: bf16 on GPU, fp32 on CPU"}),
                "fp8": ("BOOLEAN", {"default": False, "tooltip": "FP8 GEMMs in the transformer blocks (Hopper/Ada); "
                                    "applied after the first LoRA set, which it bakes in"}),  # fmt: skip
                "offload": (["none", "model", "blocks"], {"default": "none"}),
                "cache": (["off", *CACHE], {"default": "off", "tooltip": "step cache (lossy, faster)"}),
                "cuda_graphs": ("BOOLEAN", {"default": True}),
                "preset": (["none", *PRESETS], {"default": "none", "tooltip": "sampling defaults for distilled LoRAs"}),
            },
            "optional": {
                "transformer": ("STRING", {"default": "", "tooltip": "single file in models/diffusion_models"}),
                "vae": ("STRING", {"default": "", "tooltip": "single file in models/vae"}),
                "text_encoder": ("STRING", {"default": "", "tooltip": "single file in models/text_encoders"}),
                "tokenizer": ("STRING", {"default": "", "tooltip": "Qwen-Image tokenizer folder"}),
                "mode": (["text-to-image", "edit-plus", "edit"], {"default": "text-to-image",
                                                                  "tooltip": "what single files are"}),  # fmt: skip
            },
        }

    @bridge.standalone_precision()
    def load(self, model, device, dtype, fp8, offload, cache, cuda_graphs, preset, transformer="", vae="",
             text_encoder="", tokenizer="", mode="text-to-image"):  # fmt: skip
        from qwenfast.options import EngineOptions

        opts = EngineOptions.from_env(offload=offload, cache=None if cache == "off" else cache,
                                      cuda_graphs=bool(cuda_graphs))  # fmt: skip
        pipe = _load(model, transformer, vae, text_encoder, tokenizer, mode, device, dtype, opts)
        if preset != "none":
            pipe.apply_preset(preset)
        pipe.set_progress_bar_config(disable=True)  # ComfyUI's own bar shows progress
        return (QwenFastModel(pipe, (), bool(fp8), bridge.display_name(pipe.model_path)),)


class QwenFastLoRA:
    """Add a LoRA to the model's set (chain several to stack them). Changing the strength or bypassing
    the node re-fuses only what changed when the sampler runs next."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("QWENFAST_MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        names = bridge.file_choices("loras")
        hint = f" (known: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else ""
        return {
            "required": {
                "model": ("QWENFAST_MODEL",),
                "lora_name": ("STRING", {"default": "", "tooltip": "LoRA .safetensors: absolute path or a name "
                                         f"under models/loras{hint}"}),  # fmt: skip
                "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01}),
            }
        }

    @bridge.standalone_precision()
    def apply(self, model: QwenFastModel, lora_name: str, strength: float):
        if strength == 0:
            return (model,)
        path = bridge.model_path(lora_name, "loras")
        name = f"{Path(path).stem}#{len(model.loras)}"  # position in the chain: the same file twice is two LoRAs
        return (replace(model, loras=(*model.loras, (path, float(strength), name))),)


def _sampling_inputs(extra: dict | None = None) -> dict:
    req = {
        "model": ("QWENFAST_MODEL",),
        "prompt": ("STRING", {"multiline": True, "default": ""}),
        "negative_prompt": ("STRING", {"multiline": True, "default": " ",
                                       "tooltip": "used when cfg > 1 (Qwen's examples use ' ')"}),  # fmt: skip
        "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True}),
        "steps": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": "0 = the model's (or preset's) default"}),
        "cfg": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 100.0, "step": 0.1,
                          "tooltip": "true CFG scale; <= 1 turns CFG off; -1 = the model's (or preset's) default"}),
    }  # fmt: skip
    req.update(extra or {})
    return req


def _common(pipe, steps: int, cfg: float, negative_prompt: str) -> dict:
    d = pipe.defaults
    steps = steps or d["num_inference_steps"]
    cfg = d["true_cfg_scale"] if cfg < 0 else cfg
    return {"num_inference_steps": steps, "true_cfg_scale": cfg,
            "negative_prompt": negative_prompt if cfg > 1 else None}


def _generators(seed: int, n: int) -> list[torch.Generator]:
    """One generator per image of the batch, seeded seed + i (wrapping in ComfyUI's 64-bit range), as
    `qwenfast generate --n` and the server draw them."""
    from qwenfast.validation import image_seeds

    return [torch.Generator("cpu").manual_seed(s) for s in image_seeds(int(seed), int(n), MAX_SEED)]


def _outputs(pipe, out, hook: bridge.StepHook, height_px: int, width_px: int) -> tuple[dict, torch.Tensor]:
    from qwenfast.pipeline.sampling import latent_hw

    images = out.images  # (B, 3, H, W) in [0, 1]
    h, w = latent_hw(images.shape[2], images.shape[3], pipe.vae_scale_factor)
    return bridge.packed_to_comfy(pipe, hook.last, h, w), bridge.images_to_comfy(images)


class QwenFastSampler:
    """Text-to-image with qwenfast's sampler: prompt (or a CONDITIONING) -> LATENT and IMAGE.

    `positive` / `negative` (optional CONDITIONING, e.g. from 'QwenFast Encode Prompt' or ComfyUI's
    Qwen-Image text encoder) replace the prompt texts. `latent_image` (optional LATENT, e.g. an
    EmptySD3LatentImage) sets the size and batch instead of width / height / batch_size; like
    KSampler at denoise 1.0, its content is not used."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT", "IMAGE")
    RETURN_NAMES = ("latent", "image")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        size = {"min": 16, "max": MAX_SIDE, "step": 16}
        return {
            "required": _sampling_inputs({
                "width": ("INT", {"default": 1024, **size}),
                "height": ("INT", {"default": 1024, **size}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
            }),
            "optional": {"positive": ("CONDITIONING",), "negative": ("CONDITIONING",), "latent_image": ("LATENT",)},
        }  # fmt: skip

    @bridge.standalone_precision()
    def sample(self, model: QwenFastModel, prompt, negative_prompt, seed, steps, cfg, width, height, batch_size,
               positive=None, negative=None, latent_image=None):  # fmt: skip
        pipe = model.prepared()
        if "text-to-image" not in pipe.capabilities.tasks:  # what the pipeline declares (pipeline/tasks.py)
            raise ValueError("this is an edit model: use the 'QwenFast Edit' node (or load a text-to-image model)")
        if latent_image is not None:
            z = bridge.latent_4d(latent_image["samples"])
            batch_size, height, width = z.shape[0], z.shape[2] * pipe.vae_scale_factor, z.shape[3] * pipe.vae_scale_factor
        kw = _common(pipe, steps, cfg, negative_prompt)
        rows = 1
        if positive is not None:
            kw["prompt_embeds"], kw["prompt_embeds_mask"] = bridge.conditioning_to_embeds(positive, "positive")
            if kw["prompt_embeds"].shape[0] != 1:
                rows, batch_size = kw["prompt_embeds"].shape[0], 1  # one image per conditioning row
        elif not prompt.strip():
            raise ValueError("empty prompt: type one, or connect a CONDITIONING to 'positive'")
        kw["generator"] = _generators(seed, rows * int(batch_size))
        if negative is not None and kw["true_cfg_scale"] > 1:
            kw["negative_prompt_embeds"], kw["negative_prompt_embeds_mask"] = bridge.conditioning_to_embeds(
                negative, "negative")
            kw["negative_prompt"] = None
        hook = bridge.StepHook(kw["num_inference_steps"])
        hook.check()
        out = pipe(None if positive is not None else prompt, height=int(height), width=int(width),
                   num_images_per_prompt=int(batch_size), output_type="pt", callback=hook, **kw)  # fmt: skip
        return _outputs(pipe, out, hook, height, width)


class QwenFastEdit:
    """Edit 1-3 images with a Qwen-Image-Edit model (v1: one image; 2509 / 2511: up to three)."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT", "IMAGE")
    RETURN_NAMES = ("latent", "image")
    FUNCTION = "edit"

    @classmethod
    def INPUT_TYPES(cls):
        size = {"min": 0, "max": MAX_SIDE, "step": 16, "tooltip": "0 = follow the (last) input image"}
        return {
            "required": _sampling_inputs({
                "image": ("IMAGE",),
                "width": ("INT", {"default": 0, **size}),
                "height": ("INT", {"default": 0, **size}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
            }),
            "optional": {"image2": ("IMAGE",), "image3": ("IMAGE",)},
        }  # fmt: skip

    @bridge.standalone_precision()
    def edit(self, model: QwenFastModel, prompt, negative_prompt, seed, steps, cfg, image, width, height, batch_size,
             image2=None, image3=None):  # fmt: skip
        pipe = model.prepared()
        if "edit" not in pipe.capabilities.tasks or "text-to-image" in pipe.capabilities.tasks:  # edit models
            raise ValueError("this is a text-to-image model: load a Qwen-Image-Edit model (or 'demo-edit') to edit")
        images = [im for x in (image, image2, image3) if x is not None for im in bridge.comfy_to_pil(x)]
        if not prompt.strip():
            raise ValueError("empty edit instruction: type what to change")
        kw = {**_common(pipe, steps, cfg, negative_prompt), "generator": _generators(seed, batch_size)}
        hook = bridge.StepHook(kw["num_inference_steps"])
        hook.check()
        out = pipe(images, prompt, height=int(height) or None, width=int(width) or None,
                   num_images_per_prompt=int(batch_size), output_type="pt", callback=hook, **kw)  # fmt: skip
        return _outputs(pipe, out, hook, height, width)


class QwenFastEncodePrompt:
    """A prompt -> ComfyUI CONDITIONING with the model's text encoder (for the sampler's positive /
    negative inputs, or to reuse one encoding for many samplers)."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("QWENFAST_MODEL",), "text": ("STRING", {"multiline": True, "default": ""})}}

    @bridge.standalone_precision()
    def encode(self, model: QwenFastModel, text: str):
        emb, mask = model.pipe.encode_prompt([text])  # (1, L, D), (1, L) | None
        return (bridge.embeds_to_conditioning(emb, mask),)


class QwenFastDecode:
    """A Qwen-Image LATENT (from any sampler) -> IMAGE with the qwenfast model's VAE."""

    DESCRIPTION = __doc__
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("QWENFAST_MODEL",), "samples": ("LATENT",)}}

    @bridge.standalone_precision()
    @torch.no_grad()
    def decode(self, model: QwenFastModel, samples: dict):
        pipe = model.pipe
        x, h, w = bridge.comfy_to_packed(pipe, samples["samples"].to(pipe.device))
        img = pipe.decode_latents(x, h, w)  # (B, 3, H, W) in [-1, 1]
        return (bridge.images_to_comfy((img * 0.5 + 0.5).clamp(0, 1)),)


NODE_CLASS_MAPPINGS = {
    "QwenFastLoader": QwenFastLoader,
    "QwenFastLoRA": QwenFastLoRA,
    "QwenFastSampler": QwenFastSampler,
    "QwenFastEdit": QwenFastEdit,
    "QwenFastEncodePrompt": QwenFastEncodePrompt,
    "QwenFastDecode": QwenFastDecode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "QwenFastLoader": "QwenFast Load Model",
    "QwenFastLoRA": "QwenFast LoRA",
    "QwenFastSampler": "QwenFast Sampler (text to image)",
    "QwenFastEdit": "QwenFast Edit",
    "QwenFastEncodePrompt": "QwenFast Encode Prompt",
    "QwenFastDecode": "QwenFast VAE Decode",
}
