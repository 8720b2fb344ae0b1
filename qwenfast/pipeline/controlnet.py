"""`QwenImageControlNetPipeline` and `QwenImageControlNetInpaintPipeline`: text-to-image steered by
ControlNets (InstantX Qwen-Image-ControlNet-Union / -Inpainting), with diffusers' call arguments and
diffusers' images.

Conditioning only: the control images are VAE-encoded and packed once per call; each step the
ControlNet(s) run on the noise latents with the prompt and their residuals go to the transformer as
`block_residuals` (added after its blocks; see `QwenImageTransformer.forward`). That happens in the
forward callable handed to the shared denoise core (`ControlForward`), never in the loop itself:

- the ControlNet runs once per step on the conditional prompt; true CFG's negative pass reuses its
  residuals (diffusers does exactly this), and a batched CFG forward gets them twice;
- `control_guidance_start` / `end` switch a condition off outside its share of the steps: diffusers
  then adds residuals scaled by 0, which changes nothing, so the ControlNet is not run at all;
- the residuals are CUDA-graph inputs of the transformer forward (runtime/cuda_graphs.py); FP8
  quantises the ControlNet's block Linears as well as the transformer's.

Like diffusers, control latents are *sampled* from the VAE posterior: with the call's `generator`
before the noise is drawn (ControlNet), and from torch's global RNG for the inpainting ControlNet's
masked image (`latent_dist.sample()` without a generator there). Seed torch (`torch.manual_seed`) for
repeatable inpainting, as with diffusers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..models import controlnet as cn
from ..models.controlnet import ControlNets, QwenImageMultiControlNetModel
from ..options import EngineOptions
from ..runtime.attention import RowTrim
from ..runtime.blocks import StepContext
from . import sampling as S
from .common import (
    Device,
    DType,
    QwenImageOutput,
    engine_options,
    load_folder,
    randn_tensor,
)
from .diffusers_compat import DiffusersCall, loading_args
from .images import IMAGE, MASK, ImageSpec, preprocess
from .sampling import StepCallback
from .tasks import Capabilities
from .text_to_image import DEFAULT_MODEL, QwenImagePipeline

__all__ = [
    "QwenImageControlNetPipeline",
    "QwenImageControlNetInpaintPipeline",
    "ControlForward",
    "load_controlnets",
]

KINDS = ("text-to-image", "controlnet", "controlnet-inpaint")


class QwenImageControlNetModel(cn.QwenImageControlNetModel):
    """diffusers' public ControlNet class: the model of `models/controlnet.py` plus diffusers' loader
    (which needs the loading and pipeline layers, so it lives here, not with the network)."""

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> QwenImageControlNetModel:
        """diffusers' `QwenImageControlNetModel.from_pretrained(path, torch_dtype=...)`: a ControlNet folder,
        single .safetensors file or hub repo id, loaded on the CPU (fp32 unless `torch_dtype=`), as
        diffusers loads it; a pipeline's `from_pretrained(controlnet=...)` moves it to its device and dtype."""
        from ..loading.controlnet import load_controlnet
        from .diffusers_compat import loading_args

        path, dtype = loading_args(cls.__name__, path, kwargs.pop("dtype", None), kwargs)
        return load_controlnet(path, "cpu", dtype if dtype is not None else torch.float32, model_class=cls)


def load_controlnets(
    controlnet, device: torch.device, dtype: torch.dtype, axes_dims_rope=None
) -> ControlNets:
    """A ControlNet model, a path (diffusers folder or single file), or a list of them (-> Multi).
    `axes_dims_rope`: the transformer's, for single files that do not say (non-standard head dims)."""
    from ..loading.controlnet import load_controlnet

    def one(c):
        if isinstance(c, cn.QwenImageControlNetModel):
            return c
        if isinstance(c, (str, Path)):
            return load_controlnet(c, device, dtype, axes_dims_rope=axes_dims_rope)
        raise TypeError(f"controlnet must be a QwenImageControlNetModel or a path, got {type(c).__name__}")

    if isinstance(controlnet, QwenImageMultiControlNetModel):
        return controlnet
    if isinstance(controlnet, (list, tuple)):
        return QwenImageMultiControlNetModel([one(c) for c in controlnet])
    return one(controlnet)


