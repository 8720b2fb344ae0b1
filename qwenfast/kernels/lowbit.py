"""The common face of the 8-bit weight layers (`FP8Linear`, `Int8Linear`): what LoRA loading and the walkers
need from a Linear whose weights are no longer a float tensor a LoRA can be fused into.

Why: a LoRA cannot be added into 8-bit weights without re-rounding them (and could not be taken out again
bit for bit), so on these layers it runs unmerged: y = base(x) + (x Dᵀ) Uᵀ, two small GEMMs beside the
8-bit one (loading/lora_fp8.py writes D and U; `add_lora` adds them). Both layer kinds keep the factors
in `lora` and say where their weights live; nothing else about their formats leaks out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from .row_lora import RowLora


class LowBitLinear(nn.Module):
    """Base of the 8-bit weight Linears: `in_features`, `out_features`, `out_dtype` (the activations'),
    `weight_device`, and an unmerged LoRA `lora` = (down (R, K), up (N, R)) in `out_dtype` (one set for
    the whole batch), a `RowLora` (each row its own, `loading/lora_rows.py`), or None.
    The LoRA manager owns `lora` (strengths folded into `up`; R padded to a bucket and rewritten in
    place on a switch, so captured CUDA graphs stay valid). Plain attributes, not buffers: not part of
    the checkpoint's state dict."""

    in_features: int
    out_features: int
    out_dtype: torch.dtype
    lora: tuple[torch.Tensor, torch.Tensor] | RowLora | None = None

    @property
    def weight_device(self) -> torch.device:
        raise NotImplementedError

    # whether a per-row LoRA here reads the e4m3 rows a producer quantised (FP8Linear) instead of a
    # kept copy of the input in `out_dtype`
    ROW_LORA_READS_CODES = False

    def lora_active(self) -> bool:
        """Whether this forward adds a LoRA: one is set and, per row, some row of the selection uses one."""
        return self.lora is not None and (not isinstance(self.lora, RowLora) or self.lora.selection.active)

    def lora_reads_input(self) -> bool:
        """Whether this forward's LoRA side path reads the layer's input in `out_dtype` (so a fused
        producer must keep it beside the 8-bit rows): a LoRA is active and it cannot read the rows
        themselves (per-row LoRAs on FP8 layers read the e4m3 codes and their scales)."""
        return self.lora_active() and not (isinstance(self.lora, RowLora) and self.ROW_LORA_READS_CODES)

    def add_lora(
        self,
        x2: torch.Tensor | None,
        y2: torch.Tensor,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """y2 (M, N) + (x2 (M, K) @ downᵀ) @ upᵀ: the low-rank side GEMMs, summed into y2 when dtypes allow;
        with per-row LoRAs (`RowLora`, kernels/lora_rows.py) each batch row adds its own (y2 as it is
        when no row uses one: `x2` may then be None, its producer kept no copy). `codes`: the input's
        e4m3 rows (M, K) and scales (M, 1), which a per-row LoRA reads when `x2` is None."""
        if not self.lora_active():
            return y2
        if isinstance(self.lora, RowLora):
            if x2 is None:
                if codes is None:
                    raise RuntimeError(
                        f"{type(self).__name__}: a per-row LoRA got neither the input nor its rows"
                    )
                return self.lora.add(codes[0], y2, codes[1])
            return self.lora.add(x2, y2)
        down, up = self.lora
        h = x2.to(down.dtype) @ down.t()  # (M, R)
        if y2.dtype == up.dtype:
            return y2.addmm_(h, up.t())  # in place: y2 is this layer's fresh output
        return torch.addmm(y2.to(up.dtype), h, up.t()).to(y2.dtype)


def replace_layers(
    model: nn.Module, names: Sequence[str] | None, make: Callable[[nn.Module], nn.Module | None]
) -> int:
    """Replace each layer the model names (`names`, else `model.fp8_linears()`: the big block GEMMs it
    marks for 8-bit weights; module names, see `runtime.contract.BlockModel`) by `make(layer)` in place,
    leaving it where `make` returns None; returns how many were replaced. The walker of both 8-bit formats:
    it knows no model's layout."""
    n = 0
    for name in model.fp8_linears() if names is None else names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = make(parent.get_submodule(leaf))
        if new is not None:
            # setattr registers the layer under `leaf`, as `parent[int(leaf)] = q` does in a Sequential
            setattr(parent, leaf, new)
            n += 1
    return n
