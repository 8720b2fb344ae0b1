"""LoRA on an FP8 base: the low-rank update runs beside the FP8 GEMM instead of being fused into it.

Why not fuse as for bf16 weights (`loading.lora`): fusing into FP8 means dequantise, add, requantise
— every switch re-rounds the weights (drift), an unload needs a second copy of the FP8 originals, and
the requantised layer carries the LoRA's delta at 3 mantissa bits. Kept unmerged, the FP8 weights are
never written (unload is bitwise by construction), the delta is computed in bf16
(y = x W8ᵀ + (x Dᵀ) Uᵀ, `LowBitLinear.add_lora`: FP8 and INT8 layers), and a switch only rewrites two small tensors per layer.

The cost is two thin GEMMs per layer (rank R against K and N: ~2R/N of the layer's FLOPs, ~4% at
rank 64 on a 3072-wide projection). All LoRAs active on a layer are concatenated along the rank:
down (R, K) stacks their down factors, up (N, R) holds each one's up factor (times strength · scale)
in its columns and in the rows of its Q/K/V third. R is padded with zeros to a bucket (16, 32, 64,
128, 192, 256, ...) and the tensors are rewritten in place while the bucket fits, so CUDA graphs captured
with them stay valid across switches; `LoraManager.side_layout` changes only when a layer's bucket
grows or its LoRA goes away, and the pipeline drops its graphs then.
"""

from __future__ import annotations

import torch

from ..errors import LoraError
from ..kernels.lowbit import LowBitLinear

__all__ = ["bucket", "piece_ranks", "set_side_lora", "side_rank", "stack_columns", "write_side"]


def bucket(rank: int) -> int:
    """The padded rank: a power of two from 16 to 64, then a multiple of 64 (three rank-64 factors of a
    LoRA with separate Q, K and V stack to 192 on the fused projection: padding that to 256 would add a
    third to its side GEMMs)."""
    return max(16, 1 << (rank - 1).bit_length()) if rank <= 64 else -(-rank // 64) * 64


# [(slot, up (rows, r), down (r, K), factor), ...]
Parts = list[tuple[int | None, torch.Tensor, torch.Tensor, float]]


def stack_columns(parts: Parts) -> tuple[dict[int, tuple[int, torch.Tensor]], int]:
    """Where each distinct `down` of `parts` goes in the stacked rank: id(down) -> (first column, down), in
    the parts' order (parts sharing one `down` tensor share its columns), and the total rank."""
    cols: dict[int, tuple[int, torch.Tensor]] = {}
    R = 0
    for _, _, down, _ in parts:
        if id(down) not in cols:
            cols[id(down)] = (R, down)
            R += down.shape[0]
    return cols, R


def side_rank(parts: Parts) -> int:
    """The rank of `parts` stacked along R (parts sharing one `down` tensor share its columns)."""
    return stack_columns(parts)[1]


def piece_ranks(parts: Parts, pieces: int) -> list[tuple[int, int]]:
    """Per row block of the output (`pieces`: 3 for Q|K|V), the columns [lo, hi) of the stacked rank that
    `write_side` gives it nonzero up factors in (lo == hi: none). A LoRA with separate Q, K and V factors
    puts each block's in its own third of the stack: a side GEMM that knows this multiplies a block's
    outputs by that third only (`kernels/lora_rows.py`), not by the zeros of the other two."""
    cols, R = stack_columns(parts)
    lo, hi = [R] * pieces, [0] * pieces
    for slot, _, down, _ in parts:
        c = cols[id(down)][0]
        for p in range(pieces) if slot is None else (slot,):
            lo[p], hi[p] = min(lo[p], c), max(hi[p], c + down.shape[0])
    return [(a, b) if a < b else (0, 0) for a, b in zip(lo, hi)]


@torch.no_grad()
def write_side(down_t: torch.Tensor, up_t: torch.Tensor, parts: Parts, pieces: int = 3) -> None:
    """Write `parts` [(slot, up (rows, r), down (r, K), factor), ...] into down_t (R, K) / up_t (N, R)
    (R >= `side_rank(parts)`; the rest zeroed): their downs stacked along R (`stack_columns`), each up
    (times its factor) in its columns and in the rows of its slot (`pieces` equal row blocks: 3 for Q|K|V)."""
    N = up_t.shape[0]
    cols, R = stack_columns(parts)
    down_t[R:].zero_()
    up_t.zero_()
    for c, down in cols.values():
        down_t[c : c + down.shape[0]].copy_(down)
    for slot, up, down, f in parts:  # parts sharing a down factor write different rows: no overlap
        c = cols[id(down)][0]
        rows = slice(None) if slot is None else slice(slot * (N // pieces), (slot + 1) * (N // pieces))
        up_t[rows, c : c + down.shape[0]].copy_(up.to(up_t.device, torch.float32) * f)


@torch.no_grad()
def set_side_lora(
    layer: LowBitLinear, parts: list[tuple[int | None, torch.Tensor, torch.Tensor, float]], pieces: int = 3
) -> bool:
    """Make `layer.lora` hold exactly `parts` [(slot, up (rows, r), down (r, K), factor), ...].

    Parts that share one `down` tensor (a LoRA on a fused Q|K|V split in three) share its columns.
    `pieces`: how many equal row blocks a slot indexes (3 for Q|K|V, 2 for 2.1's gate|up).
    Returns True when the layer's tensors were (re)allocated or removed (captured graphs are stale).
    """
    if layer.lora is not None and not isinstance(layer.lora, tuple):
        raise LoraError(
            "per-row LoRAs are installed on this layer (loading/lora_rows.py RowAdapters): uninstall them "
            "before loading LoRAs for the whole batch"
        )
    if not parts:
        changed = layer.lora is not None
        layer.lora = None
        return changed
    N, K = layer.out_features, layer.in_features
    size = bucket(side_rank(parts))
    realloc = not isinstance(layer.lora, tuple) or layer.lora[0].shape[0] < size
    if realloc:
        dev, dt = layer.weight_device, layer.out_dtype
        down_t = torch.empty(size, K, device=dev, dtype=dt)
        up_t = torch.empty(N, size, device=dev, dtype=dt)
    else:
        down_t, up_t = layer.lora
    write_side(down_t, up_t, parts, pieces)
    if realloc:
        layer.lora = (down_t, up_t)
    return realloc