def image_batch(
    image, height: int, width: int, mult: int, where: str, spec: ImageSpec = IMAGE
) -> torch.Tensor:
    """diffusers' `prepare_image`: a tensor passes through as it is (so it must already be what the
    VAE takes, [-1, 1]; integer tensors are refused); anything else (one image or a list: PIL / path /
    array) goes through diffusers' `VaeImageProcessor.preprocess` (`images.py`) -> (n, C, H, W)
    float32, resized to (height, width) floored to `mult`, in [-1, 1] (masks: 0/1)."""
    if isinstance(image, torch.Tensor):
        if not (image.is_floating_point() or spec.binarize):
            raise ValueError(
                f"{where}: an integer ({image.dtype}) tensor would reach the VAE as 0..255 values; "
                "give floats in [-1, 1]"
            )
        if image.ndim == 3:
            image = image[None]
        if image.ndim != 4:
            raise ValueError(f"{where}: a tensor must be (B, C, H, W), got {tuple(image.shape)}")
        return image
    return preprocess(image, height, width, spec, mult=mult, where=where)


def _repeat_rows(x: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """diffusers' `prepare_image` batching: one image -> every row; k images -> each n times."""
    return x.repeat_interleave(batch if x.shape[0] == 1 else n, dim=0)


class ControlForward:
    """The denoise core's forward with ControlNet residuals (see the module docstring).

    conds[c]: packed control latents (B, N, C) of condition c for the rows this forward runs;
    scales[step][c]: its conditioning scale at that step (0 = off; skipped).
    """

    def __init__(self, forward, net: ControlNets, conds: list[torch.Tensor], scales: list[list[float]]):
        self.inner, self.net, self.conds, self.scales = forward, net, conds, scales
        self._last: tuple[int, list[torch.Tensor] | None] | None = None  # (step, residuals) of the cond pass
        self._trim = RowTrim()  # batched CFG: the cond rows' text, trimmed once per mask

    def residuals(self, x, emb, mask, t, img_shapes, step: int) -> list[torch.Tensor] | None:
        scales = self.scales[step]
        on = [c for c, s in enumerate(scales) if s != 0]
        if not on:
            return None
        if isinstance(self.net, QwenImageMultiControlNetModel):
            nets = [(self.net.net_for(c), c) for c in on]
        else:
            nets = [(self.net, c) for c in on]
        total = None
        for net, c in nets:
            r = net(x, self.conds[c], scales[c], emb, mask, t, img_shapes)
            total = r if total is None else [a + b for a, b in zip(total, r)]
        return total

    def __call__(self, x, emb, mask, t, img_shapes, step: StepContext | None = None, shard=None):
        if shard is not None:
            raise RuntimeError("ControlNet pipelines do not run sequence-parallel (--parallel) yet")
        i = step.step if step is not None else 0
        branch = step.branch if step is not None else "cond"
        if branch == "uncond":  # diffusers reuses the conditional pass's residuals for the negative prompt
            if self._last is None or self._last[0] != i:
                raise RuntimeError("the negative pass of a ControlNet step came before its conditional pass")
            res = self._last[1]
        elif branch == "both":  # batched CFG: cond rows first; the ControlNet sees the cond prompt only
            B = x.shape[0] // 2
            e, m = self._trim(emb, mask, slice(0, B))
            res = self.residuals(x[:B], e, m, t[:B], img_shapes, i)
            res = None if res is None else [torch.cat([r, r]) for r in res]
        else:
            self._last = None
            res = self.residuals(x, emb, mask, t, img_shapes, i)
            self._last = (i, res)
        return self.inner(x, emb, mask, t, img_shapes, step, block_residuals=res)


class QwenImageControlNetPipeline(QwenImagePipeline):
    """Text-to-image with one or several ControlNets (diffusers' `QwenImageControlNetPipeline`).

    `QwenImageControlNetPipeline.from_pretrained("Qwen-Image", controlnet="InstantX/...-Union")`;
    `controlnet` may be a loaded `QwenImageControlNetModel`, a `QwenImageMultiControlNetModel`, a path
    (diffusers folder or single .safetensors), or a list of them (one net per control image, or one
    Union net for every image).
    """

    folder_kinds = ("text-to-image", "controlnet")  # a saved ControlNet pipeline folder holds its net
    needs = ("controlnet",)
    checkpoints = "a text-to-image model (Qwen-Image, -2512) and a ControlNet"
    CAPABILITIES = Capabilities("qwen-image", tasks=("controlnet",), max_images=1, parallel=())

    def __init__(
        self, transformer, vae, text_encoder, scheduler_config, *, controlnet: ControlNets, **kwargs
    ):
        self.controlnet = controlnet  # before the base init: its configure() reaches the ControlNet
        super().__init__(transformer, vae, text_encoder, scheduler_config, **kwargs)

    def configure(self, **changes) -> EngineOptions:
        """Engine options as for every pipeline; FP8 and the fused kernels apply to the ControlNet too."""
        old = self._options
        new = super().configure(**changes)
        nets = (
            list(self.controlnet.nets)
            if isinstance(self.controlnet, QwenImageMultiControlNetModel)
            else [self.controlnet]
        )
        if new.fp8 and not old.fp8:
            from ..kernels.fp8_linear import quantize_model

            for net in nets:
                quantize_model(net)
        for net in nets:
            net.set_fused(new.fused)
        return new

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        controlnet=None,
        device: Device = None,
        dtype: DType = None,
        offload: str | None = None,
        *,
        options: EngineOptions | None = None,
        fp8: bool | None = None,
        cuda_graphs: bool | None = None,
        cache: object = None,
        **kwargs,
    ):
        """A Qwen-Image text-to-image folder plus `controlnet=` (see the class docstring), or a saved
        diffusers ControlNet pipeline folder (its `controlnet/` is used when `controlnet` is None).
        The ControlNet is loaded onto the compute device in the pipeline's dtype (also with offload).
        diffusers' keyword arguments (`torch_dtype=`, ...) as for `QwenImagePipeline.from_pretrained`."""
        path, dtype = loading_args(cls.__name__, path, dtype, kwargs)
        opts = engine_options(
            options, {"offload": offload, "fp8": fp8, "cuda_graphs": cuda_graphs, "cache": cache}
        )
        f = load_folder(
            path if path is not None else DEFAULT_MODEL,
            device,
            dtype,
            opts.offload,
            KINDS,
            f"{cls.__name__} runs Qwen-Image text-to-image checkpoints with a ControlNet",
            options=opts,
        )
        if controlnet is None:
            if not (f.path / "controlnet").is_dir():
                raise ValueError(
                    f"{cls.__name__}.from_pretrained needs controlnet= (a ControlNet folder or "
                    "file, e.g. InstantX/Qwen-Image-ControlNet-Union)"
                )
            controlnet = f.path / "controlnet"
        dt = f.transformer.dtype
        net = load_controlnets(controlnet, f.device, dt, f.transformer.cfg.axes_dims_rope)
        net.to(f.device, dt)
        return cls(
            f.transformer,
            f.vae,
            f.te,
            f.sched,
            controlnet=net,
            model_path=str(f.path),
            defaults=f.extra.get("defaults"),
            options=f.options,
            device=f.device,
            extra=f.extra,
        )

    # ---------------------------------------------------------------- control latents
    def encode_control(self, pixels: torch.Tensor, generator, batch: int, n: int) -> torch.Tensor:
        """(k, 3, H, W) in [-1, 1] -> packed control latents (batch, N, 64) in the model dtype, sampled
        from the VAE posterior with `generator` like diffusers (`retrieve_latents(..., generator)`)."""
        z, logvar = self._vae_moments(pixels)
        z, logvar = _repeat_rows(z, batch, n), _repeat_rows(logvar, batch, n)
        noise = randn_tensor(tuple(z.shape), generator, z.device, z.dtype)  # diffusers' (B, 16, 1, h, w) draw
        return S.pack_latents(self._normalize(z + torch.exp(0.5 * logvar) * noise)).to(self.dtype)

    def _vae_moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = pixels.to(self.device, self.vae_dtype)
        with self._vae_resident():
            return self.vae.encode(x)  # (k, 16, h, w) each

    def _normalize(self, z: torch.Tensor) -> torch.Tensor:
        """(z - mean) / std in fp32, as diffusers ((z - mean) * (1 / std) with fp32 statistics)."""
        c = self.vae.cfg
        mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1).to(z.device)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1).to(z.device)
        return (z - mean) * inv_std

    def _control_items(self, control_image) -> list:
        """The control image entry of each condition (one for a single ControlNet)."""
        multi = isinstance(self.controlnet, QwenImageMultiControlNetModel)
        if control_image is None:
            raise ValueError(
                "control_image is required (the picture the ControlNet follows: canny, depth, pose, ...)"
            )
        items = list(control_image) if multi and isinstance(control_image, (list, tuple)) else [control_image]
        if multi and len(self.controlnet.nets) > 1 and len(items) != len(self.controlnet.nets):
            raise ValueError(
                f"{len(self.controlnet.nets)} ControlNets need {len(items)} == "
                f"{len(self.controlnet.nets)} control images"
            )
        return items

    def _control_latents(self, items: list, height: int, width: int, generator, batch: int, n: int):
        """-> (list of packed control latents, output height, width). Output size follows the control
        image(s) as in diffusers (PIL images and arrays are resized to the requested size; tensors set it)."""
        mult = self.vae_scale_factor * 2
        multi = isinstance(self.controlnet, QwenImageMultiControlNetModel)
        conds = []
        for k, item in enumerate(items):
            px = image_batch(item, height, width, mult, f"control_image[{k}]" if multi else "control_image")
            if px.shape[1] != 3:
                raise ValueError(f"control image tensors must have 3 channels, got {tuple(px.shape)}")
            height, width = px.shape[-2:]
            if height % mult or width % mult:
                raise ValueError(
                    f"control image tensors must be multiples of {mult} pixels, got {width}x{height}"
                )
            conds.append(self.encode_control(px, generator, batch, n))
        if len({c.shape[1] for c in conds}) > 1:
            raise ValueError(
                "the control images have different sizes; give them at one size (or as PIL images, "
                "which are resized to height x width)"
            )
        return conds, int(height), int(width)

    @staticmethod
    def _step_scales(steps: int, n_cond: int, scale, start, end, multi: bool) -> list[list[float]]:
        """diffusers' `controlnet_keep` times the conditioning scale, per step and condition."""
        if not isinstance(start, (list, tuple)) and isinstance(end, (list, tuple)):
            start = [start] * len(end)
        elif not isinstance(end, (list, tuple)) and isinstance(start, (list, tuple)):
            end = [end] * len(start)
        elif not isinstance(start, (list, tuple)):
            start, end = [start] * (n_cond if multi else 1), [end] * (n_cond if multi else 1)
        if len(start) != len(end):
            raise ValueError(
                f"control_guidance_start has {len(start)} entries, control_guidance_end {len(end)}"
            )
        for s, e in zip(start, end):
            if not 0.0 <= s < e <= 1.0:
                raise ValueError(
                    f"control guidance must satisfy 0 <= start < end <= 1, got start={s}, end={e}"
                )
        scales = list(scale) if isinstance(scale, (list, tuple)) else [scale] * n_cond
        if multi and len(scales) != n_cond:
            raise ValueError(
                f"controlnet_conditioning_scale has {len(scales)} entries for {n_cond} control images"
            )
        if multi and len(start) != n_cond:
            raise ValueError(
                f"control_guidance_start/end have {len(start)} entries for {n_cond} control images"
            )
        out = []
        for i in range(steps):
            keep = [1.0 - float(i / steps < s or (i + 1) / steps > e) for s, e in zip(start, end)]
            out.append([c * k for c, k in zip(scales, keep)] if multi else [scales[0] * keep[0]])
        return out

    # ---------------------------------------------------------------- generation
    def _run(self, a: dict, make_conds: Callable, scales_of: Callable) -> QwenImageOutput | tuple:
        """The shared body of both ControlNet calls (`a`: the call's arguments): prompts, then
        `make_conds(B, n) -> (packed condition latents, height, width)` (VAE samples drawn before the
        noise, as diffusers), then the denoise core with the ControlNet in its forward."""
        if self._parallel is not None:
            raise RuntimeError("ControlNet pipelines do not support parallel options yet; run on one GPU")
        d = self.defaults
        height = d["height"] if a["height"] is None else a["height"]
        width = d["width"] if a["width"] is None else a["width"]
        steps = d["num_inference_steps"] if a["num_inference_steps"] is None else a["num_inference_steps"]
        cfg_scale = d["true_cfg_scale"] if a["true_cfg_scale"] is None else a["true_cfg_scale"]
        n, sigmas = a["num_images_per_prompt"], a["sigmas"]
        self._check(height, width, steps, n, a["output_type"], a["max_sequence_length"], sigmas)
        scales_of(
            max(1, len(sigmas) if sigmas is not None else steps)
        )  # bad values fail before the prompt encode
        with DiffusersCall(
            self,
            a["guidance_scale"],
            a["attention_kwargs"],
            a["callback_on_step_end"],
            a["callback_on_step_end_tensor_inputs"],
            warn_guidance="controlnet" in self.CAPABILITIES.tasks,
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
            conds, height, width = make_conds(k * n, n, height, width)
            h, w = S.latent_hw(height, width, self.vae_scale_factor)
            N = (h // 2) * (w // 2)
            for c in conds:
                if c.shape[1] != N:
                    raise ValueError(
                        f"control latents have {c.shape[1]} tokens, the output {N}: give control "
                        "images of the output size"
                    )
            scales = scales_of(len(sigmas) if sigmas is not None else steps)

            def forward_for(fwd, i, j):
                return ControlForward(fwd, self.controlnet, [c[i:j] for c in conds], scales)

            out = self._generate(
                B=k * n,
                h=h,
                w=w,
                cond=cond,
                uncond=uncond,
                cfg_scale=cfg_scale,
                steps=steps,
                generator=a["generator"],
                latents=a["latents"],
                output_type=a["output_type"],
                sigmas=sigmas,
                scheduler_overrides=a["scheduler_overrides"],
                callback=a["callback"],
                forward_for=forward_for,
                step_end=call.step_end,
            )
        return call.output(out, a["return_dict"])

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        control_guidance_start: float | list[float] = 0.0,
        control_guidance_end: float | list[float] = 1.0,
        control_image=None,
        controlnet_conditioning_scale: float | list[float] = 1.0,
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
        """diffusers' arguments, in its order. `control_image`: one image (or a per-prompt list) for one
        ControlNet; a list with one entry per condition for a `QwenImageMultiControlNetModel` (each
        entry one image or a per-prompt list), with per-condition `controlnet_conditioning_scale` and
        guidance windows. Arrays and tensors mean what they mean in diffusers (`image_batch`)."""
        a = {k: v for k, v in locals().items() if k != "self"}
        multi = isinstance(self.controlnet, QwenImageMultiControlNetModel)
        items = self._control_items(control_image)

        def make_conds(B, n, height, width):
            return self._control_latents(items, height, width, generator, B, n)

        def scales_of(n_steps):
            return self._step_scales(
                n_steps,
                len(items),
                controlnet_conditioning_scale,
                control_guidance_start,
                control_guidance_end,
                multi,
            )

        return self._run(a, make_conds, scales_of)


class QwenImageControlNetInpaintPipeline(QwenImageControlNetPipeline):
    """Inpainting with the InstantX inpainting ControlNet (diffusers' `QwenImageControlNetInpaintPipeline`):
    the ControlNet sees the masked image's latents and the mask; white mask pixels are repainted."""

    folder_kinds = ("text-to-image", "controlnet-inpaint")
    checkpoints = "a text-to-image model (Qwen-Image, -2512) and an inpainting ControlNet"
    CAPABILITIES = Capabilities(
        "qwen-image", tasks=("controlnet-inpaint",), max_images=1, mask=True, parallel=()
    )

    def encode_masked(self, image, mask, height: int, width: int, batch: int, n: int) -> torch.Tensor:
        """diffusers' `prepare_image_with_mask` -> packed (batch, N, 68) [masked latents, 1 - mask]."""
        import torch.nn.functional as F

        mult = self.vae_scale_factor * 2
        px = _repeat_rows(image_batch(image, height, width, mult, "control_image"), batch, n)
        if mask is None:
            raise ValueError("control_mask is required (white = repaint, black = keep)")
        if isinstance(mask, torch.Tensor):  # as it is (diffusers does not binarise a tensor mask)
            m = mask if mask.ndim == 4 else mask.reshape(1, 1, *mask.shape[-2:])
        else:  # resized, grayscale, binarised at 0.5 (diffusers' mask processor)
            m = image_batch(mask, height, width, mult, "control_mask", MASK)
        m = _repeat_rows(m, batch, n).to(self.device, self.vae_dtype)  # (B, 1, H, W)
        if m.shape[-2:] != px.shape[-2:]:
            raise ValueError(
                f"control_mask is {tuple(m.shape[-2:])} pixels, control_image {tuple(px.shape[-2:])}: "
                "give them at one size (PIL images are both resized to height x width)"
            )
        x = px.to(self.device, self.vae_dtype)
        x = x.masked_fill((m > 0.5).expand_as(x), -1.0)
        with self._vae_resident():
            z, logvar = self.vae.encode(x)
        # latent_dist.sample() without a generator: torch's global RNG, on the VAE's device
        z = z + torch.exp(0.5 * logvar) * torch.randn(z.shape, device=z.device, dtype=z.dtype)
        z = self._normalize(z).to(self.vae_dtype)
        mz = F.interpolate(m[:, :, None], size=(1, *z.shape[-2:]))[:, :, 0]  # nearest, as diffusers' 5-D call
        return S.pack_latents(torch.cat([z, 1 - mz], dim=1)).to(self.dtype)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float = 1.0,
        control_guidance_start: float | list[float] = 0.0,
        control_guidance_end: float | list[float] = 1.0,
        control_image=None,
        control_mask=None,
        controlnet_conditioning_scale: float | list[float] = 1.0,
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
        """diffusers' arguments, in its order: `control_image` (the picture) and `control_mask` (white / 1
        = repaint) are resized to height x width; the output has that size. One inpainting ControlNet.
        `guidance_scale` is ignored silently, as diffusers does here."""
        a = {k: v for k, v in locals().items() if k != "self"}
        if isinstance(self.controlnet, QwenImageMultiControlNetModel):
            raise ValueError("QwenImageControlNetInpaintPipeline takes one ControlNet (the inpainting one)")
        if self.controlnet.cfg.extra_condition_channels != 4:
            raise ValueError(
                "this ControlNet is not an inpainting ControlNet (extra_condition_channels "
                f"{self.controlnet.cfg.extra_condition_channels}, expected 4: InstantX "
                "Qwen-Image-ControlNet-Inpainting); use QwenImageControlNetPipeline"
            )
        if control_image is None:
            raise ValueError("control_image is required (the picture to inpaint)")

        def make_conds(B, n, height, width):
            return [self.encode_masked(control_image, control_mask, height, width, B, n)], height, width

        def scales_of(n_steps):
            return self._step_scales(
                n_steps, 1, controlnet_conditioning_scale, control_guidance_start, control_guidance_end, False
            )

        return self._run(a, make_conds, scales_of)
