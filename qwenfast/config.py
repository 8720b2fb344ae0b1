"""Model configs as plain dataclasses, read from the checkpoint's own config files.

Why dataclasses and not the diffusers ConfigMixin: the engine must not import diffusers at run time,
and a frozen dataclass makes every field the model uses visible in one place. Each `from_dict`
accepts the exact JSON diffusers writes (`config.json`, `scheduler_config.json`), ignores the
bookkeeping keys (`_class_name`, `_diffusers_version`, ...) and refuses fields we do not implement
with a message that names them, so an unknown checkpoint variant fails loudly instead of silently
producing a different image.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError  # noqa: F401 - re-exported: qwenfast.config.ConfigError


def _from_dict(cls, d: dict[str, Any], where: str, unsupported: dict[str, Any] | None = None):
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs, unknown = {}, []
    for k, v in d.items():
        if k.startswith("_"):
            continue
        if k in names:
            kwargs[k] = v
        elif unsupported and k in unsupported:
            if v != unsupported[k]:
                raise ConfigError(
                    f"{where}: `{k}={v!r}` is not supported by qwenfast (only {unsupported[k]!r})"
                )
        else:
            unknown.append(k)
    if unknown:
        raise ConfigError(
            f"{where}: unknown config fields {sorted(unknown)}; is this a Qwen-Image checkpoint?"
        )
    for k, v in kwargs.items():  # JSON gives lists where the dataclass holds tuples
        if isinstance(v, list):
            kwargs[k] = tuple(v)
    return cls(**kwargs)


@dataclass(frozen=True)
class TransformerConfig:
    """`QwenImageTransformer2DModel` config (transformer/config.json)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False  # Edit-2511: reference-image tokens are modulated with t=0
    use_additional_t_cond: bool = False  # Qwen-Image-Layered: learned embedding added to temb
    use_layer3d_rope: bool = False  # Qwen-Image-Layered: last image (the condition) at frame -1
    guidance_embeds: bool = False  # unused by released checkpoints; diffusers cannot run it either

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        return self.out_channels or self.in_channels

    def __post_init__(self):
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ConfigError(
                f"transformer config: axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                f"{self.attention_head_dim}"
            )
        if any(a % 2 for a in self.axes_dims_rope):
            raise ConfigError(f"transformer config: axes_dims_rope {self.axes_dims_rope} must all be even")
        if self.guidance_embeds:
            raise ConfigError(
                "transformer config: guidance_embeds=true is not supported (no released checkpoint uses it)"
            )
        if self.patch_size != 2:
            raise ConfigError(f"transformer config: patch_size {self.patch_size} is not supported (only 2)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        return _from_dict(cls, d, "transformer/config.json")

    def flops_per_forward(self, img_tokens: int, txt_tokens: int, batch: int = 1) -> float:
        """Matmul + attention FLOPs of one forward (2 per multiply-add), for the benchmark's floor."""
        d, L = self.inner_dim, img_tokens + txt_tokens
        per_block_linear = 2 * L * (3 * d * d + d * d + 2 * 4 * d * d)  # qkv, out, mlp (both streams)
        return batch * self.num_layers * per_block_linear + self.attention_flops(
            img_tokens, txt_tokens, batch
        )

    def attention_flops(self, img_tokens: int, txt_tokens: int, batch: int = 1) -> float:
        """The attention part of `flops_per_forward`: QK^T and PV of the joint sequence, every layer."""
        L = img_tokens + txt_tokens
        return batch * self.num_layers * 2 * 2 * L * L * self.inner_dim


@dataclass(frozen=True)
class VAEConfig:
    """`AutoencoderKLQwenImage` config (vae/config.json)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = (
        -0.7571,
        -0.7089,
        -0.9113,
        0.1075,
        -0.1745,
        0.9653,
        -0.1517,
        1.5508,
        0.4134,
        -0.0715,
        0.5517,
        -0.3632,
        -0.1922,
        -0.9497,
        0.2503,
        -0.2921,
    )
    latents_std: tuple[float, ...] = (
        2.8184,
        1.4541,
        2.3275,
        2.6558,
        1.2196,
        1.7708,
        2.6052,
        2.0743,
        3.2687,
        2.1526,
        2.8652,
        1.5579,
        1.6382,
        1.1253,
        2.8251,
        1.9160,
    )

    @property
    def scale_factor(self) -> int:
        return 2 ** len(self.temperal_downsample)

    def __post_init__(self):
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ConfigError(f"vae config: latents_mean/latents_std must have z_dim={self.z_dim} entries")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VAEConfig:
        return _from_dict(cls, d, "vae/config.json")


@dataclass(frozen=True)
class SchedulerConfig:
    """`FlowMatchEulerDiscreteScheduler` config (scheduler/scheduler_config.json).

    Defaults are diffusers' class defaults (not Qwen-Image's values), because diffusers fills any
    key a checkpoint's JSON leaves out with those; `QWEN_IMAGE_SCHEDULER` holds the shipped values.
    Only the fields Qwen-Image checkpoints and the Lightning/Turbo recipes use are implemented;
    karras/exponential/beta sigmas and stochastic sampling are refused by name.
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float | None = None
    time_shift_type: str = "exponential"
    invert_sigmas: bool = False

    def __post_init__(self):
        if self.time_shift_type not in ("exponential", "linear"):
            raise ConfigError(
                f"scheduler config: time_shift_type {self.time_shift_type!r} (allowed: exponential, linear)"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulerConfig:
        off = {
            "use_karras_sigmas": False,
            "use_exponential_sigmas": False,
            "use_beta_sigmas": False,
            "stochastic_sampling": False,
        }
        return _from_dict(cls, d, "scheduler/scheduler_config.json", unsupported=off)

    def replace(self, **kw) -> SchedulerConfig:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class SamplingPreset:
    """A named recipe (steps, CFG, scheduler overrides) for distilled LoRAs and common setups."""

    steps: int
    true_cfg_scale: float
    scheduler_overrides: dict[str, Any] = field(default_factory=dict)


# Lightning / Turbo LoRAs were distilled with a fixed shift of 3 (mu = ln 3) and no terminal stretch.
_DISTILLED = {"base_shift": math.log(3.0), "max_shift": math.log(3.0), "shift_terminal": None}
PRESETS: dict[str, SamplingPreset] = {
    "default": SamplingPreset(steps=50, true_cfg_scale=4.0),
    "lightning-8": SamplingPreset(steps=8, true_cfg_scale=1.0, scheduler_overrides=_DISTILLED),
    "lightning-4": SamplingPreset(steps=4, true_cfg_scale=1.0, scheduler_overrides=_DISTILLED),
    "turbo-4": SamplingPreset(steps=4, true_cfg_scale=1.0, scheduler_overrides=_DISTILLED),
}

# Qwen-Image-2.1's turbo presets (`QwenImage21Pipeline.apply_preset`, `--preset`): sigmas before the
# scheduler's shift, the terminal 0 excluded. "turbo-8" is the grid Qwen-Image-2.1-Turbo ships in model_index.json.
TURBO_SIGMAS: dict[str, tuple[float, ...]] = {
    "turbo-8": (1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568),
    "turbo-4": (1.0, 0.926626, 0.845148, 0.414568),
}

# Full-size architecture, for benchmarks with random weights (no checkpoint needed).
QWEN_IMAGE = TransformerConfig()
QWEN_IMAGE_EDIT_2511 = TransformerConfig(zero_cond_t=True)
QWEN_IMAGE_VAE = VAEConfig()
QWEN_IMAGE_SCHEDULER = SchedulerConfig(
    use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02
)


@dataclass(frozen=True)
class ControlNetConfig:
    """`QwenImageControlNetModel` config (controlnet/config.json; InstantX Union: 5 layers, Inpainting:
    `extra_condition_channels` 4 for the packed mask channel)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    extra_condition_channels: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlNetConfig:
        return _from_dict(cls, d, "controlnet/config.json")

    def transformer_config(self) -> TransformerConfig:
        """The config of its blocks (the transformer's own block code, no zero_cond_t)."""
        return TransformerConfig(
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name != "extra_condition_channels"
            }
        )


# InstantX/Qwen-Image-ControlNet-Union (the diffusers default config, 5 layers)
QWEN_IMAGE_CONTROLNET_UNION = ControlNetConfig(num_layers=5)
