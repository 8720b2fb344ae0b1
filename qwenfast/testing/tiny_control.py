"""Tiny random ControlNets and a tiny Qwen-Image-Layered pipeline (diffusers objects), built offline
for the tests and the smoke benchmark. Nothing here is imported by the engine.

Both are made *sensitive*: diffusers initialises a ControlNet's `controlnet_blocks` and
`controlnet_x_embedder` to zero (a fresh net changes nothing), so they get variance-preserving random
weights here, with a gain, so that a changed control image visibly moves the picture.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .tiny import (
    _randomize,
    build_processor,
    build_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_transformer,
)
from .tiny import build_vae as _build_vae

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline, QwenImageControlNetModel


def build_controlnet(
    joint_attention_dim: int = 64,
    *,
    seed: int = 0,
    num_layers: int = 2,
    heads: int = 2,
    extra_condition_channels: int = 0,
    gain: float = 1.5,
) -> QwenImageControlNetModel:
    """A tiny random diffusers ``QwenImageControlNetModel`` matching `build_transformer`'s blocks
    (inner dim 64, head dim 32, rope axes (8, 12, 12))."""
    from diffusers import QwenImageControlNetModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = QwenImageControlNetModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=num_layers,
            attention_head_dim=32,
            num_attention_heads=heads,
            joint_attention_dim=joint_attention_dim,
            axes_dims_rope=(8, 12, 12),
            extra_condition_channels=extra_condition_channels,
        )
    gen = torch.Generator().manual_seed(seed + 4000)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                g = gain if name.startswith(("controlnet_blocks", "controlnet_x_embedder")) else 1.0
                g = 2.0 if name.endswith(("to_out.0", "to_add_out")) else g
                mod.weight.normal_(0.0, g / mod.in_features**0.5, generator=gen)
                if mod.bias is not None:
                    mod.bias.normal_(0.0, 0.05, generator=gen)
    _randomize(model, gen, norm_scale=0.1)
    return model.eval()


def save_controlnet_file(model, path: str | os.PathLike, prefix: str = "") -> None:
    """The state dict as one .safetensors file without config (the InstantX / ComfyUI single-file form)."""
    from safetensors.torch import save_file

    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path))


def build_tiny_layered(
    path: str | os.PathLike | None = None, *, seed: int = 0, transformer_layers: int = 2, heads: int = 2
) -> DiffusionPipeline:
    """A tiny random diffusers ``QwenImageLayeredPipeline`` (RGBA VAE, layer-3D RoPE, additional t
    condition), optionally saved to `path` in the Hugging Face layout."""
    from diffusers import QwenImageLayeredPipeline

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, seed=seed)
    transformer = build_transformer(
        text_encoder.config.text_config.hidden_size,
        seed=seed,
        num_layers=transformer_layers,
        heads=heads,
        use_layer3d_rope=True,
        use_additional_t_cond=True,
    )
    pipe = QwenImageLayeredPipeline(
        scheduler=build_scheduler(),
        vae=_build_vae(seed=seed, input_channels=4),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=build_processor(tokenizer),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    if path is not None:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            pipe.save_pretrained(os.fspath(path), safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return pipe
