"""Single-file checkpoints (ComfyUI split files and all-in-one files), bf16 or FP8.

Why: most users have `qwen_image_fp8_e4m3fn.safetensors` + `qwen_image_vae.safetensors` +
`qwen_2.5_vl_7b_fp8_scaled.safetensors` from ComfyUI, not the Hugging Face folder. Those files carry
no config and no tokenizer, use other key names, and may be FP8. Here each file's header is read
first (`fp8.read_header` / `fp8.plan_quantization`), its layout is recognised from the key names,
the model config is inferred from the tensor shapes, and only then is anything loaded: the model is
built on `meta` and the tensors stream in one at a time (`weights.load_streaming`), dequantised on
the target device. Every file is checked before the first one is loaded, so a bad VAE path fails in
a second, not after 40 GB of transformer.

Layouts:
- transformer: diffusers `QwenImageTransformer2DModel` keys, bare or prefixed `model.diffusion_model.`
  / `diffusion_model.` (other prefixes of an all-in-one file are skipped unread); text-stream Q/K/V
  separate or fused as `attn.add_qkv_proj` (image stream likewise as `attn.to_qkv`); the Edit-2511
  marker tensor `__index_timestep_zero__` is dropped and means `zero_cond_t=True`.
- VAE: the original Wan names (see `wan_vae_keys.wan_to_diffusers_vae_keys`, which matches diffusers'
  `convert_wan_vae_to_diffusers` and musubi-tuner's `convert_comfyui_state_dict`) or diffusers names,
  optionally prefixed `first_stage_model.` / `vae.`.
- text encoder (Qwen2.5-VL): `model.*` / `visual.*` / `lm_head.*` (ComfyUI, transformers 4) or
  `model.language_model.*` / `model.visual.*` (transformers 5). A missing `lm_head` (unused: only hidden
  states are taken) is tied to the embeddings, which costs no memory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..config import QWEN_IMAGE_SCHEDULER, ConfigError, SchedulerConfig, TransformerConfig, VAEConfig
from .fp8 import Header, QuantPlan, iter_plain_tensors, key_patterns, plan_quantization, read_header
from .wan_vae_keys import wan_to_diffusers_vae_keys
from .weights import CheckpointError, QKVFuser, load_streaming

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLConfig

    from ..models.text_encoder import TextEncoder
    from ..models.transformer import QwenImageTransformer
    from ..models.vae import QwenImageVAE

log = logging.getLogger("qwenfast")

TRANSFORMER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
VAE_PREFIXES = ("first_stage_model.", "vae.")
ZERO_COND_MARKER = "__index_timestep_zero__"
# RoPE axes are not stored in the weights; known per head dim (Qwen-Image: 128 -> 16/56/56).
ROPE_AXES_BY_HEAD_DIM = {128: (16, 56, 56)}
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct), in the flat form transformers reads.
QWEN25_VL_7B: dict[str, Any] = {
    "model_type": "qwen2_5_vl", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
    "max_position_embeddings": 128000, "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "sliding_window": 32768,
    "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu",
    },
}  # fmt: skip


@dataclass
class Source:
    """One checked file: its header, FP8 plan, and file key -> our (diffusers-layout) name for the keys used."""

    header: Header
    quant: QuantPlan
    names: dict[str, str]
    layout: str

    @property
    def path(self) -> Path:
        return self.header.path

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.header.shapes[k] for k, name in self.names.items()}

    def items(
        self, device: torch.device | str, dtype: torch.dtype, raw: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor, Path]]:
        """`raw(our name)` True: that tensor as stored if it is FP8 (see `iter_plain_tensors`)."""
        fp8 = None if raw is None else (lambda k: raw(self.names[k]))
        return iter_plain_tensors(
            self.header, self.quant, device, dtype, keep=self.names.__contains__, raw=fp8
        )

    def describe(self) -> str:
        return f"{self.path.name}: {self.layout}, {self.quant.kind}"


def _open(path, what: str) -> tuple[Header, QuantPlan, list[str]]:
    """Header, storage format, and the keys of model tensors (scales and markers left out)."""
    if path is None:
        raise CheckpointError(f"no {what} file given")
    header = read_header(path, what)
    quant = plan_quantization(header)
    return header, quant, [k for k in header.dtypes if k not in quant.aux]


def _split_prefix(keys: list[str], prefixes: tuple[str, ...]) -> tuple[str, list[str]]:
    """The first prefix some keys carry (only those keys are used), else no prefix and every key."""
    for p in prefixes:
        picked = [k for k in keys if k.startswith(p)]
        if picked:
            return p, picked
    return "", keys


def _config_dict(override, what: str) -> dict | None:
    """A config override given as a path (config.json, or a folder holding one) -> its JSON dict."""
    if override is None or isinstance(override, dict):
        return override
    if isinstance(override, (str, Path)):
        from .diffusers_folder import read_json

        p = Path(override)
        return read_json(p / "config.json" if p.is_dir() else p)
    raise TypeError(
        f"{what} config must be a dict, a config object or a path to config.json, got {type(override).__name__}"
    )


ASK = "<not stored in the weights>"  # an inferred field that only an override can give


def _make_config(cls, inferred: dict, override, what: str, path: Path):
    """Inferred fields, overridden field by field by `override` (a dict), or replaced by a full config."""
    if isinstance(override, cls):
        return override
    given = _config_dict(override, what)
    full = isinstance(override, (str, Path))  # a config.json describes the whole model
    merged = dict(given) if full else {**inferred, **(given or {})}
    ask = [k for k, v in merged.items() if v is ASK]
    if ask:
        raise CheckpointError(
            f"{path}: the {what} config fields {ask} cannot be read from the weights of this non-standard model; "
            f"give them ({what}_config={{...}} or a config.json; CLI --configs). Inferred: "
            + str({k: v for k, v in merged.items() if v is not ASK})
        )
    try:
        return cls.from_dict(merged)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {what} config {merged} is not valid ({e})") from e


# ---------------------------------------------------------------------------------------------- transformer


def inspect_transformer(
    path: Path | str, config: TransformerConfig | dict | Path | str | None = None
) -> tuple[Source, TransformerConfig]:
    header, quant, keys = _open(path, "transformer")
    prefix, keys = _split_prefix(keys, TRANSFORMER_PREFIXES)
    names = {k: k[len(prefix) :] for k in keys}
    shapes = {n: header.shapes[k] for k, n in names.items()}
    if "img_in.weight" not in shapes or not any(n.startswith("transformer_blocks.") for n in shapes):
        raise CheckpointError(
            _not_this(
                header,
                keys,
                "a Qwen-Image transformer",
                (
                    "diffusers/ComfyUI Qwen-Image names ('img_in.weight', 'transformer_blocks.N.attn.to_q.weight' or "
                    "'...attn.add_qkv_proj.weight', ...), bare or prefixed 'model.diffusion_model.' / 'diffusion_model.'"
                ),
            )
        )
    marker = [k for k, n in names.items() if n == ZERO_COND_MARKER]
    for k in marker:
        del names[k]
    cfg = _make_config(
        TransformerConfig, infer_transformer_config(shapes, header.path), config, "transformer", header.path
    )
    layout = f"transformer ({'prefix ' + repr(prefix) if prefix else 'no prefix'}"
    layout += (
        ", fused add_qkv_proj" if any(n.endswith("attn.add_qkv_proj.weight") for n in names.values()) else ""
    )
    layout += ", Edit-2511 marker: zero_cond_t" if marker else ""
    return Source(header, quant, names, layout + ")"), cfg


def infer_transformer_config(shapes: dict[str, tuple[int, ...]], path: Path | str = "") -> dict:
    """TransformerConfig fields from tensor shapes (diffusers names; fused or separate Q/K/V)."""
    blocks = sorted({int(m.group(1)) for n in shapes if (m := re.match(r"transformer_blocks\.(\d+)\.", n))})
    if not blocks or blocks != list(range(len(blocks))):
        gaps = sorted(set(range(blocks[-1] + 1)) - set(blocks)) if blocks else "all"
        raise CheckpointError(f"{path}: transformer blocks {gaps} are missing ({len(blocks)} found)")
    need = ("img_in.weight", "txt_in.weight", "proj_out.weight", "transformer_blocks.0.attn.norm_q.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise CheckpointError(f"{path}: cannot infer the transformer config, keys missing: {missing}")
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    cfg = {
        "patch_size": 2,
        "in_channels": in_channels,
        "out_channels": shapes["proj_out.weight"][0] // 4,  # patch 2x2 x out channels
        "num_layers": len(blocks),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "zero_cond_t": ZERO_COND_MARKER in shapes,
        "use_additional_t_cond": "time_text_embed.addition_t_embedding.weight" in shapes,
    }
    cfg["axes_dims_rope"] = ROPE_AXES_BY_HEAD_DIM.get(head_dim, ASK)  # not in the weights
    return cfg


def load_transformer_file(
    path: Path | str,
    device: torch.device | str,
    dtype: torch.dtype,
    config: TransformerConfig | dict | Path | str | None = None,
    source: tuple[Source, TransformerConfig] | None = None,  # from `inspect_transformer`
    fp8: bool = False,
) -> QwenImageTransformer:
    """A transformer single file -> `QwenImageTransformer` on `device` in `dtype`.

    `fp8`: the block Linears become `FP8Linear`s as the tensors stream in (`loading.fp8_weights`):
    FP8-stored weights keep their stored values and scales, others are quantised per row.
    """
    from ..kernels.fp8_linear import quantize_model
    from ..models.transformer import QwenImageTransformer, fuse_qkv_key
    from .fp8_weights import FP8Weights

    src, cfg = source or inspect_transformer(path, config)
    log.info("loading %s%s", src.describe(), " as FP8 weights" if fp8 else "")
    with torch.device("meta"):
        model = QwenImageTransformer(cfg)
        if fp8:
            quantize_model(model, empty=True, dtype=dtype)
    step = fuser = QKVFuser(fuse_qkv_key)
    if fp8:
        step = FP8Weights(model, dtype, fuser, fuse_qkv_key)

    def convert(key: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = src.names.get(key)
        return None if name is None else step(name, t)

    convert.check_done = fuser.check_done
    items = src.items(device, dtype, raw=step.wants if fp8 else None)
    return load_streaming(model, items, dtype=dtype, where=str(src.path), convert=convert)


# ---------------------------------------------------------------------------------------------- VAE


def inspect_vae(
    path: Path | str, config: VAEConfig | dict | Path | str | None = None
) -> tuple[Source, VAEConfig]:
    header, quant, keys = _open(path, "VAE")
    prefix, keys = _split_prefix(keys, VAE_PREFIXES)
    bare = {k: k[len(prefix) :] for k in keys}
    if any(n.startswith(("decoder.middle.", "decoder.upsamples.")) for n in bare.values()):
        mapping, unknown = wan_to_diffusers_vae_keys(list(bare.values()))
        if unknown:
            raise CheckpointError(
                _not_this(header, unknown, "a Wan-named VAE (some keys are not Wan VAE keys)", _VAE_OK)
            )
        names, layout = {k: mapping[n] for k, n in bare.items()}, "VAE (Wan / ComfyUI names)"
    elif any(n.startswith("decoder.mid_block.") for n in bare.values()):
        names, layout = bare, "VAE (diffusers names)"
    else:
        raise CheckpointError(_not_this(header, keys, "a Qwen-Image VAE", _VAE_OK))
    if prefix:
        layout = layout[:-1] + f", prefix {prefix!r})"
    src = Source(header, quant, names, layout)
    cfg = _make_config(VAEConfig, infer_vae_config(src.shapes(), header.path), config, "vae", header.path)
    return src, cfg


_VAE_OK = (
    "Wan names ('decoder.middle.0.residual.0.gamma', 'decoder.upsamples.N...', 'conv1.weight', ...) or "
    "diffusers names ('decoder.mid_block.resnets.0.norm1.gamma', ...), bare or prefixed 'first_stage_model.'/'vae.'"
)


def infer_vae_config(shapes: dict[str, tuple[int, ...]], path: Path | str = "") -> dict:
    """VAEConfig fields from diffusers-named shapes. `latents_mean/std` are not in the weights: Qwen-Image's
    values (VAEConfig's defaults) are used for z_dim 16; other VAEs need them in the override."""
    need = ("encoder.conv_in.weight", "post_quant_conv.weight")
    if any(k not in shapes for k in need):
        raise CheckpointError(
            f"{path}: cannot infer the VAE config, keys missing: {[k for k in need if k not in shapes]}"
        )
    base, in_ch = shapes["encoder.conv_in.weight"][:2]
    stage_dims, attn, temporal, nres = [[]], [], [], None
    down = sorted({int(m.group(1)) for n in shapes if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", n))})
    for i in down:
        p = f"encoder.down_blocks.{i}."
        if p + "conv1.weight" in shapes:
            stage_dims[-1].append(shapes[p + "conv1.weight"][0])
        elif p + "to_qkv.weight" in shapes:
            attn.append(1.0 / 2 ** (len(stage_dims) - 1))
        elif p + "resample.1.weight" in shapes:
            temporal.append(p + "time_conv.weight" in shapes)
            nres = nres if nres is not None else len(stage_dims[-1])
            stage_dims.append([])
    if not stage_dims[-1]:
        raise CheckpointError(f"{path}: the VAE encoder has no resnet after its last downsampler")
    cfg = {
        "base_dim": base,
        "z_dim": shapes["post_quant_conv.weight"][0],
        "dim_mult": [dims[-1] // base for dims in stage_dims],
        "num_res_blocks": nres if nres is not None else len(stage_dims[0]),
        "attn_scales": sorted(set(attn), reverse=True),
        "temperal_downsample": temporal,
        "input_channels": in_ch,
    }
    if cfg["z_dim"] != 16:  # Qwen-Image's latents_mean / latents_std (the defaults) have 16 entries
        cfg["latents_mean"] = cfg["latents_std"] = ASK
    return cfg


def load_vae_file(
    path: Path | str,
    device: torch.device | str,
    dtype: torch.dtype,
    config: VAEConfig | dict | Path | str | None = None,
    source: tuple[Source, VAEConfig] | None = None,  # from `inspect_vae`
) -> QwenImageVAE:
    from ..models.vae import QwenImageVAE, convert_vae_tensor

    src, cfg = source or inspect_vae(path, config)
    log.info("loading %s", src.describe())
    with torch.device("meta"):
        model = QwenImageVAE(cfg)

    def convert(key: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = src.names.get(key)
        return None if name is None else convert_vae_tensor(name, t)

    return load_streaming(model, src.items(device, dtype), dtype=dtype, where=str(src.path), convert=convert)


# ---------------------------------------------------------------------------------------------- text encoder


def _te_name(k: str) -> str | None:
    """A Qwen2.5-VL key in any naming -> transformers 5 name (`model.language_model.*`, `model.visual.*`)."""
    if k.startswith(("model.language_model.", "model.visual.", "lm_head.")):
        return k
    if k.startswith("visual."):
        return "model." + k
    if k.startswith("model."):
        return "model.language_model." + k[len("model.") :]
    return None


def inspect_text_encoder(
    path: Path | str, config: Qwen2_5_VLConfig | dict | Path | str | None = None
) -> tuple[Source, Qwen2_5_VLConfig]:
    header, quant, keys = _open(path, "text encoder")
    names = {k: _te_name(k) for k in keys}
    unknown = [k for k, n in names.items() if n is None]
    if unknown or "model.language_model.embed_tokens.weight" not in names.values():
        raise CheckpointError(
            _not_this(
                header,
                unknown or keys,
                "a Qwen2.5-VL text encoder",
                (
                    "'model.layers.N...' / 'model.embed_tokens.weight' / 'visual.blocks.N...' / 'lm_head.weight' (ComfyUI) "
                    "or 'model.language_model.*' / 'model.visual.*' (transformers 5)"
                ),
            )
        )
    current = any(k.startswith("model.language_model.") for k in keys)
    src = Source(
        header,
        quant,
        names,
        f"text encoder ({'transformers 5' if current else 'ComfyUI / transformers 4'} names)",
    )
    return src, text_encoder_config(src.shapes(), config, header.path)


def text_encoder_config(
    shapes: dict[str, tuple[int, ...]],
    config: Qwen2_5_VLConfig | dict | Path | str | None = None,
    path: Path | str = "",
) -> Qwen2_5_VLConfig:
    """A `Qwen2_5_VLConfig`: the given one, or Qwen2.5-VL-7B when the shapes are the 7B's.

    Head counts, RoPE sections and the vision tower's window layout are not readable from the
    weights, so any other size needs its config.json.
    """
    from transformers import Qwen2_5_VLConfig

    if isinstance(config, Qwen2_5_VLConfig):
        return config
    d = _config_dict(config, "text encoder")
    if d is None:
        vocab, hidden = shapes["model.language_model.embed_tokens.weight"]
        layers = len(
            {m.group(1) for n in shapes if (m := re.match(r"model\.language_model\.layers\.(\d+)\.", n))}
        )
        if (vocab, hidden, layers) != (152064, 3584, 28):
            raise CheckpointError(
                f"{path}: text encoder with vocab {vocab}, hidden size {hidden}, {layers} layers is not Qwen2.5-VL-7B "
                "(152064, 3584, 28): give its config.json (text_encoder_config=..., CLI --configs)"
            )
        d = QWEN25_VL_7B
    try:
        return Qwen2_5_VLConfig(
            **{k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: text encoder config is not a valid Qwen2.5-VL config ({e})") from e


@contextmanager
def _parameters_on_meta():
    """Build a module with its parameters on `meta` (no memory, no init) but real buffers.

    transformers computes RoPE `inv_freq` as non-persistent buffers at construction; they are not in
    any checkpoint, so they must be real while parameters must not be (7B params would be 30 GB fp32).
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def resolve_tokenizer(tokenizer: Path | str | None) -> Path:
    """The tokenizer folder (or a model folder with `tokenizer/`); a clear error when there is none."""
    how = (
        "ComfyUI single files carry no tokenizer: pass tokenizer=<folder> (CLI --tokenizer), e.g. the "
        "tokenizer/ folder of Qwen/Qwen-Image, with tokenizer.json or vocab.json + merges.txt"
    )
    if tokenizer is None:
        raise CheckpointError(f"no tokenizer given; {how}")
    p = Path(tokenizer)

    def ok(d: Path) -> bool:
        return (d / "tokenizer.json").is_file() or (
            (d / "vocab.json").is_file() and (d / "merges.txt").is_file()
        )

    if p.is_file() and p.name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        p = p.parent  # the folder of a tokenizer file
    if p.is_dir() and not ok(p) and ok(p / "tokenizer"):
        p = p / "tokenizer"  # a model folder
    if not p.is_dir() or not ok(p):
        found = sorted(x.name for x in p.iterdir())[:10] if p.is_dir() else "not a folder"
        raise CheckpointError(
            f"tokenizer {p}: no tokenizer.json or vocab.json + merges.txt (found: {found}); {how}"
        )
    return p


def load_text_encoder_file(
    path: Path | str,
    tokenizer: Path | str | None,
    device: torch.device | str,
    dtype: torch.dtype,
    config: Qwen2_5_VLConfig | dict | Path | str | None = None,
    source: tuple[Source, Qwen2_5_VLConfig] | None = None,  # from `inspect_text_encoder`
) -> TextEncoder:
    """A Qwen2.5-VL single file + tokenizer folder -> `TextEncoder`."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from ..models.text_encoder import TextEncoder

    tok_dir = resolve_tokenizer(tokenizer)
    src, cfg = source or inspect_text_encoder(path, config)
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as e:  # transformers raises many types here; the message is what matters
        raise CheckpointError(f"cannot load the tokenizer from {tok_dir}: {e}") from e
    log.info("loading %s", src.describe())
    with _parameters_on_meta():
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    embed = "model.language_model.embed_tokens.weight"
    items = src.items(device, dtype)
    if "lm_head.weight" not in src.names.values():
        items = _tie_head(items, src, embed)
    load_streaming(
        model, items, dtype=dtype, where=str(src.path), convert=lambda k, t: (src.names.get(k, k), t)
    )
    model.to(device)  # the RoPE buffers (parameters are there already)
    return TextEncoder(model.eval(), tok)


def _tie_head(items, src: Source, embed: str):
    """Pass items through, then give `lm_head.weight` the embedding tensor itself (shared, no copy)."""
    kept = None
    for key, t, f in items:
        if src.names[key] == embed:
            kept = t
        yield key, t, f
    if kept is not None:
        log.info("%s has no lm_head: tied to the embeddings (logits are not used)", src.path.name)
        yield "lm_head.weight", kept, src.path


# ---------------------------------------------------------------------------------------------- all parts


def _not_this(header: Header, keys, what: str, allowed: str) -> str:
    lora = [k for k in keys if re.search(r"lora_(A|B|up|down)\b|\.alpha$", k)]
    if lora:
        return (
            f"{header.path} is a LoRA file (keys like {key_patterns(lora, 2)}), not {what}; load it as a LoRA"
        )
    return f"{header.path} is not {what}: found keys like {key_patterns(keys, 4)}; supported: {allowed}"


@dataclass
class Components:
    transformer: nn.Module
    vae: nn.Module
    text_encoder: Any
    scheduler_config: SchedulerConfig
    model_path: str


def scheduler_config(scheduler: SchedulerConfig | dict | Path | str | None) -> SchedulerConfig:
    """None -> Qwen-Image's; a SchedulerConfig; a dict; or a scheduler_config.json (or its folder)."""
    if scheduler is None:
        return QWEN_IMAGE_SCHEDULER
    if isinstance(scheduler, SchedulerConfig):
        return scheduler
    if isinstance(scheduler, dict):
        return SchedulerConfig.from_dict(scheduler)
    from .diffusers_folder import load_scheduler_config, read_json

    p = Path(scheduler)
    try:
        return load_scheduler_config(p) if p.is_dir() else SchedulerConfig.from_dict(read_json(p))
    except ConfigError as e:
        raise CheckpointError(f"{p}: {e}") from e


def load_single_files(
    transformer: Path | str,  # each: a single file or a diffusers component folder
    vae: Path | str,
    text_encoder: Path | str,
    tokenizer: Path | str | None = None,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    scheduler: SchedulerConfig | dict | Path | str | None = None,
    transformer_config: TransformerConfig | dict | Path | str | None = None,
    vae_config: VAEConfig | dict | Path | str | None = None,
    text_encoder_config: Qwen2_5_VLConfig | dict | Path | str | None = None,
    fp8: bool = False,
    offload: str = "none",
) -> Components:
    """Check every file (headers, layouts, configs, tokenizer), then load the three models.

    A component given as a folder is loaded as a diffusers component folder instead
    (`transformer/`, `vae/`, `text_encoder/`), so single files and folders can be mixed.
    `offload`: the parts that mode keeps in host memory load to the CPU (the transformer under "blocks",
    the text encoder under "model" and "blocks"), so the GPU never holds them all.
    """
    from ..models.text_encoder import TextEncoder
    from . import diffusers_folder as folder

    given = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise CheckpointError(
            f"from_single_files needs transformer, vae and text_encoder; missing: {missing}"
        )
    tok_dir = resolve_tokenizer(tokenizer)
    checks = {
        "transformer": (inspect_transformer, transformer_config),
        "vae": (inspect_vae, vae_config),
        "text_encoder": (inspect_text_encoder, text_encoder_config),
    }
    plans = {
        k: None if Path(given[k]).is_dir() else inspect(given[k], cfg) for k, (inspect, cfg) in checks.items()
    }
    sched = scheduler_config(scheduler)

    dirs = {k: Path(v) for k, v in given.items() if plans[k] is None}
    cpu = torch.device("cpu")
    tr_dev, te_dev = (cpu if offload == "blocks" else device), (cpu if offload != "none" else device)
    if "transformer" in dirs:
        tr = folder.load_transformer(dirs["transformer"], tr_dev, dtype, fp8=fp8)
    else:
        tr = load_transformer_file(transformer, tr_dev, dtype, source=plans["transformer"], fp8=fp8)
    if "vae" in dirs:
        v = folder.load_vae(dirs["vae"], device, dtype)
    else:
        v = load_vae_file(vae, device, dtype, source=plans["vae"])
    if "text_encoder" in dirs:
        te = TextEncoder.from_pretrained(dirs["text_encoder"], tok_dir, te_dev, dtype)
    else:
        te = load_text_encoder_file(text_encoder, tok_dir, te_dev, dtype, source=plans["text_encoder"])
    return Components(tr, v, te, sched, model_path=str(transformer))
