"""LoRAs for the whole batch: `load_lora`, `unload_lora`, `set_loras` (the server's batch-wide switch) and the
`LoraManager` behind them (loading/lora_manager.py: fused into bf16 weights, restored bitwise on unload;
unmerged beside FP8/INT8 GEMMs). Per-request LoRAs inside one batch are `row_loras.py`'s.

A mixin of `PipelineBase`: after any change the modulation table is cleared (a LoRA may touch the
modulation Linears) and, when unmerged LoRA tensors were reallocated, the captured CUDA graphs too.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LoraError


class LoraMethods:
    """Whole-batch LoRAs of a loaded model (see the module docstring)."""

    @property
    def lora_manager(self):
        """The LoRAs fused into `self.transformer` (created on first use; see `LoraManager`)."""
        m = getattr(self, "_lora_manager", None)
        if m is None or m.model is not self.transformer:
            if m is not None and m.active:
                raise RuntimeError("pipe.transformer was replaced while LoRAs were fused into the old one")
            from ..loading.lora_manager import LoraManager

            m = self._lora_manager = LoraManager(self.transformer)
        return m

    def load_lora(self, lora: str | Path | dict, strength: float = 1.0, name: str | None = None) -> str:
        """Fuse a LoRA (.safetensors path or state dict, any common naming) into the transformer; returns its name.

        Several LoRAs stack. Errors (unknown layers, wrong shapes, unreadable file) are raised before
        any weight changes. The original values of touched weights are kept in host memory so that
        `unload_lora` restores them bitwise (as much host memory as the touched weights). With FP8 or
        INT8 the LoRA runs unmerged beside the 8-bit GEMMs (`loading/lora_fp8.py`): nothing is copied.
        """
        layout = self.lora_manager.side_layout
        try:
            return self.lora_manager.load(lora, strength, name)
        finally:
            self._lora_changed(layout)

    def unload_lora(self, name: str | None = None) -> None:
        """Remove one LoRA by name, or all of them: touched weights are restored bitwise."""
        layout = self.lora_manager.side_layout
        try:
            self.lora_manager.unload(name)
        finally:
            self._lora_changed(layout)

    @property
    def loras(self) -> dict[str, float]:
        """Active LoRAs, name -> strength, in load order."""
        return self.lora_manager.loras

    def set_loras(self, loras: list[tuple]) -> None:
        """Make the active LoRAs exactly `[(path, strength[, name]), ...]`, changing only what differs."""
        if loras and self.row_loras is not None:
            raise LoraError("per-row LoRAs are enabled (enable_row_loras): pass loras= per prompt instead")
        layout = self.lora_manager.side_layout
        try:
            self.lora_manager.set(loras)
        finally:
            self._lora_changed(layout)

    def _lora_changed(self, layout: int) -> None:
        """After a LoRA change: drop captured graphs if FP8 layers' LoRA tensors were reallocated."""
        self._clear_modulations()  # a LoRA may touch the modulation Linears
        if self.lora_manager.side_layout != layout:
            self._graphs.clear()
