"""Loading Qwen-Image-2.1: the diffusers folder layout and ComfyUI's single transformer file.

```
model_index.json       {"_class_name": "QwenImage21Pipeline", "sample_sigmas": [...] | null, ...}
transformer/           config.json + diffusion_pytorch_model[.safetensors | -0000N-of-0000M + index]
vae/                   config.json + diffusion_pytorch_model.safetensors
text_encoder/          Qwen3VLForConditionalGeneration (config.json + model*.safetensors)
processor/             Qwen3VLProcessor: tokenizer files, preprocessor_config.json, chat template
scheduler/             scheduler_config.json
```
ComfyUI's 2.1 transformer files use the diffusers key names, optionally prefixed
`model.diffusion_model.`, with the SwiGLU gate and up projections fused into `img_mlp.gate_up`
(gate rows first) — the layout this engine keeps anyway (diffusers reads them through
`convert_qwen_image21_transformer_checkpoint_to_diffusers`, recognised by `txt_in.text_norm.weight`).
A file without that marker is refused with what it looks like instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError
from ..models.transformer21 import QwenImage21Transformer, Transformer21Config, checkpoint_key
from ..models.vae21 import QwenImage21VAE, VAE21Config, convert_vae21_key
from .diffusers_folder import read_json
from .weights import CheckpointError, iter_safetensors, load_streaming, read_safetensors_header, weight_files

PIPELINE_CLASS = "QwenImage21Pipeline"
COMFY_MARKER = "txt_in.text_norm.weight"


class Fuser21:
    """Collects the pieces of tensors fused at load time (Q|K|V, gate|up) and emits each whole."""

    def __init__(self):
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, key: str, t: torch.Tensor):
        name, slot, pieces = checkpoint_key(key)
        if slot is None:
            return name, t
        group = self.pending.setdefault(name, {})
        group[slot] = t
        if len(group) < pieces:
            return None
        del self.pending[name]
        return name, torch.cat([group[i] for i in range(pieces)], dim=0)

    def check_done(self, where: str) -> None:
        if self.pending:
            raise CheckpointError(
                f"{where}: incomplete fused groups (to_q/to_k/to_v or gate_layer/proj missing) "
                f"for {sorted(self.pending)}"
            )


def _config(cls, path: Path):
    try:
        return cls.from_dict(read_json(path))
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def load_transformer21(
    folder: Path, device: torch.device | str, dtype: torch.dtype
) -> QwenImage21Transformer:
    folder = Path(folder)
    cfg = _config(Transformer21Config, folder / "config.json")
    return load_transformer21_files(
        weight_files(folder, "diffusion_pytorch_model"), cfg, device, dtype, str(folder)
    )


def load_transformer21_files(files: list[Path], cfg: Transformer21Config, device, dtype, where: str):
    with torch.device("meta"):
        model = QwenImage21Transformer(cfg)
    return load_streaming(model, iter_safetensors(files, device), dtype=dtype, where=where, convert=Fuser21())


def load_transformer21_single_file(path: str | Path, device, dtype, config: dict | None = None):
    """A ComfyUI (or diffusers-keyed) single 2.1 transformer file; the config is inferred from the
    tensor shapes unless given. Refuses files that are not a 2.1 transformer, saying what they hold."""
    path = Path(path)
    keys = read_safetensors_header(path)
    keys = {k: v for k, v in keys.items() if k != "__metadata__"}
    plain = {k.removeprefix("model.diffusion_model."): v for k, v in keys.items()}
    if COMFY_MARKER not in plain:
        hint = (
            "a Qwen-Image (1.x) transformer: load it with QwenImagePipeline.from_single_files"
            if "txt_norm.weight" in plain
            else "no `txt_in.text_norm.weight` tensor"
        )
        raise CheckpointError(f"{path} is not a Qwen-Image-2.1 transformer file ({hint})")
    if config is None:
        blocks = {int(k.split(".")[1]) for k in plain if k.startswith("transformer_blocks.")}
        dim, ctx = plain["txt_in.in_layer.weight"]["shape"]
        hd = plain["transformer_blocks.0.attn.norm_q.weight"]["shape"][0]
        cin = plain["img_in.weight"]["shape"][1]
        if hd != 128:
            raise CheckpointError(
                f"{path}: head dim {hd} is not Qwen-Image-2.1's 128; pass config= (the "
                "transformer's config.json fields, RoPE axes included)"
            )
        config = {
            "num_layers": len(blocks),
            "context_in_dim": ctx,
            "attention_head_dim": hd,
            "num_attention_heads": dim // hd,
            "in_channels": cin,
            "out_channels": cin,
        }
    cfg = Transformer21Config.from_dict(config)
    return load_transformer21_files([path], cfg, device, dtype, str(path))


def load_vae21(folder: Path, device: torch.device | str, dtype: torch.dtype) -> QwenImage21VAE:
    folder = Path(folder)
    cfg = _config(VAE21Config, folder / "config.json")
    with torch.device("meta"):
        model = QwenImage21VAE(cfg)
    items = iter_safetensors(weight_files(folder, "diffusion_pytorch_model"), device)
    return load_streaming(model, items, dtype=dtype, where=str(folder), convert=convert_vae21_key)


def inspect_folder21(path: Path) -> list[str]:
    """Problems of a 2.1 folder (empty list: looks complete)."""
    from .weights import check_weight_files

    problems = []
    for comp, cfg_name, stem in (
        ("transformer", "config.json", "diffusion_pytorch_model"),
        ("vae", "config.json", "diffusion_pytorch_model"),
        ("text_encoder", "config.json", "model"),
        ("scheduler", "scheduler_config.json", None),
        ("processor", None, None),
    ):
        d = Path(path) / comp
        if not d.is_dir():
            problems.append(f"missing folder {comp}/")
            continue
        if cfg_name and not (d / cfg_name).is_file():
            problems.append(f"missing file {comp}/{cfg_name}")
        if stem:
            problems.extend(check_weight_files(d, stem))
    proc = Path(path) / "processor"
    if proc.is_dir() and not ((proc / "tokenizer.json").is_file() or (proc / "vocab.json").is_file()):
        problems.append("processor/ has neither tokenizer.json nor vocab.json")
    return problems
