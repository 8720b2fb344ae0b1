"""The layer side of per-row LoRAs (the op itself: kernels/lora_rows.py): the selection every layer of a
model reads (`RowSelection`: which adapter slots each batch row uses, in device buffers a CUDA graph
replays with), one layer's stacked adapters (`RowLora`, what an 8-bit layer's `lora` holds), and the float
Linear that adds them (`RowLoraLinear`), with `plain_linear` for the fused paths that read a Linear's
weight directly.

Tried and taken out (commit dd7437f): the qkv layers' expand fused into the QK-norm + RoPE kernel (the
consumer adding each row's update in its own pass over the projection). On an H100 (FP8, batch 4, 1024²,
four rank-64 LoRAs, eager) the forward took 429.3 ms with it against 410.3 ms with the expand on its own
(`python -m qwenfast.benchmarks.lora_tiles --rows`), and the kernel alone was no faster than the pair at
its best token tile."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fp8_lora_gemm, use_triton
from .lora_rows import _shrink, lora_rows

__all__ = ["RowLora", "RowLoraLinear", "RowSelection", "plain_linear"]


def plain_linear(layer: nn.Module) -> bool:
    """Whether `layer(x)` is `F.linear(x, layer.weight, layer.bias)` this forward: an nn.Linear, or a
    `RowLoraLinear` that adds nothing now (so a fused path may read its weight directly)."""
    return type(layer) is nn.Linear or (isinstance(layer, RowLoraLinear) and not layer.adds())


class RowSelection:
    """Which adapter slots each row of the coming forward uses, shared by every layer of a model: the host
    writes it before a forward (`set`), each `RowLora` reads it. One pair of device buffers per batch size,
    rewritten in place: a CUDA graph captured for a batch size reads the same buffers at every replay."""

    def __init__(self, width: int = 2):
        self.width = width  # S: adapters a row may combine
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None
        self.used = width  # the most adapters any row of the current selection combines (host-side)
        # host-side runs of consecutive rows with the same adapters: [(first row, end row, [(slot, s)])]
        self.groups: list[tuple[int, int, list[tuple[int, float]]]] = []

    def clear(self) -> None:
        """No selection: every forward until the next `set` runs without the side path (a call that
        gives no per-row LoRAs must not inherit the last call's)."""
        self.current, self.used, self.groups = None, 0, []

    def set(self, rows: list[list[tuple[int, float]]], device: torch.device | str) -> None:
        """`rows`: per batch row, its [(slot, strength), ...] (slot 0 / an empty list: no LoRA)."""
        if any(len(r) > self.width for r in rows):
            raise ValueError(f"a row combines more than {self.width} LoRAs (RowSelection.width)")
        idx = torch.zeros(len(rows), self.width, dtype=torch.long)
        scale = torch.zeros(len(rows), self.width, dtype=torch.float32)
        for b, row in enumerate(rows):
            for s, (slot, strength) in enumerate(row):
                idx[b, s], scale[b, s] = slot, strength
        key = (len(rows), str(torch.device(device)))
        if key not in self.buffers:
            self.buffers[key] = (idx.to(device), scale.to(device))
        else:
            self.buffers[key][0].copy_(idx, non_blocking=True)
            self.buffers[key][1].copy_(scale, non_blocking=True)
        self.current = self.buffers[key]
        self.used = max((len(r) for r in rows), default=0)
        self.groups = []
        for b, row in enumerate(rows):
            row = [(int(j), float(v)) for j, v in row if j != 0 and v != 0]
            if self.groups and self.groups[-1][2] == row and self.groups[-1][1] == b:
                self.groups[-1] = (self.groups[-1][0], b + 1, row)
            else:
                self.groups.append((b, b + 1, row))
        self.groups = [g for g in self.groups if g[2]]

    @property
    def active(self) -> bool:
        """Whether any row of the current selection uses an adapter (host-side). When none does, the
        side path is skipped altogether, in a captured graph too: graphs are keyed by how many adapters
        a row combines, 0 for none (`RowAdapters.select` tags the model), so rows without LoRAs pay
        nothing."""
        return bool(self.groups)


@dataclass
class RowLora:
    """One layer's stacked adapters (`down` (n, R, K), `up` (n, N, R); slot 0 zeros), each slot's own
    rank (`ranks`, host-side: R is the largest, padded), and the model's selection: what
    `LowBitLinear.lora` holds when each row picks its own LoRAs."""

    down: torch.Tensor
    up: torch.Tensor
    selection: RowSelection
    ranks: list[int] = field(default_factory=list)
    # (n, G, 2) int32: per slot and per row block of the output (G equal blocks: 3 for Q|K|V), the
    # stacked rank's columns [lo, hi) its up factors use (`loading.lora_fp8.piece_ranks`); None: all
    ranges: torch.Tensor | None = None

    def add(self, x2: torch.Tensor, y2: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """y2 (M, N) + the per-row updates of x2 (M, K); the M tokens are B rows of M / B, in order.
        `x2` may be the e4m3 codes of an FP8 layer's input with `x_scale` (M, 1) their row scales (the
        rows its producer quantised: no bf16 copy of the input is kept for this side path).

        Captured into a CUDA graph: `lora_rows` over the selection's device buffers, cut to the slot
        columns the rows use (any later selection using as many replays correctly). Eager, where the
        host knows the selection: nothing when no row has a LoRA; when the rows with one share the same
        adapters (batch 1 always), two plain GEMMs per adapter at its own rank on those rows (the
        strength as the second one's alpha), as cheap as a LoRA loaded for the whole batch; otherwise
        `lora_rows` cut likewise. (On an H100, FP8, 1024², batch 4 with four rank-64 LoRAs, commit
        7dfd1a1: a GEMM pair per row cost 39% over no LoRA, the gathered pass 26%.)"""
        sel = self.selection
        if not sel.active:  # no selection, or no row of it has a LoRA (a graph captured so is keyed so)
            return y2
        B, (M, K), N = sel.current[0].shape[0], x2.shape, y2.shape[1]
        if M % B:
            raise RuntimeError(f"per-row LoRAs: {M} tokens do not split into the selection's {B} rows")
        T = M // B
        xs = None if x_scale is None else x_scale.reshape(B, T)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing or len(sel.groups) > 1:  # rows differ: one gathered pass beats a GEMM pair per run
            # (measured); the used slot columns only (graphs are keyed by that count: `RowAdapters._tag`)
            idx, scale = sel.current
            idx, scale = idx[:, : sel.used], scale[:, : sel.used]
            x3, y3 = x2.reshape(B, T, K), y2.view(B, T, N)
            return lora_rows(x3, y3, self.down, self.up, idx, scale, xs, self.ranges).reshape(M, N)
        dt = self.down.dtype
        for b0, b1, adapters in sel.groups:
            xr, yr = x2[b0 * T : b1 * T], y2[b0 * T : b1 * T]  # (rows*T, K), (rows*T, N): row blocks
            for slot, strength in adapters:
                r = self.ranks[slot] if slot < len(self.ranks) else self.down.shape[1]
                if r == 0:  # this adapter leaves this layer alone
                    continue
                h = xr.to(dt) @ self.down[slot, :r].t()  # (rows*T, r)
                if x_scale is not None:  # e4m3 codes: each token's product times its row scale
                    h = (h.float() * x_scale[b0 * T : b1 * T]).to(dt)
                if yr.dtype == dt:
                    yr.addmm_(h, self.up[slot, :, :r].t(), alpha=strength)
                else:
                    yr.copy_(torch.addmm(yr.to(dt), h, self.up[slot, :, :r].t(), alpha=strength))
        return y2

    def fused(self, codes: torch.Tensor, x_scale: torch.Tensor) -> tuple | None:
        """The update as `fp8_lora_gemm`'s epilogue takes it, (h, up, idx, ranges), with h the shrink of
        the layer's e4m3 input `codes` (M, K) and its row scales (M, 1); None where `add` should run
        instead: no row with a LoRA, layouts the kernels do not take, or by `fp8_lora_gemm.FUSED_GEMM["on"]`:
        0 never, 1 in a forward being captured into a CUDA graph, 2 (default) also eagerly where rows
        differ. Eagerly the host's work per launch (three TMA descriptors made, a launch of 30-odd
        arguments) once fell behind the GPU: on an H100 (FP8, batch 4, 1024², four rank-64 LoRAs) the
        eager forward took 485 and 431 ms with it against 420 and 415 ms with cuBLAS + the expand (commits
        56ea94b, 9932aea). With the TMA shrink and the persistent GEMM it was faster eagerly in every run:
        384 / 386 / 381 / 376 ms against 405 / 408 / 402 / 424 (d583209, 6c83634, 90056f6, 682d9fb), as
        replayed in a graph (381 / 381 / 371 / 372 against 403 / 407 / 400 / 399)."""
        sel, on = self.selection, fp8_lora_gemm.FUSED_GEMM["on"]
        if not on or not sel.active or self.down.dtype != torch.bfloat16:
            return None
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        (M, K), B = codes.shape, sel.current[0].shape[0]
        if not (capturing or (on == 2 and len(sel.groups) > 1)):
            return None
        if M % B or not fp8_lora_gemm.fits(K, self.up.shape[1]):
            return None
        if not (use_triton(codes) and codes.is_contiguous() and x_scale.is_contiguous()):
            return None
        if not (self.down.is_contiguous() and self.up.is_contiguous()):
            return None
        idx, scale = sel.current
        idx, scale = idx[:, : sel.used], scale[:, : sel.used]  # (the used slot columns, as `add`'s)
        T = M // B
        h = _shrink(codes.view(B, T, K), self.down, idx, scale, None, x_scale.reshape(B, T))
        return h, self.up, idx, self.ranges


class RowLoraLinear(nn.Linear):
    """A float Linear whose rows add their own LoRAs (`lora`: a `RowLora`, or None: a plain Linear).
    It shares the Linear it stands in for's parameters (`wrap`): same names, same storage, so batch-wide
    LoRA merges, offload streaming and checkpoints see the layer they knew. Fused paths that read a
    Linear's weight directly (the MLP's GELU epilogue) take it when `plain_linear(layer)`."""

    lora: RowLora | None = None

    @classmethod
    def wrap(cls, lin: nn.Linear) -> RowLoraLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias  # the same Parameters, not copies
        return new

    def adds(self) -> bool:
        """Whether this forward adds anything to the GEMM: a stack is set and some row of the current
        selection uses an adapter. When not, fused paths may take the layer as a plain Linear (rows
        without a LoRA pay nothing: the MLP's GELU epilogue cost 4% of a bf16 forward when skipped)."""
        return self.lora is not None and self.lora.selection.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adds():
            return y
        K, N = x.shape[-1], y.shape[-1]
        return self.lora.add(x.reshape(-1, K), y.reshape(-1, N)).view(y.shape)
