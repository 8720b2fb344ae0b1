"""The step context and the block-runner seam: where step caching, offload streaming and
sequence-parallel plug into the transformer without touching its math.

- `StepContext` says which denoising step a forward belongs to (index, count, sigma, CFG branch).
  The denoise core makes one per forward and the transformer hands it to its block runner, so a
  runner can behave differently per step (a step cache skips blocks on some steps) without the model
  knowing why.
- A block runner owns the transformer's block loop: `run(blocks, call, img, txt, step)` where
  `call(i, block, img, txt) -> (img, txt)` runs block i with everything else bound. The default
  runs every block in order. `variant(step)` names what a step will compute ("full", "cached", ...):
  CUDA graphs capture one graph per variant, so a runner whose steps differ still replays graphs.

Runners hold per-model state (a ring of streamed weights, cached residuals); they never change the
pipeline object. Lower layers than `models/` only: this module imports nothing from qwenfast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["BRANCHES", "StepContext", "BlockRunner", "StreamingBlockRunner", "BlockCall"]

BRANCHES = ("cond", "uncond", "both")

# call(i, block, img, txt) -> (img, txt): one block with the forward's other inputs bound
BlockCall = Callable[[int, nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StepContext:
    """Where a transformer forward sits in the sampling loop.

    step: 0-based index; steps: how many in this run; sigma: the noise level of the input;
    branch: "cond", "uncond" (true CFG's negative pass) or "both" (cond and uncond batched in one
    forward, cond rows first). cache: False for a call that must not use the step cache the pipeline
    has (a short request run between two steps of a cached batch: `step_cache_bypassed`); a step cache
    runs such a forward through every block and keeps none of it.
    """

    step: int = 0
    steps: int = 1
    sigma: float = 1.0
    branch: str = "cond"
    cache: bool = True

    def __post_init__(self):
        if self.branch not in BRANCHES:
            raise ValueError(f"branch must be one of {BRANCHES}, got {self.branch!r}")
        if not 0 <= self.step < max(1, self.steps):
            raise ValueError(f"step {self.step} is outside 0..{self.steps - 1}")


class BlockRunner:
    """Runs every block, in order. Subclasses change how (streamed weights) or whether (caches)."""

    epoch = 0  # moves on when the runner reallocates buffers captured graphs read: part of their keys

    def variant(self, step: StepContext | None) -> Hashable:
        """What a forward at `step` computes; part of the CUDA-graph key. One variant here."""
        return "full"

    def reset_stats(self) -> None:
        """Zero the runner's counters (a step cache's full / cached forwards); none here."""

    def snapshot(self) -> object:
        """The runner's tensor state (a step cache's buffers), so that CUDA-graph warm-up runs, which
        execute a step before its capture, can be undone (`restore`). None: stateless."""
        return None

    def restore(self, snap: object) -> None:
        """Put back what `snapshot` returned (in place: graphs keep reading the same buffers)."""

    def prepare(self, step: StepContext | None, device: torch.device) -> None:
        """Host-side work before a forward, outside any CUDA graph (a replayed graph runs no Python):
        e.g. a step cache writes the coming step's factors into device scalars. Idempotent per step."""

    def replayed(self) -> None:
        """Host-side bookkeeping after a captured forward replayed (what its Python would have counted)."""

    def run(
        self,
        blocks: Sequence[nn.Module],
        call: BlockCall,
        img: torch.Tensor,
        txt: torch.Tensor,
        step: StepContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for i, block in enumerate(blocks):
            img, txt = call(i, block, img, txt)
        return img, txt

    @property
    def graph_safe(self) -> bool:
        """False when the runner re-points weights per call (a captured graph would read stale memory)."""
        return True

    def can_graph(self, modulations: bool) -> bool:
        """Whether a forward may be captured and replayed as a CUDA graph; `modulations`: the forward
        gets its modulation rows from the table (it reads no modulation weights)."""
        return self.graph_safe

    @property
    def every_block_resident(self) -> bool:
        """Every block runs at every step with its weights on the device: what computing per-block
        inputs (the modulation vectors) up front, before the block loop, needs."""
        return True

    def bring(self, *modules: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which `modules` (parts of a block) have their weights on the device: a runner
        that keeps some weights elsewhere (offload keeps the modulation Linears in host memory while
        the modulation table serves them) brings them in for the duration. Here they are there."""
        return contextlib.nullcontext()


class StreamingBlockRunner(BlockRunner):
    """Offload: each block's weights are brought in by a `BlockStreamer` (runtime/offload.py) just
    before it runs and released after; the next block's copy overlaps this block's compute.

    CUDA graphs: a forward is captured with its block copies in it (the streamer's `capture`), so a
    streamed forward replays with one launch. Eagerly, the ~2,000 launches of a forward cost more than
    the copies they wait for once most blocks are resident (16 GiB: ~50 ms a 1024² step over resident
    for 25 ms of copies). The planner counts the graph pool as held outside the denoise loop too (the
    VAE decode cannot reuse it): capturing without that pushed the decode into its out-of-memory
    fallback (H200, FP8, 16 GiB cap, bench/results/fp8.jsonl)."""

    def __init__(self, streamer):
        self.streamer = streamer

    def run(
        self,
        blocks: Sequence[nn.Module],
        call: BlockCall,
        img: torch.Tensor,
        txt: torch.Tensor,
        step: StepContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.streamer
        capturing = s.cuda and torch.cuda.is_current_stream_capturing()
        with s.capture() if capturing else contextlib.nullcontext():
            for i, block in enumerate(blocks):
                s.before(i)
                try:
                    img, txt = call(i, block, img, txt)
                finally:
                    s.after(i)
        return img, txt

    def prepare(self, step: StepContext | None, device: torch.device) -> None:
        """Before a graph is captured or replayed: the copies in flight finish, the ring starts empty."""
        self.streamer.fence()

    def replayed(self) -> None:
        self.streamer.replayed()

    @property
    def graph_safe(self) -> bool:
        """A graph that does not call `prepare` / `replayed` (Qwen-Image-2.1's cached steps) is safe only
        when no block streams and the modulation weights are on the device."""
        return not self.streamer.order and not self.streamer.held

    def can_graph(self, modulations: bool) -> bool:
        """Blocks may stream (the graph holds their copies); the modulation Linears kept in host memory
        must go unread: the rows come from the table."""
        return modulations or not self.streamer.held

    @property
    def every_block_resident(self) -> bool:
        return False

    def bring(self, *modules: nn.Module) -> contextlib.AbstractContextManager:
        return self.streamer.bring(*modules)
