"""Per-row LoRAs on one transformer (`RowAdapters`): each row of a batch uses its own LoRAs.

Why: a service serves people with different LoRAs; fusing one set into the weights (`LoraManager`)
makes the batcher run one LoRA group at a time. Here the adapters stay unmerged, resident on the device
in a fixed number of slots per layer, and every row selects its own (kernels/lora_rows.py does the
gathered low-rank GEMMs).

- `put(name, lora)` reads a LoRA (a path or a state dict, in any naming `loading/lora.py` reads), plans
  it onto the model's layers and writes its factors into a free slot of each touched layer's stack; when
  every slot is taken the least recently used adapter goes (`evictions`).
- `select(rows, device)`: per batch row [(name, strength), ...]; names not resident are read from
  `folder` (`name.safetensors`) on first use; marks them used and writes the selection every layer reads.
- `install()` points each touched 8-bit layer at its stack (`LowBitLinear.lora` = `RowLora`).

Which layers: the model's block Linears (`model.fp8_linears()`, the ones 8-bit weights replace). On an
8-bit base (FP8 / INT8) the stack goes into `LowBitLinear.lora`; on a float base (bf16, or fp32 for
tests) `install` stands a `RowLoraLinear` (same Parameters) in for the Linear and `uninstall` puts the
Linear back, so nothing is fused into float weights either. An adapter that touches another module is
refused, saying which: the modulation Linears (the modulation table shares one row of them between all
rows of a timestep) need a seam of their own. No PEFT biases. Shapes are static (slots x rank bucket), so
captured CUDA graphs stay valid while adapters come and go; `layout` changes when a stack grows (a larger
rank bucket) or a layer is swapped: graphs go then.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import LoraError
from ..kernels.lowbit import LowBitLinear
from ..kernels.row_lora import RowLora, RowLoraLinear, RowSelection
from .lora import ModuleIndex, plan_lora, read_lora
from .lora_fp8 import Parts, bucket, piece_ranks, side_rank, write_side

__all__ = ["RowAdapters"]


class RowAdapters:
    """Adapters resident in `slots` slots per layer (slot 0 is the zero adapter), least recently used
    out first; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        slots: int = 8,
        width: int = 2,
        folder: str | os.PathLike | None = None,
        device: torch.device | str | None = None,
    ):
        """`device`: where the stacks live (the pipeline's device; default: the model's)."""
        if slots < 1:
            raise ValueError("RowAdapters needs at least one adapter slot")
        self.model, self.index, self.slots = model, ModuleIndex(model), slots
        self.targets = frozenset(model.fp8_linears())  # the block Linears (runtime.contract.BlockModel)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.originals: dict[str, nn.Linear] = {}  # module -> the float Linear a RowLoraLinear stands in for
        self.folder = Path(folder) if folder is not None else None
        self.selection = RowSelection(width)
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.parts: dict[str, dict[str, Parts]] = {}  # name -> module -> its parts (to rewrite a grown stack)
        self.stacks: dict[str, RowLora] = {}  # module -> its stacked factors
        self.layout = 0  # bumped when a stack is (re)allocated: captured graphs read the old tensors
        self.loads = self.evictions = 0
        self.installed = False

    # ------------------------------------------------------------ adapters
    def put(self, name: str, lora: str | os.PathLike | dict, keep: frozenset[str] = frozenset()) -> int:
        """Make `name` resident (reading `lora` unless it is already); returns its slot. `keep`: names
        that must not be evicted for it (the other adapters of the batch being assembled)."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        where = f"LoRA {name!r}"
        sd, meta = read_lora(lora)
        parts: dict[str, Parts] = {}
        refused = set()
        for d in plan_lora(sd, self.index, meta, where):
            if d.module not in self.targets or d.bias is not None:
                refused.add(d.module + (" (bias)" if d.bias is not None else ""))
                continue
            parts.setdefault(d.module, []).append((d.slot, d.up, d.down, d.scale))
        if refused:
            shown = ", ".join(sorted(refused)[:4]) + (" ..." if len(refused) > 4 else "")
            raise LoraError(
                f"{where} changes {shown}: per-row LoRAs run on the transformer blocks' Linears only (not "
                "the modulation or the model's input and output layers; no biases); load it for the whole "
                "batch instead (set_loras)"
            )
        slot = self._free_slot(keep)
        self.parts[name] = parts
        for mod, p in parts.items():
            self._write(mod, slot, p)
        self.resident[name] = slot
        self.loads += 1
        return slot

    def _free_slot(self, keep: frozenset[str]) -> int:
        taken = set(self.resident.values())
        free = next((s for s in range(1, self.slots + 1) if s not in taken), None)
        if free is not None:
            return free
        victim = next((n for n in self.resident if n not in keep), None)
        if victim is None:
            raise LoraError(
                f"one batch uses more than the {self.slots} resident LoRA slots (RowAdapters.slots)"
            )
        slot = self.resident.pop(victim)
        for mod in self.parts.pop(victim):  # its rows back to zeros: a stale index reads no LoRA
            st = self.stacks[mod]
            st.down[slot].zero_()
            st.up[slot].zero_()
            st.ranges[slot].zero_()
            st.ranks[slot] = 0
        self.evictions += 1
        return slot

    def _write(self, mod: str, slot: int, parts: Parts) -> None:
        layer = self.index.linear[mod]
        st = self.stacks.get(mod)
        R, pieces = bucket(side_rank(parts)), self.index.pieces.get(mod, 1)
        if st is None or st.down.shape[1] < R:  # a new or larger stack: every resident adapter again
            dt = layer.out_dtype if isinstance(layer, LowBitLinear) else layer.weight.dtype
            dev, n = self.device, self.slots + 1
            st = RowLora(
                torch.zeros(n, R, layer.in_features, device=dev, dtype=dt),
                torch.zeros(n, layer.out_features, R, device=dev, dtype=dt),
                self.selection,
                [0] * n if st is None else st.ranks,
                torch.zeros(n, pieces, 2, device=dev, dtype=torch.int32),
            )
            self.stacks[mod] = st
            self.layout += 1
            for other, s in self.resident.items():
                if mod in self.parts[other]:
                    self._write_slot(st, s, self.parts[other][mod], pieces)
            if self.installed:
                self._point(mod)
        self._write_slot(st, slot, parts, pieces)

    @staticmethod
    def _write_slot(st: RowLora, slot: int, parts: Parts, pieces: int) -> None:
        write_side(st.down[slot], st.up[slot], parts, pieces)
        st.ranges[slot].copy_(torch.tensor(piece_ranks(parts, pieces), dtype=torch.int32))
        st.ranks[slot] = side_rank(parts)

    # ------------------------------------------------------------ batches
    def select(self, rows: list[list[tuple[str, float]]], device: torch.device | str) -> None:
        """Per batch row its [(name, strength), ...]; adapters not resident come from `folder`."""
        order = list(dict.fromkeys(n for row in rows for n, _ in row))  # first use first
        names = frozenset(order)
        for n in order:
            if n not in self.resident:
                if self.folder is None:
                    raise LoraError(f"LoRA {n!r} is not loaded (RowAdapters.put) and no LoRA folder is set")
                path = self.folder / f"{n}.safetensors"
                if not path.is_file():
                    raise LoraError(f"LoRA {n!r}: no file {path}")
                self.put(n, path, keep=names)
        for n in order:
            self.resident.move_to_end(n)
        self.selection.set([[(self.resident[n], float(s)) for n, s in row] for row in rows], device)
        self._tag()

    def clear(self) -> None:
        """No row uses an adapter until the next `select` (the end of a call that selected)."""
        self.selection.clear()
        self._tag()

    def _tag(self) -> None:
        """Key the model's CUDA graphs by how many adapters a row combines at most (0: no row uses one;
        `CudaGraphRunner`'s `graph_tag`): a forward where none does skips the side path, captured or
        not, and a captured side path runs over that many slot columns only (a batch whose rows each
        use one LoRA pays for one, not for the selection's full width)."""
        sel = self.selection
        self.model.graph_tag = ("row-loras", sel.used if sel.active else 0) if self.installed else None

    def install(self) -> None:
        """Point every stacked layer at its stack; stacks made later (a new layer, a larger rank) too."""
        for mod in self.stacks:
            self._point(mod)
        self.installed = True
        self._tag()

    def _point(self, mod: str) -> None:
        layer = self.index.linear[mod]
        if isinstance(layer, LowBitLinear):
            if isinstance(layer.lora, tuple):
                raise LoraError(
                    f"{mod} has a LoRA loaded for the whole batch: unload it (set_loras([])) before per-row "
                    "LoRAs"
                )
        elif not isinstance(layer, RowLoraLinear):  # a float Linear: a RowLoraLinear on its Parameters
            new = RowLoraLinear.wrap(layer)
            self._swap(mod, new)
            self.originals[mod] = layer
            self.layout += 1  # graphs captured the old module's GEMM
            layer = new
        layer.lora = self.stacks[mod]

    def _swap(self, mod: str, new: nn.Module) -> None:
        parent, _, leaf = mod.rpartition(".")
        setattr(self.model.get_submodule(parent), leaf, new)
        self.index.linear[mod] = new

    def uninstall(self) -> None:
        """The layers without per-row LoRAs again (the stacks stay, for `install`); float Linears are the
        very modules they were."""
        for mod in self.stacks:
            layer = self.index.linear[mod]
            if isinstance(layer, LowBitLinear) and isinstance(layer.lora, RowLora):
                layer.lora = None
        for mod, lin in self.originals.items():
            self._swap(mod, lin)
        if self.originals:
            self.layout += 1
        self.originals.clear()
        self.installed = False
        self._tag()

    @property
    def nbytes(self) -> int:
        """Device bytes of the stacks (what the slots cost: size `slots` from this)."""
        return sum(t.numel() * t.element_size() for st in self.stacks.values() for t in (st.down, st.up))
