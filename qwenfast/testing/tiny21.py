"""Tiny random Qwen-Image-2.1 pipelines, built fully offline.

The 2.1 counterpart of :mod:`qwenfast.testing.tiny`: a diffusers ``QwenImage21Pipeline`` with a
tiny ``Qwen3VLForConditionalGeneration`` (text + vision tower, deepstack on), a torchvision-free
``Qwen3VLProcessor`` (the PIL image processor, Qwen3-VL's patch 16 / merge 2 / mean-std 0.5, and
a Qwen-style chat template), a tiny ``QwenImage21Transformer2DModel`` and a tiny
``AutoencoderKLQwenImage21`` (RGBA in and out, 16x spatial compression), saved in the real
Hugging Face folder layout.

Made sensitive on purpose (random tiny models barely react to their inputs): variance-preserving
Linear weights, sharp QK-norm gains, strong attention/MLP outputs and a weak ``img_in``, so a
changed prompt word or a swapped condition image visibly moves the pixels (the tests check that).
Nothing here is imported by the engine.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from .tiny import _randomize, build_tokenizer

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."

# A Qwen3-VL-style chat template (system / user / assistant turns, image and video slots), enough
# for what the 2.1 pipeline renders with it: the system turn whose token count it drops.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-VL's image processor settings, with a small minimum so tiny test images keep their size
# (the real one asks for >= 256² pixels; the pipeline resizes to ~output_resolution² first).
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096},
}

SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": 16,
    "dim_mult": [1, 1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True],
    "is_residual": True,
    "in_channels": 4,
    "out_channels": 4,
}


def text_encoder_config(tokenizer, hidden_size: int = 64, num_layers: int = 2) -> dict[str, Any]:
    """Keyword arguments for a tiny ``Qwen3VLConfig`` whose token ids match ``tokenizer``."""
    ids = tokenizer.convert_tokens_to_ids
    head_dim = 16
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": hidden_size // head_dim // 2,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.05,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "pad_token_id": ids("<|endoftext|>"),
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
        "initializer_range": 0.05,
    }
    return {
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "tie_word_embeddings": False,
    }


def build_text_encoder(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A tiny random ``Qwen3VLForConditionalGeneration`` (fp32, eval)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(**text_encoder_config(tokenizer, hidden_size, num_layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # stronger weights than transformers' init, so prompts and images matter
        for mod in model.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                fan_in = mod.weight.shape[1] if isinstance(mod, torch.nn.Linear) else 4
                mod.weight.normal_(0.0, 1.0 / fan_in**0.5, generator=gen)
    _randomize(model, gen, bias_std=0.05)
    return model.eval()


def _lenient_processor(cls, **kwargs):
    """``cls(**kwargs)`` with ``video_processor=None`` allowed (transformers insists on a
    torchvision video processor; the pipeline only passes images)."""
    original = cls.__dict__.get("check_argument_for_proper_class")

    def lenient(self, argument_name, argument):
        if argument is None and argument_name == "video_processor":
            return None
        return super(cls, self).check_argument_for_proper_class(argument_name, argument)

    cls.check_argument_for_proper_class = lenient
    try:
        return cls(video_processor=None, **kwargs)
    finally:
        if original is None:
            del cls.check_argument_for_proper_class
        else:
            cls.check_argument_for_proper_class = original


def build_processor(tokenizer):
    """A ``Qwen3VLProcessor`` (PIL image processor, no video processor) with a chat template.

    Its ``save_pretrained`` writes what a real ``processor/`` folder holds for images: tokenizer
    files, ``preprocessor_config.json`` and ``chat_template.jinja``."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR_CONFIG)
    processor = _lenient_processor(
        Qwen3VLProcessor, image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )

    def save_pretrained(save_directory, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        processor.tokenizer.save_pretrained(save_directory)
        processor.image_processor.save_pretrained(save_directory)
        with open(os.path.join(save_directory, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
        with open(os.path.join(save_directory, "processor_config.json"), "w") as f:
            json.dump({"processor_class": "Qwen3VLProcessor"}, f)

    processor.save_pretrained = save_pretrained
    return processor


def load_processor(folder: str | os.PathLike):
    """Reload a ``processor/`` folder written by :func:`build_tiny21_pipeline` without torchvision."""
    from transformers import AutoTokenizer

    return build_processor(AutoTokenizer.from_pretrained(os.fspath(folder)))


def build_transformer(
    context_in_dim: int,
    *,
    seed: int = 0,
    num_layers: int = 2,
    heads: int = 2,
    in_channels: int = 16,
    causal_condition: bool = True,
):
    """A tiny random ``QwenImage21Transformer2DModel`` (inner dim 64, head dim 32, rope axes (8, 12, 12))."""
    from diffusers import QwenImage21Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = QwenImage21Transformer2DModel(
            patch_size=1,
            in_channels=in_channels,
            out_channels=in_channels,
            num_layers=num_layers,
            attention_head_dim=32,
            num_attention_heads=heads,
            context_in_dim=context_in_dim,
            mlp_ratio=3,
            axes_dims_rope=(8, 12, 12),
            causal_condition=causal_condition,
        )
    gen = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                gain = 2.0 if name.endswith(("to_out.0", "img_mlp.out")) else 1.0
                gain = 0.5 if name == "img_in" else gain  # condition tokens vs text: text must matter
                mod.weight.normal_(0.0, gain / mod.in_features**0.5, generator=gen)
    _randomize(model, gen, norm_scale=0.3)
    with torch.no_grad():  # zero-centred norms (text_norm) store scale - 1; the modulation gets more swing
        model.txt_in.text_norm.weight.sub_(1.0)
        model.modulation[1].weight.mul_(2.0)
    return model.eval()


def as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast a diffusers model's parameters to `dtype` and nothing else: the state
    `from_pretrained(..., torch_dtype=dtype)` leaves it in. `model.to(dtype)` is NOT that: it also
    casts non-persistent buffers, e.g. 2.1's fp32 timestep frequencies (`time_proj.freqs`), which
    rounded to bf16 move the timestep embedding by ~10% and every output by ~0.1 (rel.)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


def diffusers_transformer21(
    *, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0, **config: Any
):
    """diffusers' ``QwenImage21Transformer2DModel`` (``config``: its constructor arguments, full size by
    default) with random variance-preserving Linear weights, as ``from_pretrained(torch_dtype=dtype)``
    + ``.to(device)`` would hold it: parameters in ``dtype``, the fp32 timestep frequencies computed on
    the CPU (where diffusers computes them at construction). The benchmark's and tests' oracle."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TemporalTimesteps

    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = QwenImage21Transformer2DModel(**config)
    gen = torch.Generator(device).manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, mod.in_features**-0.5, generator=gen)
    as_loaded(model, dtype)
    buffers = [name for name, _ in model.named_buffers()]
    if buffers != ["time_text_embed.time_proj.freqs"]:  # a new diffusers buffer: decide how it loads
        raise RuntimeError(f"unexpected buffers in QwenImage21Transformer2DModel: {buffers}")
    model.time_text_embed.time_proj.freqs = QwenImage21TemporalTimesteps(256).freqs.to(device)
    return model.eval()


def build_vae(*, seed: int = 0):
    """A tiny random ``AutoencoderKLQwenImage21`` (RGBA, 16x) with seeded latents_mean / latents_std."""
    from diffusers import AutoencoderKLQwenImage21

    gen = torch.Generator().manual_seed(seed + 3000)
    z = VAE_CONFIG["z_dim"]
    mean = [round(v, 4) for v in (torch.randn(z, generator=gen) * 0.5).tolist()]
    std = [round(v, 4) for v in (0.5 + 2.5 * torch.rand(z, generator=gen)).tolist()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoencoderKLQwenImage21(**VAE_CONFIG, latents_mean=mean, latents_std=std)
    _randomize(model, gen, norm_scale=0.1)
    with torch.no_grad():  # more contrast in the decoded images
        model.decoder.conv_out.weight.mul_(3.0)
        model.decoder.conv_out.bias.mul_(3.0)
    return model.eval()


def build_tiny21_pipeline(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    transformer_layers: int = 2,
    causal_condition: bool = True,
    sample_sigmas: list[float] | None = None,
    dtype: torch.dtype = torch.float32,
    heads: int = 2,
) -> DiffusionPipeline:
    """A tiny random diffusers ``QwenImage21Pipeline``, optionally saved to ``path`` (HF layout)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, seed=seed)
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=build_vae(seed=seed),
        text_encoder=text_encoder,
        processor=build_processor(tokenizer),
        transformer=build_transformer(
            text_encoder.config.text_config.hidden_size,
            seed=seed,
            num_layers=transformer_layers,
            heads=heads,
            causal_condition=causal_condition,
            in_channels=VAE_CONFIG["z_dim"],
        ),
        sample_sigmas=sample_sigmas,
    )
    if dtype != torch.float32:  # parameters only, as from_pretrained(torch_dtype=...) loads them
        for name in ("vae", "text_encoder", "transformer"):
            as_loaded(getattr(pipe, name), dtype)
    pipe.set_progress_bar_config(disable=True)
    if path is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        pipe.save_pretrained(os.fspath(path), safe_serialization=True)
    return pipe
