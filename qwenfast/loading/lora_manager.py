"""The set of LoRAs active on one transformer (`LoraManager`): fused into bf16/fp32 weights in place
and unfused bitwise, or kept unmerged beside FP8 layers (`loading/lora_fp8.py`).

Why fuse instead of running adapter layers (as PEFT does): a fused LoRA costs nothing per step, keeps
the fused kernels and the captured CUDA graphs (they read weights by address, and fusing only writes
into the existing tensors with `copy_`), and a distilled LoRA such as Lightning is used for every
step anyway.

Why keep copies of the original weights instead of subtracting the delta on unload: `W + d - d` is
not `W` in bf16 (nor exactly in fp32), and a server that switches LoRAs per batch would drift. The
first time a LoRA touches a weight (or one Q/K/V third of a fused projection), its original values are
copied to `originals_device` (CPU by default, page-locked when the model is on CUDA, to keep GPU
memory free). Unloading copies them back and re-applies the LoRAs that stay active, so the weights
are always exactly "base + the active LoRAs, applied in order". Reading and checking a LoRA file
(every naming seen in the wild) is `loading/lora.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import LoraError
from ..kernels.lowbit import LowBitLinear
from ..kernels.row_lora import RowLoraLinear
from .lora import LoraDelta, LoraSource, ModuleIndex, plan_lora, read_lora
from .lora_fp8 import set_side_lora

log = logging.getLogger("qwenfast")


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
        self._remove(
            list(free) + [m.name for m, _ in restrength], free=False, sync=False
        )  # originals reused below
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
            if isinstance(
                layer, LowBitLinear
            ):  # factors used at every switch: on the device once, in its dtype
                dev, dt = layer.weight_device, layer.out_dtype
                deltas[i] = dataclasses.replace(d, up=d.up.to(dev, dt), down=_shared(d.down, dev, dt, moved))
                continue
            if isinstance(layer, RowLoraLinear) and layer.lora is not None:
                raise LoraError(
                    f"{where}: per-row LoRAs are installed on {d.module} (loading/lora_rows.py RowAdapters): "
                    "uninstall them before loading LoRAs for the whole batch"
                )
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
            if isinstance(self.index.linear[d.module], LowBitLinear):
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
        if not self._side_dirty:
            return
        parts: dict[str, list] = {
            mod: [] for mod in self._side_dirty
        }  # one pass over the deltas, in load order
        for e in self.active.values():
            if e.strength:
                for d in e.deltas:
                    if d.module in parts:
                        parts[d.module].append((d.slot, d.up, d.down, e.strength * d.scale))
        for mod in sorted(parts):
            if set_side_lora(self.index.linear[mod], parts[mod], self.index.pieces.get(mod, 1)):
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
        self._side_dirty |= {m for m, _ in segs if isinstance(self.index.linear[m], LowBitLinear)}
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
        if any(
            t.is_cuda for m in self.index.linear.values() for t in (*m.parameters(False), *m.buffers(False))
        ):
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


def _shared(
    t: torch.Tensor, dev: torch.device, dt: torch.dtype, moved: dict[int, torch.Tensor]
) -> torch.Tensor:
    """`t` on `dev` in `dt`, one copy per source tensor (deltas sharing a factor keep sharing it)."""
    if id(t) not in moved:
        moved[id(t)] = t.to(dev, dt)
    return moved[id(t)]


def _check_strength(s) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise LoraError(f"LoRA strength must be a finite number, got {s!r}")
    return float(s)
