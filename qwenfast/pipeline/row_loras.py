"""Per-request LoRAs inside one batch: `pipe.enable_row_loras(folder)`, then
`pipe(prompt=[...], loras=[[("style", 0.8)], [], ...])` (one list per prompt).

Why a mixin of its own: the pipeline's part is small (which rows of a forward belong to which image) and
the rest is the adapters' (loading/lora_rows.py) and the op's (kernels/lora_rows.py). A forward of the
denoise core holds each image of its chunk once, or twice with batched CFG (cond rows, then uncond rows:
`sampling.denoise`), so the selection it needs is the chunk's rows repeated; it is written right before the
forward, outside any CUDA graph, through the core's `forward_for` seam (as ControlNet's residuals are).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import ConfigureError, LoraError

Rows = list[list[tuple[str, float]]]


class RowLoraMethods:
    """`enable_row_loras`, `row_loras` and the forward wrapper the generation path uses (mixed into the
    pipelines: `self.transformer`, `self.options`, `self.lora_manager`, `self._graphs`)."""

    @property
    def row_loras(self):
        """The `RowAdapters` (resident adapters, LRU counters) or None before `enable_row_loras`."""
        return self._row_adapters

    def enable_row_loras(
        self, folder: str | os.PathLike | None = None, slots: int = 8, width: int = 2
    ) -> None:
        """Let each prompt of a call use its own LoRAs (`loras=` per prompt), read from `folder`
        (`name.safetensors`) on first use and kept in `slots` slots on the device, least recently used
        out first; a prompt combines up to `width`. Any weights (bf16, fp8, int8: the adapters run
        unmerged beside the block GEMMs), no LoRA loaded for the whole batch, the transformer resident
        on the device; the class must declare it (`capabilities.row_loras`: its call takes `loras=`)."""
        from ..loading.lora_rows import RowAdapters

        if not self.capabilities.row_loras:
            raise ConfigureError(f"{type(self).__name__} does not take LoRAs per prompt (text-to-image does)")
        if self.options.offload == "blocks":
            raise ConfigureError("per-row LoRAs need the transformer resident on the device (no offload)")
        if self.lora_manager.active:
            raise ConfigureError("LoRAs are loaded for the whole batch: set_loras([]) before per-row LoRAs")
        if self.options.parallel is not None:
            raise ConfigureError("per-row LoRAs do not run with --parallel yet")
        adapters = RowAdapters(self.transformer, slots=slots, width=width, folder=folder, device=self.device)
        adapters.install()
        self._row_adapters = adapters
        self._row_layout = adapters.layout
        self._graphs.clear()  # captured without the side GEMMs

    def _rows_done(self) -> None:
        """After a call: its selection goes, so a later call (or another task's pipeline on the same
        transformer) that selects none runs without the adapters, not with this call's rows."""
        if self._row_adapters is not None:
            self._row_adapters.clear()

    def _rows_forward(self, loras: Rows | None, prompts: int, per_prompt: int) -> Callable | None:
        """`forward_for(core forward, i, j)` selecting images i..j's LoRAs before each forward; None
        without `loras`. `loras`: one list per prompt, repeated for its `per_prompt` images."""
        if loras is None:
            return None
        if self.row_loras is None:
            raise LoraError("loras= per prompt needs pipe.enable_row_loras(folder) first")
        if len(loras) != prompts:
            raise LoraError(f"loras= has {len(loras)} lists for {prompts} prompts (one list per prompt)")
        per_image = [list(r) for r in loras for _ in range(per_prompt)]
        adapters = self._row_adapters

        def forward_for(fwd: Callable, i: int, j: int) -> Callable:
            rows = per_image[i:j]

            def forward(x, *args, **kw):
                adapters.select(rows * (x.shape[0] // len(rows)), x.device)  # (cond rows, then uncond rows)
                if adapters.layout != self._row_layout:  # a stack grew: graphs read the old tensors
                    self._row_layout = adapters.layout
                    self._graphs.clear()
                return fwd(x, *args, **kw)

            return forward

        return forward_for
