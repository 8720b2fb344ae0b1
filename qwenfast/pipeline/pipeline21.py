"""`QwenImage21Pipeline`: Qwen-Image-2.1 (text-to-image and editing with 1-10 condition images in
one pipeline), diffusers' call signature and defaults, diffusers' images.

A call: condition images (RGBA-aware) resized once to ~`output_resolution`² -> the Qwen3-VL prompt
encoding (vision context, composited over white) and the VAE latents (all four channels) -> the
shared denoise core (`sampling.denoise`) with a forward that puts the condition latents before the
noise, the prefix KV cache filled on step 0 and read on later steps (per call, per CFG branch) ->
decode to RGBA. Defaults as diffusers: 40 steps, no CFG, `output_resolution` 1024, the folder's
`sample_sigmas` when it ships them (Turbo checkpoints), `use_kv_cache` on.

Licence note: the Qwen-Image-2.1 weights are released for non-commercial use only.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import TURBO_SIGMAS
from ..errors import CheckpointError, OptionsError
from ..loading.diffusers_folder import load_scheduler_config, read_json
from ..loading.folder21 import PIPELINE_CLASS, inspect_folder21, load_transformer21, load_vae21
from ..models.text_encoder21 import TextEncoder21
from ..models.transformer21 import PrefixKVCache
from ..options import EngineOptions
from ..runtime.blocks import StepContext
from ..runtime.oom import vae_decode
from . import sampling as S
from .base import PipelineBase
from .common import (
    Device,
    DType,
    QwenImageOutput,
    as_prompt_list,
    engine_options,
    negative_prompts,
    postprocess,
    randn_tensor,
    resolve_device,
    resolve_dtype,
)
from .diffusers_compat import DiffusersCall, loading_args
from .tasks import Capabilities

log = logging.getLogger("qwenfast")
MAX_IMAGES = 10


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """diffusers' (width, height) with about `target_area` pixels, multiples of 32 (at least 32)."""
    width = math.sqrt(target_area * ratio)
    return max(32, round(width / 32) * 32), max(32, round(width / ratio / 32) * 32)


def load_condition_images(image: Any) -> list:
    """PIL / HxWx3|4 uint8 array / path, or a flat list of them -> PIL images (RGBA kept)."""
    from PIL import Image

    items = image if isinstance(image, list) else [image]
    out = []
    for i, im in enumerate(items):
        if isinstance(im, (str, Path)):
            try:
                with Image.open(im) as f:
                    im = f.copy()
            except OSError as e:
                raise ValueError(f"image[{i}]: cannot read {str(im)!r} ({e})") from None
        elif isinstance(im, np.ndarray):
            im = Image.fromarray(im)
        elif isinstance(im, (list, tuple)):
            raise ValueError(
                "`image` is one flat set of condition images shared by every prompt, not one list "
                "per prompt; call the pipeline once per prompt for different images"
            )
        elif not isinstance(im, Image.Image):
            raise ValueError(
                f"image[{i}] must be a PIL image, an array or a path, got {type(im).__name__} "
                "(latents cannot stand in: the text encoder must see the image)"
            )
        out.append(im)
    if not 1 <= len(out) <= MAX_IMAGES:
        raise ValueError(f"Qwen-Image-2.1 takes 1 to {MAX_IMAGES} condition images, got {len(out)}")
    return out


