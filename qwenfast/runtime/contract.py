"""What the layers above may ask of a model: the written contract between models and the engine.

Why: the pipeline, the CUDA-graph runner and the FP8 walkers used to discover a transformer's
abilities by probing (`hasattr(tr, "modulation_table")`), configure it by assigning attributes from
outside, and know its layer names (`transformer_blocks`, `img_mod`). Every new model family then had
to match those guesses by accident. Here the members are stated once; a model subclasses the contract
and fills in what it has, and the layers above call only these members.

- `BlockModel`: a network of identical blocks with a reference and a fused path (the kernel switch)
  and Linears that FP8 may replace. The ControlNet is one (its blocks are the transformer's).
- `DenoisableTransformer`: a `BlockModel` the denoise core calls, whose block loop a block runner
  owns (runtime/blocks.py: offload streaming, step caches) and which may keep a modulation table
  (runtime/modulation.py). Qwen-Image (`models/transformer.py`) and Qwen-Image-2.1
  (`models/transformer21.py`) are.
- `OwnsBlockRunner`: the one member the CUDA-graph runner needs (graphs are keyed by the runner's
  variant), as a structural protocol, so that the runner also wraps modules that are not models.

Models are below the pipeline and above this module: they import it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from .blocks import BlockRunner
from .modulation import ModulationTable

__all__ = ["BlockModel", "DenoisableTransformer", "OwnsBlockRunner"]


class BlockModel(nn.Module):
    """A network of blocks with a reference path (op for op diffusers) and a fused one.

    Members: `fused` (read; the fused path is on) and `set_fused(on)`; `blocks` (the block list);
    `fp8_linears()` (the Linears FP8 replaces, by module name: the model's own declaration, so the
    FP8 walker in kernels/ knows no model's layer names).
    """

    def __init__(self):
        super().__init__()
        self.fused = True  # fused kernels (qwenfast.kernels; their torch references off CUDA)

    def set_fused(self, on: bool) -> None:
        """The fused block path (True) or the plain reference blocks (False)."""
        self.fused = bool(on)

    @property
    def blocks(self) -> nn.ModuleList:
        """The identical blocks, in the order the forward runs them (offload streams them, the memory
        planner sizes them, a KV cache has one slot each, regional compilation compiles each)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its blocks")

    def fp8_linears(self) -> list[str]:
        """Module names (as `named_modules` gives them) of the `nn.Linear`s that FP8 replaces
        (`kernels.fp8_linear.quantize_model`, and the loaders that build FP8 layers while streaming)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its FP8 Linears")


class DenoisableTransformer(BlockModel):
    """The transformer the denoise core calls: `forward(x, txt, mask, t, img_shapes, ..., step=,
    shard=, block_residuals=, modulations=)` (see each model's `forward` for its arguments).

    Members beyond `BlockModel`'s:
    - `cfg`, `dtype`, `device`: the model's config and where its weights are;
    - `block_runner` (read) and `set_block_runner(runner)`: who owns the block loop;
    - `modulation_table` (read; None: the model keeps none, or it is off) and
      `set_modulation_cache(entries)`: the per-timestep modulation rows (runtime/modulation.py);
    - `modulation_entries(ts)`: a table entry per timestep (only called while a table is kept);
    - `modulation_modules()`: per block, the modules that compute its modulation (what offload may
      keep in host memory while the table serves them; the memory planner counts them);
    - `takes_key_lengths` (whether the model can) and `key_lengths` (read) / `set_key_lengths(on)`: a
      text mask becomes `runtime.attention.KeyLengths` (joint order [image; text], no mask), so text
      padded to a bucket costs attention nothing (`EngineOptions.text_bucket`);
    - `graph_tag`: hashable state outside a forward's inputs that changes what it computes, part of
      every CUDA graph's key (`runtime.cuda_graphs`); per-row LoRAs set it (`loading/lora_rows.py`).
    """

    takes_key_lengths = False
    key_lengths = False
    graph_tag: object = None

    cfg: Any

    def __init__(self):
        super().__init__()
        self._block_runner: BlockRunner = BlockRunner()

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def block_runner(self) -> BlockRunner:
        """The block loop's owner (runtime/blocks.py): plain, offload streaming, a step cache."""
        return self._block_runner

    @block_runner.setter
    def block_runner(self, runner: BlockRunner) -> None:  # tests and benchmarks swap runners by hand
        self.set_block_runner(runner)

    def set_block_runner(self, runner: BlockRunner) -> None:
        """Hand the block loop to `runner` (captured CUDA graphs of the old runner are the caller's to drop)."""
        if not isinstance(runner, BlockRunner):
            raise TypeError(
                f"a block runner must be a runtime.blocks.BlockRunner, got {type(runner).__name__}"
            )
        self._block_runner = runner

    def set_key_lengths(self, on: bool) -> None:
        """Padded text by key lengths (True) or by a boolean key mask; only where `takes_key_lengths`."""
        self.key_lengths = bool(on) and self.takes_key_lengths

    @property
    def modulation_table(self) -> ModulationTable | None:
        """The modulation table the forward reads its modulation rows from, or None. None here: a
        model whose blocks share one modulation (Qwen-Image-2.1) keeps no table."""
        return None

    def set_modulation_cache(self, entries: int) -> None:
        """Keep a modulation table with room for `entries` timesteps (0: none). A model without
        per-block modulation ignores it (its `modulation_table` stays None)."""

    def modulation_entries(self, ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Modulation-table entries for timesteps `ts`; only models that keep a table compute them."""
        raise NotImplementedError(f"{type(self).__name__} keeps no modulation table")

    def modulation_modules(self) -> list[tuple[nn.Module, ...]]:
        """Per block, the modules that compute its modulation vectors; empty: none per block."""
        return []


@runtime_checkable
class OwnsBlockRunner(Protocol):
    """A module whose block loop a block runner owns (every `DenoisableTransformer`): what the CUDA-graph
    runner reads to key its graphs by the runner's variant. Any other module runs as one variant."""

    block_runner: BlockRunner
