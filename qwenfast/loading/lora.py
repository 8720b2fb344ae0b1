"""LoRA for the Qwen-Image transformer: read every naming seen in the wild, fuse into the weights in
place, unfuse bitwise.

Why fuse instead of running adapter layers (as PEFT does): a fused LoRA costs nothing per step, keeps
the fused kernels and the captured CUDA graphs (they read weights by address, and fusing only writes
into the existing tensors with `copy_`), and a distilled LoRA such as Lightning is used for every
step anyway.

Why keep copies of the original weights instead of subtracting the delta on unload: `W + d - d` is
not `W` in bf16 (nor exactly in fp32), and a server that switches LoRAs per batch would drift. The
first time a LoRA touches a weight (or one Q/K/V third of a fused projection), its original values are
copied to `originals_device` (CPU by default, page-locked when the model is on CUDA, to keep GPU
memory free). Unloading copies them back and re-applies the LoRAs that stay active, so the weights
are always exactly "base + the active LoRAs, applied in order" (in bf16 the order of two stacked
LoRAs can change last bits, as it would in any fused implementation). Host-memory cost: the size of
every weight any active LoRA touches; a LoRA on all block linears of full-size Qwen-Image
(Lightning, most style LoRAs) keeps 38 GiB of bf16 originals. Copies are freed once no active LoRA
needs them, unless `keep_originals` is set (then only `release_originals()` frees them).

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

import dataclasses
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import LoraError  # noqa: F401 - re-exported
from ..kernels.fp8_linear import FP8Linear
from ..models.transformer import fuse_qkv_key, split_qkv_key
from .lora_fp8 import set_side_lora

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
    slot: int | None  # piece of a fused projection (a Q/K/V third, 2.1's gate/up half), None = the whole weight
    up: torch.Tensor  # (rows, r)
    down: torch.Tensor  # (r, in_features)
    scale: float  # alpha / rank (and the PEFT metadata scale)
    bias: torch.Tensor | None  # (rows,) PEFT lora_B.bias, scaled like the weight
    key: str  # the file's module key, for messages


class ModuleIndex:
    """The transformer's Linear layers under every name a LoRA may use for them."""

    def __init__(self, model: nn.Module):
        self.linear: dict[str, nn.Linear | FP8Linear] = {}
        for n, m in model.named_modules():
            if isinstance(m, (nn.Linear, FP8Linear)):  # FP8 layers take LoRAs unmerged (loading/lora_fp8.py)
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
                    key, changed = key[len(p):], True  # fmt: skip
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


def plan_lora(sd: dict[str, torch.Tensor], index: ModuleIndex, metadata: dict | None = None,
              where: str = "LoRA") -> list[LoraDelta]:  # fmt: skip
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
        pieces = index.pieces.get(target[0], 1)  # > 1: a fused projection (Q|K|V thirds, 2.1's gate|up halves)
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


# ---------------------------------------------------------------------------------------------
# Fusing


@dataclass
class ActiveLora:
    name: str
    deltas: list[LoraDelta]
    strength: float
    source: LoraSource

    def segments(self) -> set[tuple[str, int | None]]:
        return {(d.module, d.slot) for d in self.deltas}

    def touched(self) -> set[tuple[str, int | None, str]]:
        """The (module, slot, weight|bias) pieces this LoRA writes to (none at strength 0)."""
        if self.strength == 0:
            return set()
        out = {(d.module, d.slot, "weight") for d in self.deltas}
        return out | {(d.module, d.slot, "bias") for d in self.deltas if d.bias is not None}


