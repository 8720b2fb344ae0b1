"""What the memory planner needs of a model before it loads: `ModelSizes` from safetensors headers alone.

Why headers: `--vram N` decides where each part loads (GPU or pinned host memory) before any tensor is
read, so the GPU never holds more than the plan (runtime/tiers.py). A header gives each tensor's name and
shape; names say which block, layer, modulation Linear or vision tower a tensor belongs to, whatever the
prefix (diffusers folders, ComfyUI single files).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..runtime.memory import ModelSizes
from .weights import weight_files

__all__ = ["weight_numels", "sizes_from_numels", "folder_sizes", "files_sizes"]


def weight_numels(files: list[Path]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (element count, shape) of every tensor in `files`, from their safetensors headers alone."""
    out: dict[str, tuple[int, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                shape = tuple(h.get_slice(k).get_shape())
                n = 1
                for d in shape:
                    n *= d
                out[k] = (n, shape)
    return out


def sizes_from_numels(tr: dict, te: dict, vae: dict, dtype: torch.dtype) -> ModelSizes:
    """What the memory planner needs of a model, from `weight_numels` of its three parts (any key prefix:
    diffusers folders and ComfyUI files alike): each part's bytes in `dtype` (8-bit files are counted as
    `dtype` too, as the plan's 16-bit sizes), the largest block and layer, the modulation Linears, the text
    encoder's vision tower and embeddings; dims from the tensors' shapes."""
    e = torch.empty((), dtype=dtype).element_size()

    def grouped(counts: dict, pattern: str) -> dict[int, int]:
        groups: dict[int, int] = {}
        for k, (n, _) in counts.items():
            m = re.search(pattern, k)
            if m:
                groups[int(m.group(1))] = groups.get(int(m.group(1)), 0) + n
        return groups

    def shape(counts: dict, suffix: str, axis: int, default: int) -> int:
        return next(
            (s[axis] for k, (_, s) in counts.items() if k.endswith(suffix) and len(s) > axis), default
        )

    blocks = grouped(tr, r"(?:^|\.)transformer_blocks\.(\d+)\.")
    mods = grouped(
        {k: v for k, v in tr.items() if re.search(r"\.(img|txt)_mod\.", k)}, r"transformer_blocks\.(\d+)\."
    )
    text = {k: v for k, v in te.items() if "visual." not in k}
    layers = grouped(text, r"(?:^|\.)layers\.(\d+)\.")
    total = lambda counts: sum(n for n, _ in counts.values())  # noqa: E731
    return ModelSizes(
        transformer=total(tr) * e,
        transformer_block=max(blocks.values(), default=0) * e,
        num_blocks=len(blocks),
        text_encoder=total(te) * e,
        vae=total(vae) * e,
        te_block=max(layers.values(), default=0) * e,
        te_blocks=len(layers),
        te_vision=sum(n for k, (n, _) in te.items() if "visual." in k) * e,
        block_modulation=max(mods.values(), default=0) * e,
        te_embed=sum(n for k, (n, _) in text.items() if "embed_tokens" in k or "lm_head" in k) * e,
        dim=shape(tr, "img_in.weight", 0, 3072),
        te_hidden=shape(text, "embed_tokens.weight", 1, 3584),
        vae_base_dim=shape(vae, "decoder.conv_out.weight", 1, 96),
    )


def folder_sizes(path: Path, dtype: torch.dtype) -> ModelSizes:
    """`sizes_from_numels` of a model folder: a load is planned before it puts anything on the GPU."""
    return sizes_from_numels(
        weight_numels(weight_files(path / "transformer", "diffusion_pytorch_model")),
        weight_numels(weight_files(path / "text_encoder", "model")),
        weight_numels(weight_files(path / "vae", "diffusion_pytorch_model")),
        dtype,
    )


def files_sizes(transformer: Path | str, vae: Path | str, text_encoder: Path | str, dtype: torch.dtype):
    """The memory planner's `ModelSizes` of single files (or component folders), from their headers."""

    def files(p: Path | str, stem: str) -> list[Path]:
        return weight_files(Path(p), stem) if Path(p).is_dir() else [Path(p)]

    return sizes_from_numels(
        weight_numels(files(transformer, "diffusion_pytorch_model")),
        weight_numels(files(text_encoder, "model")),
        weight_numels(files(vae, "diffusion_pytorch_model")),
        dtype,
    )
