"""`QwenImagePipeline`: text-to-image with diffusers' call signature and diffusers' images.

The step loop is plain Python on purpose (flux-style `denoise`): every speed trick (batched CFG,
CUDA graphs, fused kernels) lives in the model or runtime and can be switched off without touching
this file, and the loop stays readable for anyone checking it against diffusers.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import SchedulerConfig
from ..loading.diffusers_folder import inspect_folder, load_scheduler_config, load_transformer, load_vae
from ..loading.weights import CheckpointError
from ..models.text_encoder import TextEncoder
from ..runtime.cuda_graphs import CudaGraphRunner
from ..runtime.oom import vae_decode as _vae_decode_backoff
from ..runtime.oom import with_oom_backoff
from . import scheduler as S

log = logging.getLogger("qwenfast")

# The embedded default: a small trained Qwen-Image for 128x128 pictures of shapes (tools/train_demo.py).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo-t2i"
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class QwenImageOutput:
    images: Any  # list[PIL.Image] | np.ndarray (B, H, W, 3) in [0, 1] | torch.Tensor | packed latents
    info: dict = field(default_factory=dict)


def load_folder(path, device, dtype, offload: str, kinds: tuple[str, ...], wrong_kind: str) -> SimpleNamespace:
    """Check a diffusers folder and load its components where an offload mode wants them (offloaded
    parts on the CPU, so the GPU never holds them all). Also reads the optional qwenfast.json (`extra`:
    sampling defaults, image areas). `wrong_kind` says what to use when the folder's kind is not in
    `kinds`."""
    from ..runtime.offload import check_mode

    path = Path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kind, problems = inspect_folder(path)
    if problems:
        raise CheckpointError(f"{path} is not a complete Qwen-Image model folder:\n  - " + "\n  - ".join(problems))
    if kind not in kinds:
        raise CheckpointError(f"{path} is a Qwen-Image {kind} model; {wrong_kind}")
    cpu = torch.device("cpu")
    extra = json.loads((path / "qwenfast.json").read_text()) if (path / "qwenfast.json").is_file() else {}
    return SimpleNamespace(
        path=path, device=dev, kind=kind, extra=extra,
        transformer=load_transformer(path / "transformer", cpu if check_mode(offload) == "blocks" else dev, dt),
        vae=load_vae(path / "vae", dev, dt),
        te=TextEncoder.from_pretrained(path / "text_encoder", path / "tokenizer", cpu if offload != "none" else dev, dt),
        sched=load_scheduler_config(path / "scheduler"),
    )  # fmt: skip


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


def randn_tensor(shape, generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
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
        return torch.cat([torch.randn(one, generator=g, device=rand_device, dtype=dtype) for g in generator]).to(device)
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype).to(device)


def _as_prompt_list(prompt, name: str) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError(f"`{name}` is an empty list; give at least one prompt")
    raise TypeError(f"`{name}` must be a string or a list of strings, got {type(prompt).__name__}")


class QwenImagePipeline:
    """Text-to-image. `QwenImagePipeline.from_pretrained(path)(prompt).images[0]`."""

    def __init__(self, transformer, vae, text_encoder: TextEncoder, scheduler_config: SchedulerConfig,
                 *, model_path: str = "", defaults: dict | None = None):  # fmt: skip
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.scheduler_config = scheduler_config
        self.model_path = model_path
        self.defaults = {"height": 1024, "width": 1024, "num_inference_steps": 50, "true_cfg_scale": 4.0}
        self.defaults.update(defaults or {})
        self.progress_bar = True
        # cond + uncond in one batch-2 forward (exact; see join_text). "auto": only when no padding mask
        # is needed (prompts of equal length); a masked batch-2 attention costs more (cuDNN +58%) than
        # the second unmasked pass saves. True / False force it on / off.
        self.batched_cfg: bool | str = "auto"
        self.cuda_graphs = True  # replay the transformer forward as a CUDA graph (CUDA only)
        self._graphs = CudaGraphRunner(transformer)
        self.vae_scale_factor = vae.cfg.scale_factor
        # scheduler fields every call uses (set by apply_preset or by hand); a call's own
        # `scheduler_overrides=` wins key by key
        self.scheduler_overrides: dict = {}
        self.oom_backoff = True  # split the batch on CUDA OOM, then tile / offload (runtime/oom.py)
        self.offload = "none"  # none | model | blocks (enable_offload)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device=None, dtype=None,
                        offload: str = "none") -> QwenImagePipeline:  # fmt: skip
        """Load a diffusers-layout folder (None = the embedded tiny default model).

        `offload`: "none" | "model" (text encoder in host memory, on the GPU only while encoding) |
        "blocks" (also the transformer blocks streamed from host memory); see `enable_offload`.
        Offloaded parts are loaded to the CPU, so the GPU never holds them all at once.
        """
        f = load_folder(path if path is not None else DEFAULT_MODEL, device, dtype, offload, ("text-to-image",),
                        "QwenImagePipeline runs text-to-image checkpoints (use QwenImageEditPipeline or "
                        "`qwenfast edit`)")  # fmt: skip
        pipe = cls(f.transformer, f.vae, f.te, f.sched, model_path=str(f.path), defaults=f.extra.get("defaults"))
        if offload != "none":
            pipe.enable_offload(offload, device=f.device)
        return pipe

    @classmethod
    def from_single_files(cls, transformer, vae, text_encoder, tokenizer=None, device=None, dtype=None,
                          scheduler=None, *, transformer_config=None, vae_config=None, text_encoder_config=None):  # fmt: skip
        """Load ComfyUI-style single files (bf16 or FP8) + a tokenizer folder; see `qwenfast.loading.single_file`.

        Configs are inferred from the tensors; `*_config` (dict of fields, or a config.json path) override
        them for non-standard sizes. `scheduler` defaults to Qwen-Image's scheduler config.
        """
        from ..loading.single_file import load_single_files

        dev = resolve_device(device)
        c = load_single_files(transformer, vae, text_encoder, tokenizer, device=dev, dtype=resolve_dtype(dtype, dev),
                              scheduler=scheduler, transformer_config=transformer_config, vae_config=vae_config,
                              text_encoder_config=text_encoder_config)  # fmt: skip
        te, sched = c.text_encoder, c.scheduler_config
        return cls(c.transformer, c.vae, te, sched, model_path=c.model_path, defaults=None)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def size_note(self, width: int, height: int) -> str | None:
        """A one-line note when width x height is far from the size the model was trained at (its
        qwenfast.json `"trained_size": [W, H]`, as the 128² demo has), else None. For the CLI and the
        server to show once; the call itself does not warn (see `qwenfast.validation.size_note`)."""
        from ..validation import parse_trained_size, size_note

        if "_trained_size" not in self.__dict__:
            f = Path(self.model_path) / "qwenfast.json" if self.model_path else None
            extra = json.loads(f.read_text()) if f is not None and f.is_file() else {}
            self._trained_size = parse_trained_size(extra.get("trained_size"), str(f))
        return size_note(self._trained_size, width, height)

    # ---------------------------------------------------------------- LoRA and presets (qwenfast/loading/lora.py)
    @property
    def lora_manager(self):
        """The LoRAs fused into `self.transformer` (created on first use; see `LoraManager`)."""
        m = self.__dict__.get("_lora_manager")
        if m is None or m.model is not self.transformer:
            if m is not None and m.active:
                raise RuntimeError("pipe.transformer was replaced while LoRAs were fused into the old one")
            from ..loading.lora import LoraManager

            m = self._lora_manager = LoraManager(self.transformer)
        return m

    def load_lora(self, lora: str | Path | dict, strength: float = 1.0, name: str | None = None) -> str:
        """Fuse a LoRA (.safetensors path or state dict, any common naming) into the transformer; returns its name.

        Several LoRAs stack. Errors (unknown layers, wrong shapes, unreadable file) are raised before
        any weight changes. The original values of touched weights are kept in host memory so that
        `unload_lora` restores them bitwise (as much host memory as the touched weights).
        """
        self._check_lora_change()
        return self.lora_manager.load(lora, strength, name)

    def unload_lora(self, name: str | None = None) -> None:
        """Remove one LoRA by name, or all of them: touched weights are restored bitwise."""
        self._check_lora_change()
        self.lora_manager.unload(name)

    @property
    def loras(self) -> dict[str, float]:
        """Active LoRAs, name -> strength, in load order."""
        return self.lora_manager.loras

    def set_loras(self, loras) -> None:
        """Make the active LoRAs exactly `[(path, strength[, name]), ...]`, changing only what differs."""
        if not getattr(self, "_fp8", False) or list(loras) or self.loras:  # "none -> none" is fine with FP8
            self._check_lora_change()
            self.lora_manager.set(loras)

    def apply_preset(self, name: str) -> None:
        """Sampling defaults for a distilled LoRA (`qwenfast.config.PRESETS`): steps, true CFG and scheduler fields.

        Sets `self.defaults` (explicit call arguments still win) and `self.scheduler_overrides`.
        """
        from ..config import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        p = PRESETS[name]
        self.defaults.update(num_inference_steps=p.steps, true_cfg_scale=p.true_cfg_scale)
        self.scheduler_overrides = dict(p.scheduler_overrides)

    def scheduler_config_for(self, overrides: dict | None = None) -> SchedulerConfig:
        """The scheduler config of one call: checkpoint config <- `self.scheduler_overrides` <- `overrides`."""
        merged = {**getattr(self, "scheduler_overrides", {}), **(overrides or {})}
        return self.scheduler_config.replace(**merged) if merged else self.scheduler_config

    # ---------------------------------------------------------------- prompt
    def encode_prompt(self, prompts: list[str], num_images_per_prompt: int = 1, max_sequence_length: int = 512):
        emb, mask = self.text_encoder.encode(prompts, max_sequence_length=max_sequence_length)
        emb = emb.to(self.device, self.dtype).repeat_interleave(num_images_per_prompt, dim=0)
        if mask is not None:
            mask = mask.to(self.device).repeat_interleave(num_images_per_prompt, dim=0)
        return emb, mask

    # ---------------------------------------------------------------- generation
    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width) in pixels that a call with these (bound) arguments generates."""
        d = self.defaults
        return call_args.get("height") or d["height"], call_args.get("width") or d["width"]

    def enable_offload(self, mode: str = "model", device=None, vae: bool = False, ring: int = 2) -> None:
        """Fit smaller GPUs (`qwenfast.runtime.offload`): "model" keeps the text encoder (and with `vae=True`
        the VAE) in pinned host memory, on the GPU only while it runs; "blocks" also streams the
        transformer blocks through a ring of `ring` GPU buffers. Same images; "blocks" is PCIe-bound.
        Load LoRAs before; irreversible for this pipeline object (except "model" -> "blocks")."""
        from ..runtime.offload import enable

        enable(self, mode, device=device, vae=vae, ring=ring)

    @with_oom_backoff
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        true_cfg_scale: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_images_per_prompt: int = 1,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        max_sequence_length: int = 512,
        sigmas: list[float] | None = None,
        scheduler_overrides: dict | None = None,
        callback: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> QwenImageOutput:
        d = self.defaults
        height = d["height"] if height is None else height
        width = d["width"] if width is None else width
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        prompts = _as_prompt_list(prompt, "prompt")
        h, w = self._check(height, width, steps, num_images_per_prompt, output_type, max_sequence_length, sigmas)
        negs = negative_prompts(prompts, negative_prompt)
        do_cfg = cfg_scale > 1 and negs is not None
        if cfg_scale > 1 and negs is None:
            log.info("true_cfg_scale=%s but no negative_prompt: classifier-free guidance is off", cfg_scale)

        B = len(prompts) * num_images_per_prompt
        emb, mask = self.encode_prompt(prompts, num_images_per_prompt, max_sequence_length)
        if do_cfg:
            nemb, nmask = self.encode_prompt(negs, num_images_per_prompt, max_sequence_length)

        dev = self.device
        x = self.initial_latents(B, h, w, generator, latents)  # (B, h/2*w/2, 64)
        img_shapes = [(1, h // 2, w // 2)]

        cfg = self.scheduler_config_for(scheduler_overrides)
        sig = S.get_sigmas(cfg, steps, x.shape[1], sigmas).to(dev)
        x = self.denoise(x, sig, img_shapes, (emb, mask), (nemb, nmask) if do_cfg else None, cfg_scale, callback=callback)

        if output_type == "latent":
            return QwenImageOutput(images=x)
        image = self.decode_latents(x, h, w)  # (B, 3, H, W) in [-1, 1]
        return QwenImageOutput(images=postprocess(image, output_type))

    def initial_latents(self, B: int, h: int, w: int, generator, latents=None) -> torch.Tensor:
        """Packed starting noise (B, h/2*w/2, 64) drawn as diffusers draws it, or the caller's `latents`."""
        if latents is None:
            noise = randn_tensor((B, 1, 16, h, w), generator, self.device, self.dtype)
            return S.pack_latents(noise[:, 0])
        want = (B, (h // 2) * (w // 2), 64)
        if tuple(latents.shape) != want:
            raise ValueError(f"latents must have shape {want} (packed), got {tuple(latents.shape)}")
        return latents.to(self.device, self.dtype)

    def denoise(self, x, sig, img_shapes, text, neg_text=None, cfg_scale: float = 1.0, cond_latents=None,
                callback=None) -> torch.Tensor:  # fmt: skip
        """The sampling loop, shared by text-to-image and edit: Euler steps over `sig` (fp32 math).

        x: (B, N, 64) packed noise latents. text / neg_text: (embeds, mask) pairs (neg_text None = no
        CFG). cond_latents: (B, M, 64) packed reference-image latents appended after the noise tokens
        (edit); the prediction is cut back to the first N tokens.
        """
        ts = S.timesteps_from_sigmas(sig)
        B, N = x.shape[:2]
        emb, mask = text
        batched = neg_text is not None and bool(self.batched_cfg)
        if batched:
            emb2, mask2 = join_text(emb, mask, *neg_text)
            if self.batched_cfg == "auto" and mask2 is not None:
                batched = False
        for i in tqdm(range(len(ts)), desc="denoising", unit="step", disable=not self.progress_bar, leave=False):
            t = S.model_timestep(ts[i], B, x.dtype)
            inp = x if cond_latents is None else torch.cat([x, cond_latents], dim=1)
            if batched:
                pred, neg = self._forward(torch.cat([inp, inp]), emb2, mask2, torch.cat([t, t]), img_shapes).chunk(2)
                pred = S.true_cfg(pred[:, :N], neg[:, :N], cfg_scale)
            else:
                pred = self._forward(inp, emb, mask, t, img_shapes)[:, :N]
                if neg_text is not None:
                    neg = self._forward(inp, *neg_text, t, img_shapes)[:, :N]
                    pred = S.true_cfg(pred, neg, cfg_scale)
            x = S.euler_step(x, pred, sig[i], sig[i + 1])
            if callback is not None:
                callback(i, len(ts), x)
        return x

    def _forward(self, x, emb, mask, t, img_shapes):
        if self.cuda_graphs and x.is_cuda:
            return self._graphs(x, emb, mask, t, img_shapes)
        return self.transformer(x, emb, mask, t, img_shapes)

    def enable_fp8(self) -> int:
        """Run the transformer blocks' big Linears as FP8 e4m3 GEMMs (rowwise scales, Hopper/Ada).

        About 1.8x faster GEMMs; not bitwise diffusers any more (see `qwenfast.kernels.fp8_linear`).
        Irreversible for this pipeline object: LoRAs loaded before are baked into the FP8 weights, and
        the LoRA set cannot change afterwards. Returns the number of layers converted.
        """
        from ..kernels.fp8_linear import quantize_model

        n = quantize_model(self.transformer)
        self._fp8 = True
        self._graphs.clear()
        return n

    def _check_lora_change(self):
        if getattr(self, "_fp8", False):
            raise RuntimeError("LoRAs cannot change after enable_fp8(): load them first, then enable FP8 "
                               "(reload the model to use another LoRA set)")  # fmt: skip

    def decode_latents(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        vcfg = self.vae.cfg
        vdt = self.vae_dtype
        z = S.unpack_latents(x, h, w).to(vdt)  # (B, 16, h, w)
        mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1).to(z.device, vdt)
        inv_std = 1.0 / torch.tensor(vcfg.latents_std).view(1, -1, 1, 1).to(z.device, vdt)
        return _vae_decode_backoff(self.vae, z / inv_std + mean)  # splits / tiles on CUDA OOM

    @property
    def vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def _check(self, height, width, steps, n, output_type, max_sequence_length, sigmas) -> tuple[int, int]:
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 16:
                raise ValueError(f"`{name}` must be an integer >= 16 (pixels), got {v!r}")
        mult = self.vae_scale_factor * 2
        if height % mult or width % mult:
            warnings.warn(
                f"height and width must be multiples of {mult}; {height}x{width} is floored to "
                f"{height // mult * mult}x{width // mult * mult} (as diffusers does)",
                stacklevel=3,
            )
        if sigmas is None and (not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"`num_inference_steps` must be an integer >= 1, got {steps!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"`num_images_per_prompt` must be an integer >= 1, got {n!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if not 1 <= max_sequence_length <= 1024:
            raise ValueError(f"`max_sequence_length` must be in 1..1024, got {max_sequence_length}")
        return S.latent_hw(height, width, self.vae_scale_factor)


def join_text(emb, mask, nemb, nmask):
    """Stack conditional and negative prompt embeddings into one batch for a single forward.

    The shorter side is right-padded with zeros and masked out as attention keys, which makes each
    sample's result equal to its own forward (padded keys get zero weight; the extra text tokens are
    dropped at the end and never reach the image). No mask at all when both sides are unpadded and
    equally long, since a mask costs ~1.6x in attention.
    """
    L = max(emb.shape[1], nemb.shape[1])

    def pad(e, m):
        n = e.shape[1]
        m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if m is None else m
        if n < L:
            e = torch.cat([e, e.new_zeros(e.shape[0], L - n, e.shape[2])], dim=1)
            m = torch.cat([m, m.new_zeros(m.shape[0], L - n)], dim=1)
        return e, m

    (e1, m1), (e2, m2) = pad(emb, mask), pad(nemb, nmask)
    m = torch.cat([m1, m2])
    return torch.cat([e1, e2]), (None if bool(m.all()) else m)


def negative_prompts(prompts: list[str], negative_prompt) -> list[str] | None:
    """The negative prompt(s) as a list matching `prompts` (one is repeated), or None."""
    if negative_prompt is None:
        return None
    negs = _as_prompt_list(negative_prompt, "negative_prompt")
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