class LoraManager:
    """The set of LoRAs fused into one transformer, in load order (see the module docstring)."""

    def __init__(self, model: nn.Module, originals_device: str | torch.device = "cpu"):
        self.model = model
        self.originals_device = torch.device(originals_device)
        self.index = ModuleIndex(model)
        self.active: OrderedDict[str, ActiveLora] = OrderedDict()
        self._orig: dict[tuple[str, int | None, str], torch.Tensor] = {}  # (module, slot, weight|bias)
        self.pin_originals = True  # page-locked host copies when the model is on CUDA
        # keep the copies after the last LoRA is unloaded, so that the next load skips the slow
        # device-to-host copy (a server that alternates between "no LoRA" and LoRAs); see release_originals
        self.keep_originals = False
        self._side_dirty: set[str] = set()  # FP8 layers whose unmerged LoRA must be rebuilt
        self.side_layout = 0  # bumped when an FP8 layer's LoRA tensors are reallocated or dropped

    def rebind(self) -> None:
        """The model's layers were replaced (FP8 quantisation): re-index them and apply the active LoRAs
        again (onto FP8 layers, unmerged). Call `unfuse_all()` before replacing the layers."""
        entries = list(self.active.values())
        self.active.clear()
        self.index = ModuleIndex(self.model)
        self._apply_all(entries)

    def unfuse_all(self) -> None:
        """Restore every weight the active LoRAs changed, keeping them listed as active (for `rebind`)."""
        entries = list(self.active.values())
        self._remove(list(self.active))
        for e in entries:
            self.active[e.name] = e

    # ------------------------------------------------------------ public
    @property
    def loras(self) -> dict[str, float]:
        return {n: a.strength for n, a in self.active.items()}

    @property
    def originals_bytes(self) -> int:
        """Memory held by original-weight copies (host memory with the default originals_device)."""
        return sum(t.numel() * t.element_size() for t in self._orig.values())

    def load(self, lora: str | os.PathLike | dict, strength: float = 1.0, name: str | None = None) -> str:
        """Fuse a LoRA (path or state dict) at `strength`; returns its name (default: the file stem)."""
        strength = _check_strength(strength)
        if name is not None and name in self.active:
            raise LoraError(f"a LoRA named {name!r} is already loaded; unload it first or pick another name")
        entry = self._prepare(lora, strength, name)
        self._apply_all([entry])
        return entry.name

    def unload(self, name: str | None = None) -> None:
        """Remove one LoRA (or all with None), restoring the touched weights bitwise."""
        if name is None:
            self._remove(list(self.active))
            return
        if name not in self.active:
            raise LoraError(f"no LoRA named {name!r} is loaded (loaded: {list(self.active) or 'none'})")
        self._remove([name])

    def set(self, items: Iterable[Any]) -> None:
        """Make the active set exactly `items` ([(path_or_dict, strength[, name]), ...]) with the fewest changes.

        Entries already fused with the same file (and name, if given; a state dict matches by name
        only) and strength stay untouched; a changed strength re-applies only that LoRA; new files
        are read and checked before anything is modified, so a bad file leaves the set as it was.
        """
        want = []
        for it in items:
            it = tuple(it) if isinstance(it, (tuple, list)) else (it,)
            if not 1 <= len(it) <= 3:
                raise LoraError(f"set_loras items are (path, strength) or (path, strength, name), got {it!r}")
            src, strength, name = (*it, *(1.0, None)[len(it) - 1 :])
            want.append((src, _check_strength(strength), name))
        names = [n for _, _, n in want if n is not None]
        if len(set(names)) != len(names):
            raise LoraError(f"set_loras: duplicate names in {names}")
        free = dict(self.active)
        keep, restrength, new = [], [], []
        for src, strength, name in want:
            match = self._match(free, src, name)
            if match is None:
                new.append((src, strength, name))
                continue
            del free[match.name]
            (keep if match.strength == strength else restrength).append((match, strength))
        reserved, entries = {m.name for m, _ in keep + restrength}, []
        for src, s, n in new:  # read and check every new LoRA before changing anything
            entries.append(self._prepare(src, s, n, reserved))
            reserved.add(entries[-1].name)
        self._remove(list(free) + [m.name for m, _ in restrength], free=False, sync=False)  # originals reused below
        for m, s in restrength:
            m.strength = s
        self._apply_all([m for m, _ in restrength] + entries)

    # ------------------------------------------------------------ internals
    def _match(self, free: dict[str, ActiveLora], src, name) -> ActiveLora | None:
        if name is not None:
            a = free.get(name)
            if a is None or isinstance(src, dict):
                return a
            return a if a.source == LoraSource.of(src) else None
        if isinstance(src, dict):
            return None
        s = LoraSource.of(src)
        return next((a for a in free.values() if a.source == s), None)

    def _prepare(
        self, lora, strength: float, name: str | None, reserved: set[str] = frozenset()
    ) -> ActiveLora:
        source = LoraSource.of(lora)
        where = f"LoRA {source.path}" if source.path else "LoRA state dict"
        sd, meta = read_lora(lora)
        deltas = plan_lora(sd, self.index, meta, where)
        moved: dict[int, torch.Tensor] = {}  # id(down) -> its device copy (Q/K/V thirds share one down)
        planned = list(deltas)  # keeps every source factor alive while `moved` is keyed by id()
        for i, d in enumerate(deltas):
            layer = self.index.linear[d.module]
            if isinstance(layer, FP8Linear):  # factors used at every switch: on the device once, in its dtype
                dev, dt = layer.weight_fp8.device, layer.out_dtype
                deltas[i] = dataclasses.replace(d, up=d.up.to(dev, dt), down=_shared(d.down, dev, dt, moved))
                continue
            w = layer.weight
            if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise LoraError(
                    f"{where}: {d.module} is stored as {w.dtype}; LoRAs can be fused into fp32/bf16/fp16 weights only"
                )
        del planned
        if name is not None and name in reserved:
            raise LoraError(f"the name {name!r} is used by another LoRA of this set")
        if name is None:
            base = Path(source.path).stem if source.path else "lora"
            taken = set(self.active) | set(reserved)
            name, i = base, 2
            while name in taken:
                name, i = f"{base}-{i}", i + 1
        return ActiveLora(name, deltas, strength, source)

    def _param(self, module: str, slot: int | None, kind: str) -> torch.Tensor:
        p = getattr(self.index.linear[module], kind).data
        if slot is None:
            return p
        n = p.shape[0] // self.index.pieces[module]
        return p[slot * n : (slot + 1) * n]

    def _save(self, key, view: torch.Tensor) -> None:
        if key in self._orig:
            return
        if self.originals_device.type == "cpu" and view.is_cuda and self.pin_originals:
            buf = _pinned_empty(view)
            if buf is not None:  # asynchronous copy, ordered before the in-place update on the stream
                self._orig[key] = buf.copy_(view, non_blocking=True)
                return
            self.pin_originals = False
            log.warning("could not page-lock host memory for LoRA originals; using pageable memory (slower)")
        self._orig[key] = view.detach().to(self.originals_device, copy=True)

    @torch.no_grad()
    def _apply(self, entry: ActiveLora, only: set | None = None) -> None:
        if entry.strength == 0:
            return
        for d in entry.deltas:
            if only is not None and (d.module, d.slot) not in only:
                continue
            f = entry.strength * d.scale
            if isinstance(self.index.linear[d.module], FP8Linear):
                self._side_dirty.add(d.module)  # rebuilt from every active LoRA in _sync_side
                if d.bias is not None:
                    self._add_bias(d, f)
                continue
            w = self._param(d.module, d.slot, "weight")
            self._save((d.module, d.slot, "weight"), w)
            delta = (d.up.to(w.device, torch.float32) @ d.down.to(w.device, torch.float32)).mul_(f)
            w.copy_((w.float() + delta).to(w.dtype))  # fp32 sum, one rounding to the weight dtype
            if d.bias is not None:
                self._add_bias(d, f)

    def _add_bias(self, d: LoraDelta, f: float) -> None:
        b = self._param(d.module, d.slot, "bias")
        self._save((d.module, d.slot, "bias"), b)
        b.copy_((b.float() + d.bias.to(b.device, torch.float32) * f).to(b.dtype))

    def _sync_side(self) -> None:
        """Rebuild the unmerged LoRA tensors of the FP8 layers touched since the last call."""
        for mod in sorted(self._side_dirty):
            parts = [(d.slot, d.up, d.down, e.strength * d.scale) for e in self.active.values() if e.strength
                     for d in e.deltas if d.module == mod]  # fmt: skip
            if set_side_lora(self.index.linear[mod], parts, self.index.pieces.get(mod, 1)):
                self.side_layout += 1
        self._side_dirty.clear()

    def _apply_all(self, entries: list[ActiveLora]) -> None:
        """Apply and register entries; if anything fails midway (e.g. out of memory) undo them all."""
        done = []
        try:
            for e in entries:
                done.append(e)
                self._apply(e)
                self.active[e.name] = e
            self._sync_side()
        except BaseException:
            for e in done:
                self.active[e.name] = e
            self._remove([e.name for e in done])
            raise
        self._free_unused()  # also waits for the asynchronous copies of the originals

    @torch.no_grad()
    def _remove(self, names: list[str], free: bool = True, sync: bool = True) -> None:
        """Restore every segment the named LoRAs touched, then re-apply the LoRAs that stay there.
        `sync` False: leave FP8 layers' LoRA tensors for the `_apply_all` that follows (a switch
        rewrites them in place instead of dropping and reallocating them)."""
        gone = [self.active.pop(n) for n in names if n in self.active]
        if not gone:
            return
        segs = set().union(*(e.segments() for e in gone))
        for (mod, slot, kind), orig in self._orig.items():
            if (mod, slot) in segs:
                self._param(mod, slot, kind).copy_(orig, non_blocking=True)
        for e in self.active.values():  # in load order, only on the restored segments
            touched = e.segments() & segs
            if touched:
                self._apply(e, only=touched)
        self._side_dirty |= {m for m, _ in segs if isinstance(self.index.linear[m], FP8Linear)}
        if sync:
            self._sync_side()
        if free:
            self._free_unused()

    def release_originals(self) -> None:
        """Free the original-weight copies no active LoRA needs (also those kept by keep_originals)."""
        keep, self.keep_originals = self.keep_originals, False
        try:
            self._free_unused()
        finally:
            self.keep_originals = keep

    def _free_unused(self) -> None:
        """Drop original copies no active LoRA needs (after the async copies that read them finished)."""
        self._sync()
        if self.keep_originals:
            return
        still = set().union(*(e.touched() for e in self.active.values()))
        for key in [k for k in self._orig if k not in still]:
            _unpin(self._orig.pop(key))

    def __del__(self):
        for t in getattr(self, "_orig", {}).values():
            _unpin(t)

    def _sync(self) -> None:
        if any(t.is_cuda for m in self.index.linear.values() for t in (*m.parameters(False), *m.buffers(False))):
            torch.cuda.synchronize()


