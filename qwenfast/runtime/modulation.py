"""The modulation table: every block's adaLN modulation vectors, computed once per timestep and reused.

Why: each Qwen-Image block turns the timestep embedding into 12 modulation vectors with two
Linear(3072, 18432) layers (`img_mod`, `txt_mod`). They depend on nothing but the timestep (and the
weights), yet a forward recomputes them: 120 GEMVs reading 13.6 GB of bf16 weights, ~3 ms of an 88 ms
FP8 forward on an H200, and half of every FP8 block's bytes (the modulation stays bf16 for quality).
A 4-step preset uses the same four timesteps for every image of a size; 50 steps use 50. So the
pipeline keeps a small table: timestep -> (blocks, 2, 6D) rows (img_mod, txt_mod of one embedding
row), and the forward reads its rows from there. Under `offload="blocks"` the modulation weights then
stay in host memory (`BlockStreamer(skip=...)`): a full-size FP8 block streams 226 MB instead of 452,
and 60 FP8 blocks fit in 13.6 GB. A table miss computes the entry from those weights (brought in
block by block) before the forward runs, once per new timestep.

Exactness: an entry is computed with the forward's own modules on one embedding row, alone (the same
GEMV as a batch-1 forward computes: bitwise equal there). A batch of B rows then shares the entry's
rows, where the forward without the table runs an M=B GEMM: equal up to the GEMM's rounding order.
An entry never depends on which other timesteps were computed with it (one GEMV per timestep).

Keys are host floats (the step's sigma), so a lookup needs no device sync. The table must be cleared
when the weights change (LoRA, FP8, offload: the pipeline does it, with its CUDA graphs). Entries are
kept in a small LRU (`max_entries`; a full-size entry is 4.4 MB).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = ["ModulationTable", "batch_rows", "ZERO"]

ZERO = "t=0"  # the key of the t=0 entry (zero_cond_t: reference-image tokens are modulated with t=0)


class ModulationTable:
    """timestep key -> (n_blocks, 2, 6D) modulation rows; an LRU of `max_entries` with hit/miss counts."""

    def __init__(self, max_entries: int = 64):
        if max_entries < 1:
            raise ValueError(f"the modulation table needs max_entries >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self.entries.clear()

    def fill(
        self,
        keys: Sequence[Hashable],
        ts: Sequence[torch.Tensor],
        compute: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    ) -> None:
        """Make sure `keys[k]` is in the table, computing the missing ones in one call of
        `compute(list of timestep tensors (1,)) -> list of (n_blocks, 2, 6D)` (one pass over the
        blocks' weights for all of them: what a schedule's worth of misses costs under offload)."""
        todo = {}
        for k, t in zip(keys, ts):
            if k not in self.entries and k not in todo:
                todo[k] = t
        if todo:
            self.misses += len(todo)
            for k, e in zip(todo, compute(list(todo.values()))):
                self._put(k, e)

    def get(
        self, key: Hashable, t: torch.Tensor, compute: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    ) -> torch.Tensor:
        """The entry for `key` (computed from timestep `t` (1,) on a miss)."""
        e = self.entries.get(key)
        if e is None:
            self.fill([key], [t], compute)
            return self.entries[key]
        self.hits += 1
        self.entries.move_to_end(key)
        return e

    def _put(self, key: Hashable, entry: torch.Tensor) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def nbytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.entries.values())


def batch_rows(entry: torch.Tensor, batch: int, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Table entries -> the forward's per-block modulations (n_blocks, R + B, 6D): img rows for the R
    embedding rows (B rows of `entry`, then, with zero_cond_t, B rows of the t=0 entry `zero`), then
    B txt rows. `entry`, `zero`: (n_blocks, 2, 6D). Batch 1 without `zero` is the entry itself (read
    only): no copy on the per-step path."""
    if batch == 1 and zero is None:
        return entry
    n, _, w = entry.shape
    img = [entry[:, :1].expand(n, batch, w)]
    if zero is not None:
        img.append(zero[:, :1].expand(n, batch, w))
    return torch.cat([*img, entry[:, 1:].expand(n, batch, w)], dim=1)
