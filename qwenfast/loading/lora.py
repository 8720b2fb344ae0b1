"""LoRA files for the Qwen-Image transformer: read every naming seen in the wild and turn a file into
checked per-layer deltas (`plan_lora`); applying them (fused, or beside FP8 layers) and unfusing
bitwise is `loading/lora_manager.py` (`LoraManager`, whose docstring says why fuse and why keep
originals). Host-memory cost of fusing: the size of every weight any active LoRA touches; a LoRA on
all block linears of full-size Qwen-Image (Lightning, most style LoRAs) keeps 38 GiB of bf16 originals.

Measured on one H200 (tools/lora_gpu_check.py, 60 layers, rank-64 LoRA on every block Linear,
1.1 GiB file): first load 10-14 s (mostly page-locking and copying the 38 GiB of originals), a
switch to another such LoRA 1.3 s, a strength change 1.2 s, unload 2.1 s; +680 MiB GPU peak.

What is read (normalised to our module names; anything else is an error that names the keys):
- tensors: `lora_A`/`lora_B` (optionally `.default`), `lora_down`/`lora_up`, `lora.down`/`lora.up`,
  `lora_linear_layer.down`/`.up`, optional `.alpha` (delta = alpha/rank · up @ down, else
  up @ down), `lora_B.bias` (PEFT `lora_bias`: bias += scale · b);
- prefixes: none, `transformer.`, `diffusion_model.`, `model.diffusion_model.`, `base_model.model.`,
  and flattened kohya/musubi/LyCORIS names (`lora_unet_transformer_blocks_0_attn_add_k_proj`,
  `lora_transformer_…`, `lycoris_…`);
- targets: diffusers' module names; `to_q/to_k/to_v` and `add_q_proj/add_k_proj/add_v_proj` update
  one third of our fused `attn.to_qkv` / `attn.add_qkv_proj`, and LoRAs written directly on the
  fused projections (ComfyUI) work too;
- diffusers' safetensors metadata `lora_adapter_metadata` (PEFT `LoraConfig`: r, lora_alpha,
  rank_pattern, alpha_pattern, use_rslora), as diffusers applies it.
Refused, as diffusers 0.42.1 refuses them for Qwen-Image: `.diff` / `.diff_b` full deltas, LoHa,
LoKr, DoRA magnitudes. `dora_scale` tensors are dropped with a warning, as diffusers does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import LoraError
from ..kernels.lowbit import LowBitLinear
from ..models.transformer import fuse_qkv_key, split_qkv_key

log = logging.getLogger("qwenfast")

_SHOW = 5  # how many offending keys an error message lists

# Tensor-name endings -> role. Longest first, so `.lora_A.default.weight` wins over `.weight` forms.
_ROLES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"), (".lora_B.default.bias", "bias"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_B.bias", "bias"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora.down.weight", "down"), (".lora.up.weight", "up"),
    (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
    (".alpha", "alpha"),
)  # fmt: skip
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
_FLAT_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")
_UNSUPPORTED = {  # key fragment -> what it is
    ".diff_b": "a full bias delta (.diff_b)", ".diff": "a full weight delta (.diff)",
    "lokr_": "a LoKr factor", "hada_": "a LoHa factor", "lora_magnitude_vector": "a DoRA magnitude",
    ".lora_mid.": "a LoCon mid (Tucker) factor",
}  # fmt: skip


def _show(items: list[str]) -> str:
    head = ", ".join(items[:_SHOW])
    return head + (f", ... ({len(items)} in all)" if len(items) > _SHOW else f" ({len(items)})")


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class LoraSource:
    """Where a LoRA came from: its path and (size, mtime) to notice a replaced file, or None for a dict."""

    path: str | None
    stat: tuple[int, int] | None = None

    @classmethod
    def of(cls, lora: str | os.PathLike | dict) -> LoraSource:
        if isinstance(lora, dict):
            return cls(None)
        p = Path(lora).expanduser().resolve()
        try:
            st = p.stat()
        except OSError:
            return cls(str(p))
        return cls(str(p), (st.st_size, st.st_mtime_ns))


def read_lora(lora: str | os.PathLike | dict) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(state dict, diffusers adapter metadata or None) from a .safetensors path or a state dict.

    Only safetensors files are read: pickled .pt/.ckpt/.bin files can run arbitrary code when
    loaded, and every LoRA we know of is published as safetensors.
    """
    if isinstance(lora, dict):
        bad = [str(k) for k, v in lora.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
        if bad:
            raise LoraError(
                f"a LoRA state dict maps str keys to torch tensors; these entries do not: {_show(bad)}"
            )
        return dict(lora), None
    if not isinstance(lora, (str, os.PathLike)):
        raise TypeError(f"a LoRA is a .safetensors path or a state dict, got {type(lora).__name__}")
    path = Path(lora).expanduser()
    if not path.is_file():
        raise LoraError(f"LoRA file {path} does not exist" + (" (it is a folder)" if path.is_dir() else ""))
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # SafetensorError, OSError, header JSON errors ...
        raise LoraError(
            f"cannot read LoRA {path}: not a valid safetensors file ({type(e).__name__}: {e}). qwenfast reads "
            f"LoRAs only from .safetensors (convert a .pt/.ckpt with safetensors.torch.save_file)"
        ) from None
    raw = meta.get("lora_adapter_metadata")
    adapter = None
    if raw:
        try:
            adapter = json.loads(raw)
        except json.JSONDecodeError as e:
            raise LoraError(f"LoRA {path}: metadata 'lora_adapter_metadata' is not JSON ({e})") from None
    return sd, adapter


# ---------------------------------------------------------------------------------------------
# Naming -> our modules


@dataclass
class LoraDelta:
    """One low-rank update of one weight segment: W[rows] += strength · scale · up @ down."""

    module: str  # our module name, e.g. transformer_blocks.0.attn.to_qkv
    slot: (
        int | None
    )  # piece of a fused projection (a Q/K/V third, 2.1's gate/up half), None = the whole weight
    up: torch.Tensor  # (rows, r)
    down: torch.Tensor  # (r, in_features)
    scale: float  # alpha / rank (and the PEFT metadata scale)
    bias: torch.Tensor | None  # (rows,) PEFT lora_B.bias, scaled like the weight
    key: str  # the file's module key, for messages


class ModuleIndex:
    """The transformer's Linear layers under every name a LoRA may use for them."""

    def __init__(self, model: nn.Module):
        self.linear: dict[str, nn.Linear | LowBitLinear] = {}
        for n, m in model.named_modules():
            if isinstance(
                m, (nn.Linear, LowBitLinear)
            ):  # FP8 layers take LoRAs unmerged (loading/lora_fp8.py)
                self.linear[n.replace("_orig_mod.", "")] = m  # torch.compile wrappers add _orig_mod.
        # A model whose fused tensors are not only Q|K|V thirds says how diffusers' names map onto its own:
        # `lora_key(key) -> (our key, piece, pieces)` and its inverse `lora_names(key) -> [diffusers keys]`
        # (Qwen-Image-2.1: gate|up halves of `img_mlp.gate_up`, `norm_out.linear` -> `norm_out_linear`).
        self._key = getattr(model, "lora_key", None)
        names = getattr(model, "lora_names", None) or split_qkv_key
        self.pieces: dict[str, int] = {}  # fused module -> how many equal row blocks its pieces are (else 3)
        self.flat: dict[str, str] = {}  # kohya flattened name -> dotted diffusers name
        for n in self.linear:
            split = names(n + ".weight")
            if split and len(split) > 1:
                self.pieces[n] = len(split)
            for d in [n, *(k.removesuffix(".weight") for k in split or [])]:
                self.flat[d.replace(".", "_")] = d

    def resolve(self, name: str) -> tuple[str, int | None] | None:
        """A diffusers module name -> (our module, slot of a fused projection or None), or None if the
        model has none."""
        if name in self.linear:
            return name, None
        if self._key is not None:
            ours, slot, pieces = self._key(name + ".weight")
            ours = ours.removesuffix(".weight")
            return (ours, slot) if ours in self.linear else None
        hit = fuse_qkv_key(name + ".weight")
        if hit is not None:
            fused = hit[0].removesuffix(".weight")
            if fused in self.linear:
                return fused, hit[1]
        return None

    def dotted(self, key: str) -> str:
        """Strip the known prefixes and undo kohya's flattening (when it names one of our layers)."""
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if key.startswith(p):
                    key, changed = key[len(p) :], True
        for p in _FLAT_PREFIXES:
            if key.startswith(p):
                return self.flat.get(key[len(p) :], key)
        if key not in self.linear and "." not in key:
            return self.flat.get(key, key)
        return key


def _split_role(key: str) -> tuple[str, str] | None:
    for suffix, role in _ROLES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _peft_scale(meta: dict, name: str) -> float:
    """PEFT's `scaling` for module `name` under a LoraConfig dict (rank/alpha patterns as PEFT matches them)."""
    r, alpha = meta.get("r", 8), meta.get("lora_alpha", 8)
    for pat, v in (meta.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pat})$", name):
            r = v
            break
    for pat, v in (meta.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pat})$", name):
            alpha = v
            break
    return alpha / (math.sqrt(r) if meta.get("use_rslora") else r)