# Page-locked host copies of exact size. torch's pinned allocator (`pin_memory=True`) rounds every
# block up to a power of two (+60% host memory for Qwen-Image's weight shapes: 61 GiB instead of
# 38 GiB for a Lightning LoRA) and caches freed blocks, so an ordinary allocation is registered
# with CUDA instead, and unregistered before it is freed.
_REGISTERED: set[int] = set()


def _pinned_empty(like: torch.Tensor) -> torch.Tensor | None:
    buf = torch.empty(like.shape, dtype=like.dtype)
    nbytes = buf.numel() * buf.element_size()
    try:
        cudart = torch.cuda.cudart()
        ok = nbytes > 0 and cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0) == cudart.cudaError.success
    except (RuntimeError, AttributeError, AssertionError):
        ok = False
    if not ok:  # locked-memory limits or no cudart: the caller makes a pageable copy
        try:  # a failed runtime call leaves its error pending; the next kernel launch check consumes it
            torch.zeros(1, device=like.device)
        except RuntimeError:
            pass
        return None
    _REGISTERED.add(buf.data_ptr())
    return buf


def _unpin(t: torch.Tensor) -> None:
    ptr = t.data_ptr()
    if ptr in _REGISTERED:
        _REGISTERED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _shared(t: torch.Tensor, dev: torch.device, dt: torch.dtype, moved: dict[int, torch.Tensor]) -> torch.Tensor:
    """`t` on `dev` in `dt`, one copy per source tensor (deltas sharing a factor keep sharing it)."""
    if id(t) not in moved:
        moved[id(t)] = t.to(dev, dt)
    return moved[id(t)]


def _check_strength(s) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise LoraError(f"LoRA strength must be a finite number, got {s!r}")
    return float(s)