class _Forward21:
    """The forward the denoise core calls: diffusers' token order (condition latents, then the
    noise) and the prefix KV cache, one per CFG branch, filled on step 0 ("extract") and read after.

    With CUDA graphs on, the "cached" steps (all but the first) replay one captured graph per
    (branch, layout, block-runner variant): the KV cache is then a static buffer the pipeline keeps
    across calls (`QwenImage21Pipeline._static_cache`), each call's "extract" step rewriting it in place.

    The step cache (a `StepCacheRunner` on the transformer) with the KV cache: the "extract" step
    runs every block (it fills every layer's cache) and is not shown to the runner (`step=None`);
    the cached steps 1..n-1 are the runner's run, numbered 0..n-2, so its state restarts on the first
    of them and always holds target-token residuals of this call. What a skipped step reuses is
    valid: the prefix keys/values are never rewritten, and a skipped layer's stale target keys are
    rewritten before that layer next reads them. Without the KV cache every step is a joint forward
    (the prefix residual the cache reuses does not depend on the step under `causal_condition`).

    Sequence parallel (`runtime.parallel21.PrefixParallelForward`): `shard` = this rank's target
    tokens [start, end); the prefix is whole on every rank (`prefix_len` tells the wrapper its length).
    """

    def __init__(self, pipe: QwenImage21Pipeline, slots: dict[str, torch.Tensor], use_cache: bool):
        self.pipe, self.slots, self.use_cache = pipe, slots, use_cache
        self.caches: dict[str, PrefixKVCache] = {}

    def _layout(self, emb: torch.Tensor, img_shapes, step: StepContext) -> tuple[torch.Tensor, list]:
        """(image-slot mask of the joint sequence (host), img_shapes in the transformer's order)."""
        (_, h, w), refs = img_shapes[0], list(img_shapes[1:])
        slots = self.slots[step.branch][: emb.shape[1]]  # on the CPU: the layout is host-side
        return torch.cat([slots, slots.new_ones(h * w // 4)]), [*refs, (1, h, w)]

    def prefix_len(self, emb: torch.Tensor, img_shapes, step: StepContext) -> int:
        """Tokens before the target in this branch's joint sequence (text and condition latents)."""
        return self.pipe.transformer.layout(*self._layout(emb, img_shapes, step)).prefix

    def __call__(
        self, inp, emb, mask, t, img_shapes, step: StepContext, shard: tuple[int, int] | None = None
    ):
        (_, h, w), refs = img_shapes[0], img_shapes[1:]
        N = h * w if shard is None else shard[1] - shard[0]  # the target tokens in `inp` (first)
        hidden = torch.cat([inp[:, N:], inp[:, :N]], dim=1) if refs else inp
        vl, shapes = self._layout(emb, img_shapes, step)
        tr = self.pipe.transformer
        if not self.use_cache:
            return tr(hidden, emb, mask, t, shapes, vl, None, None, step, shard)
        graphs = self.pipe.options.cuda_graphs and hidden.is_cuda and tr.block_runner.graph_safe
        if step.step == 0:
            key = (step.branch, tuple(hidden.shape), tuple(vl.tolist()), tuple(shapes), shard)
            self.caches[step.branch] = (
                self.pipe._static_cache(key) if graphs else PrefixKVCache(len(tr.blocks))
            )
            return tr(hidden, emb, mask, t, shapes, vl, self.caches[step.branch], "extract", None, shard)
        cache = self.caches[step.branch]
        step = StepContext(
            step.step - 1, step.steps - 1, step.sigma, step.branch
        )  # the runner's run: see above
        if not graphs:
            return tr(hidden, emb, mask, t, shapes, vl, cache, "cached", step, shard)

        def cached_step(hidden: torch.Tensor, mask: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
            return tr(
                hidden, emb, mask, t, shapes, vl, cache, "cached", step, shard
            )  # emb: unused when cached

        tr.block_runner.prepare(step, hidden.device)  # host-side step state (a replay runs no Python)
        key = (
            "qwen-image-2.1 cached",
            id(cache),
            tuple(hidden.shape),
            hidden.dtype,
            str(hidden.device),
            None if mask is None else tuple(mask.shape),
            tuple(vl.tolist()),
            tuple(shapes),
            shard,
            tr.block_runner.epoch,
            (tr.block_runner, tr.block_runner.variant(step)),  # the runner's buffers: see CudaGraphRunner
        )
        return self.pipe._graphs.run(key, cached_step, hidden, mask, t)


class QwenImage21Pipeline(PipelineBase):
    """Qwen-Image-2.1. `QwenImage21Pipeline.from_pretrained(path)(prompt, image=[...]).images[0]`."""

    folder_kinds = ("qwen-image-2.1",)
    checkpoints = "a Qwen-Image-2.1 model"
    # one class for both tasks; no per-call step cache (a pipeline-wide `cache` option works)
    CAPABILITIES = Capabilities(
        "qwen-image-2.1",
        tasks=("text-to-image", "edit"),
        max_images=MAX_IMAGES,
        rgba=True,
        step_cache=False,
        size_multiple=32,
    )
    _attention_mask_refused = False  # diffusers' 2.1 transformer ignores attention_kwargs other than `scale`

    def __init__(
        self,
        transformer,
        vae,
        text_encoder: TextEncoder21,
        scheduler_config,
        *,
        sample_sigmas=None,
        model_path: str = "",
        defaults: dict | None = None,
        options: EngineOptions | None = None,
        device=None,
        extra: dict | None = None,
    ):
        d = {"num_inference_steps": 40, "true_cfg_scale": 1.0, "output_resolution": 1024, **(defaults or {})}
        self._static_caches: OrderedDict[tuple, PrefixKVCache] = OrderedDict()  # see _static_cache
        super().__init__(
            transformer,
            vae,
            text_encoder,
            scheduler_config,
            model_path=model_path,
            defaults=d,
            options=options,
            device=device,
            extra=extra,
        )
        self.defaults.pop("height", None)
        self.defaults.pop("width", None)
        self.sample_sigmas = None if sample_sigmas is None else [float(s) for s in sample_sigmas]

    def _static_cache(self, key: tuple) -> PrefixKVCache:
        """The KV cache the cached-step graphs of `key` (branch, latents shape, layout) read, kept
        across calls. At most two (one call's CFG pair: ~2.2 GB each at 1024² bf16); dropping one
        drops every graph first (a replay must never read freed memory)."""
        if key not in self._static_caches:
            if len(self._static_caches) >= 2:
                self._graphs.clear()
                self._static_caches.popitem(last=False)
            self._static_caches[key] = PrefixKVCache(len(self.transformer.blocks))
        self._static_caches.move_to_end(key)
        return self._static_caches[key]

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph, its memory pool and the static KV caches they read."""
        super().release_graphs()
        self._static_caches.clear()

    @classmethod
    def check_folder(cls, path: Path) -> list[str]:
        """What is missing or broken in a Qwen-Image-2.1 folder ([] when it looks complete)."""
        return inspect_folder21(path)

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
    ) -> QwenImage21Pipeline:
        """Load a diffusers-layout Qwen-Image-2.1 folder (model_index.json `QwenImage21Pipeline`) or hub repo
        id; an optional qwenfast.json `{"defaults": {...}}` changes the call defaults (e.g.
        `output_resolution`). diffusers' keyword arguments (`dtype=` / `torch_dtype=`, ...) as
        `QwenImagePipeline.from_pretrained`."""
        path, dtype = loading_args(cls.__name__, path, dtype, kwargs)
        opts = engine_options(
            options, {"offload": offload, "fp8": fp8, "cuda_graphs": cuda_graphs, "cache": cache}
        )
        path = Path(path)
        index = read_json(path / "model_index.json")
        if index.get("_class_name") != PIPELINE_CLASS:
            raise CheckpointError(
                f"{path} holds a {index.get('_class_name')!r}, not a {PIPELINE_CLASS}; use "
                "qwenfast.from_pretrained to pick the pipeline from the folder"
            )
        problems = inspect_folder21(path)
        if problems:
            raise CheckpointError(
                f"{path} is not a complete Qwen-Image-2.1 folder:\n  - " + "\n  - ".join(problems)
            )
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        cpu = torch.device("cpu")
        tr = load_transformer21(path / "transformer", cpu if opts.offload == "blocks" else dev, dt)
        te = TextEncoder21.from_pretrained(
            path / "text_encoder", path / "processor", cpu if opts.offload != "none" else dev, dt
        )
        extra = read_json(path / "qwenfast.json") if (path / "qwenfast.json").is_file() else {}
        return cls(
            tr,
            load_vae21(path / "vae", dev, dt),
            te,
            load_scheduler_config(path / "scheduler"),
            sample_sigmas=index.get("sample_sigmas"),
            model_path=str(path),
            defaults=extra.get("defaults"),
            options=opts,
            device=dev,
            extra=extra,
        )

    def apply_preset(self, name: str) -> None:
        """A turbo schedule (`TURBO_SIGMAS`: "turbo-8", "turbo-4"): its sigmas and no CFG for every call."""
        if name not in TURBO_SIGMAS:
            raise ValueError(f"unknown preset {name!r} for Qwen-Image-2.1; known: {', '.join(TURBO_SIGMAS)}")
        self.sample_sigmas = list(TURBO_SIGMAS[name])
        self.defaults.update(true_cfg_scale=1.0, num_inference_steps=len(self.sample_sigmas))

    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width) a call generates: given, else from the last image's aspect, else square."""
        res = call_args.get("output_resolution") or self.defaults["output_resolution"]
        h, w = call_args.get("height"), call_args.get("width")
        if call_args.get("image") is not None:
            last = load_condition_images(call_args["image"])[-1]
            cw, ch = calculate_dimensions(res * res, last.size[0] / last.size[1])
            h, w = h or ch, w or cw
        return (h or res) // 32 * 32, (w or res) // 32 * 32

    def prepare_images(self, images: list, res: int) -> tuple[list, list[torch.Tensor]]:
        """One resize per image (Lanczos, ~res² area, sides multiple of 32) for both encoders:
        (RGBA PIL images for the VL encoder, (1, 4, h, w) [-1, 1] tensors for the VAE)."""
        from PIL import Image

        vl, vae = [], []
        for im in images:
            im = im if im.mode == "RGBA" else im.convert("RGBA")
            w, h = calculate_dimensions(res * res, im.size[0] / im.size[1])
            r = im.resize((w, h), resample=Image.LANCZOS)
            vl.append(r)
            arr = np.asarray(r, dtype=np.float32) / 255.0  # (h, w, 4)
            vae.append(torch.from_numpy(arr).permute(2, 0, 1)[None] * 2.0 - 1.0)
        return vl, vae

    def encode_images(self, vae_in: list[torch.Tensor], B: int) -> tuple[torch.Tensor, list]:
        """Normalised, packed latents of the condition images (B, M, C) and their (1, h, w) grids."""
        vcfg, packed, shapes = self.vae.cfg, [], []
        mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1)
        std = torch.tensor(vcfg.latents_std).view(1, -1, 1, 1)
        with self._vae_resident():
            for x in vae_in:
                z, _ = self.vae.encode(x.to(self.device, self.vae_dtype))
                z = (z - mean.to(z)) / std.to(z)  # (1, C, h, w)
                packed.append(z.flatten(2).transpose(1, 2).expand(B, -1, -1))
                shapes.append((1, z.shape[2], z.shape[3]))
        return torch.cat(packed, dim=1).to(self.dtype), shapes

    def decode_latents(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, h*w, C) latents -> (B, 4, 16h, 16w) RGBA in [-1, 1]."""
        vcfg, vdt = self.vae.cfg, self.vae_dtype
        z = x.transpose(1, 2).reshape(x.shape[0], -1, h, w).to(vdt)
        z = z * torch.tensor(vcfg.latents_std).view(1, -1, 1, 1).to(z) + torch.tensor(vcfg.latents_mean).view(
            1, -1, 1, 1
        ).to(z)
        with self._vae_resident():
            if not self._options.decode_per_image:
                return vae_decode(self.vae, z)
            return torch.cat([vae_decode(self.vae, z[r : r + 1]) for r in range(z.shape[0])])

    def preview_images(self, latents: torch.Tensor, height: int, width: int, max_px: int = 192) -> list:
        """PIL previews (long side <= ~max_px) of a step callback's (B, h*w, C) latents: the latent grid
        area-shrunk, then decoded by the real VAE (RGBA), as `PipelineBase.preview_images` does."""
        import torch.nn.functional as F

        h, w = height // 16, width // 16
        z = latents.transpose(1, 2).reshape(latents.shape[0], -1, h, w)  # (B, C, h, w)
        scale = min(1.0, max(2, max_px // 16) / max(h, w))
        if scale < 1.0:
            z = F.interpolate(
                z.float(), size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area"
            )
        hh, ww = z.shape[-2:]
        with torch.no_grad():
            img = self.decode_latents(z.flatten(2).transpose(1, 2).to(latents.dtype), hh, ww)
        return postprocess(img, "pil")

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        image: Any = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
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
        output_resolution: int | None = None,
        use_kv_cache: bool = True,
        scheduler_overrides: dict | None = None,
        callback: S.StepCallback | None = None,
    ) -> QwenImageOutput | tuple:
        """diffusers' `QwenImage21Pipeline.__call__` arguments and defaults. `image`: 1-10 condition
        images (PIL, array or path; RGBA kept), one set shared by every prompt. `callback(i, n,
        latents)` after each step, as the other qwenfast pipelines."""
        call = DiffusersCall(
            self, None, attention_kwargs, callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        d = self.defaults
        res = d["output_resolution"] if output_resolution is None else output_resolution
        images = load_condition_images(image) if image is not None else None
        height, width = self.output_size(
            {"image": images, "height": height, "width": width, "output_resolution": res}
        )
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        if sigmas is None:
            sigmas = self.sample_sigmas
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of `prompt` or `prompt_embeds`")
        if prompt_embeds is not None and images is not None:
            raise ValueError("`prompt_embeds` cover text only here; pass `prompt` with condition images")
        self._check(height, width, steps, num_images_per_prompt, output_type, 512, sigmas)
        h, w = height // 16, width // 16
        vl_images, vae_in = self.prepare_images(images, res) if images is not None else (None, None)

        n = num_images_per_prompt
        if prompt_embeds is not None:
            emb, mask, slots = prompt_embeds, prompt_embeds_mask, None
            negs = None if negative_prompt_embeds is None else ()
        else:
            prompts = as_prompt_list(prompt, "prompt")
            negs = negative_prompts(prompts, negative_prompt)
            emb, mask, slots = self.text_encoder.encode(prompts, vl_images)
        do_cfg = cfg_scale > 1 and negs is not None
        if cfg_scale > 1 and negs is None:
            log.info("true_cfg_scale=%s but no negative_prompt: classifier-free guidance is off", cfg_scale)
        par = self._options.parallel
        cfg_split = par is not None and par.cfg == 2
        if cfg_split and not do_cfg:
            raise OptionsError(
                f"parallel {par} splits CFG over two ranks, but this call has no CFG (give a "
                "negative_prompt and true_cfg_scale > 1, or use parallel 'ulysses=N' alone)"
            )
        cond, slot_rows = self._cond(emb, mask, slots, n)
        uncond, neg_slots = None, None
        if do_cfg:
            if prompt_embeds is not None:
                ne, nm, ns = negative_prompt_embeds, negative_prompt_embeds_mask, None
            else:
                ne, nm, ns = self.text_encoder.encode(negs, vl_images)
            uncond, neg_slots = self._cond(ne, nm, ns, n)
        B = cond.emb.shape[0]
        ref = self.encode_images(vae_in, B) if vae_in is not None else None
        C = self.transformer.cfg.in_channels
        if latents is None:
            x = (
                randn_tensor((B, 1, C, h, w), generator, self.device, self.dtype)
                .view(B, C, h * w)
                .transpose(1, 2)
            )
        elif tuple(latents.shape) != (B, h * w, C):
            raise ValueError(f"latents must have shape {(B, h * w, C)} (packed), got {tuple(latents.shape)}")
        else:
            x = latents.to(self.device, self.dtype)
        img_shapes = [(1, h, w), *(ref[1] if ref is not None else [])]
        sig = S.get_sigmas(self.scheduler_config_for(scheduler_overrides), steps, x.shape[1], sigmas).to(
            self.device
        )
        forward = _Forward21(
            self,
            {"cond": slot_rows, "uncond": neg_slots},
            use_kv_cache and self.transformer.cfg.causal_condition,
        )
        if self._parallel is not None:  # the prefix whole on every rank, the target tokens sharded
            from ..runtime.parallel21 import PrefixParallelForward

            forward = PrefixParallelForward(forward, self._parallel, forward.prefix_len)
        events: list[str] = []
        with self._engine(), call:
            # one CFG forward per branch (their layouts differ); cfg=2 takes them as one batched call
            # that it splits back into the two branches, one per rank
            x = self._denoise_batch(
                forward,
                x,
                sig,
                img_shapes,
                cond,
                uncond,
                cfg_scale,
                None if ref is None else ref[0],
                callback,
                guidance=S.plain_cfg,
                events=events,
                step_end=call.step_end,
                batched_cfg=cfg_split,
            )
            info = {"oom_backoff": events} if events else {}
            if self._parallel is not None:
                info["parallel"] = {"layout": str(par), **forward.stats}
            out = x if output_type == "latent" else postprocess(self.decode_latents(x, h, w), output_type)
        return call.output(QwenImageOutput(images=out, info=info), return_dict)

    def _cond(self, emb, mask, slots, n: int) -> tuple[S.TextCond, torch.Tensor]:
        """TextCond repeated per image (`repeat_interleave`, as diffusers' repeat + view) and the shared
        image-slot row (diffusers reads the layout from row 0)."""
        if slots is None:
            slots = torch.zeros(emb.shape[:2], dtype=torch.bool)
        emb, mask = self._repeat(emb, mask, n)
        if mask is not None and bool(mask.all()):
            mask = None
        return S.TextCond(emb, mask), slots[0].cpu()  # the layout is host-side (no sync in a graph)