def plan_lora(
    sd: dict[str, torch.Tensor], index: ModuleIndex, metadata: dict | None = None, where: str = "LoRA"
) -> list[LoraDelta]:
    """Normalise a LoRA state dict to per-segment deltas for our model, checking everything first.

    Raises one LoraError listing every problem (unsupported adapter types, unknown tensor names,
    modules the model lacks, missing halves, shape mismatches), so nothing is applied from a LoRA
    that does not fit.
    """
    if metadata:
        metadata = {
            k.removeprefix("transformer."): v for k, v in metadata.items() if k.startswith("transformer.")
        }
        if metadata.get("use_dora"):
            raise LoraError(
                f"{where}: a DoRA adapter (use_dora in its metadata); only plain LoRA is supported"
            )
    dora = [k for k in sd if "dora_scale" in k]
    if dora:
        log.warning(
            "%s: dropping %d dora_scale tensors (DoRA is not supported; diffusers drops them too)",
            where,
            len(dora),
        )
    unsupported, unknown = {}, []
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        if "dora_scale" in k:
            continue
        kind = next((what for frag, what in _UNSUPPORTED.items() if frag in k), None)
        if kind is not None:
            unsupported.setdefault(kind, []).append(k)
            continue
        split = _split_role(k)
        if split is None:
            unknown.append(k)
            continue
        mod, role = split
        groups.setdefault(mod, {})[role] = (k, v)

    problems: list[str] = []
    for kind, keys in unsupported.items():
        problems.append(
            f"{kind} is not supported (diffusers 0.42.1 does not load it for Qwen-Image either): {_show(keys)}"
        )
    if unknown:
        problems.append(
            "tensors that are not LoRA factors (expected names ending in .lora_A.weight/.lora_B.weight, "
            f".lora_down.weight/.lora_up.weight, .alpha or .lora_B.bias): {_show(unknown)}"
        )
    deltas: list[LoraDelta] = []
    unmatched, incomplete, shapes, seen = [], [], [], {}
    for mod, parts in groups.items():
        name = index.dotted(mod)
        target = index.resolve(name)
        if target is None:
            unmatched.append(mod)
            continue
        if "down" not in parts or "up" not in parts:
            have = ", ".join(k for k, _ in parts.values())
            incomplete.append(f"{mod} (has only {have})")
            continue
        if name in seen:
            problems.append(f"two key groups name the same layer {name}: {seen[name]} and {mod}")
            continue
        seen[name] = mod
        down, up = parts["down"][1], parts["up"][1]
        bias = parts["bias"][1] if "bias" in parts else None
        layer = index.linear[target[0]]
        pieces = index.pieces.get(
            target[0], 1
        )  # > 1: a fused projection (Q|K|V thirds, 2.1's gate|up halves)
        rows = layer.out_features // pieces if target[1] is not None else layer.out_features
        fused_on_fused = target[1] is None and pieces > 1
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            shapes.append(
                f"{mod}: down {tuple(down.shape)} and up {tuple(up.shape)} are not (r, in) and (out, r)"
            )
            continue
        if (
            down.shape[1] != layer.in_features
            or up.shape[0] != rows
            or (bias is not None and bias.shape != (rows,))
        ):
            got = f"up {tuple(up.shape)} @ down {tuple(down.shape)}" + (
                f", bias {tuple(bias.shape)}" if bias is not None else ""
            )
            shapes.append(f"{mod}: {got} does not fit {name} ({rows} x {layer.in_features})")
            continue
        rank = down.shape[0]
        scale = 1.0
        if "alpha" in parts:
            scale = float(parts["alpha"][1].float().item()) / rank
        if metadata:
            scale *= _peft_scale(metadata, name)
        if fused_on_fused:  # one LoRA on a fused projection = one LoRA per piece, sharing `down`
            n = rows // pieces
            for s in range(pieces):
                b = None if bias is None else bias[s * n : (s + 1) * n]
                deltas.append(LoraDelta(target[0], s, up[s * n : (s + 1) * n], down, scale, b, mod))
        else:
            deltas.append(LoraDelta(target[0], target[1], up, down, scale, bias, mod))
    if unmatched:
        problems.append(f"layers this model does not have (a LoRA for another model?): {_show(unmatched)}")
    if incomplete:
        problems.append(f"incomplete pairs (a down/A factor needs its up/B factor): {_show(incomplete)}")
    if shapes:
        problems.append(f"shape mismatches (a LoRA for another model size?): {_show(shapes)}")
    if not problems and not deltas:
        problems.append("no LoRA tensors in it")
    if problems:
        raise LoraError(f"{where} cannot be applied; nothing was changed:\n  - " + "\n  - ".join(problems))
    return deltas
