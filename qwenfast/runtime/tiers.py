"""Memory tiers: one number (`vram_gib`) decides where every weight lives and in which precision.

Why one switch: a user with a 12 GiB card should not have to know that the transformer is 41 GB in bf16
and 20 GB in 8 bits, that its 60 blocks can stream from host memory while the resident ones compute,
that the text encoder's 28 layers can stream too, and that the VAE tiles when a decode would not fit.
`plan(sizes, vram_gib)` answers all of it from the memory planner (runtime/memory.py), so the choices
are the ones whose predicted peak fits, in this order of preference (each costs more time than the last):

1. weights: what the options ask for ("bf16" by default: 8-bit formats are lossy, so never chosen
   silently); "auto" takes this card's fastest 8-bit GEMM from the architecture table (runtime/arch.py:
   FP8 on Ada/Hopper/Blackwell, INT8 on Ampere), which also halves what has to stream;
2. offload "none" when everything fits; "model" (the text encoder streams its layers while encoding);
   "blocks" (the transformer blocks that do not fit stream every step; the budget goes first to resident
   blocks, then to text-encoder layers, as `pipeline/placement.py` plans it);
3. the VAE tiles when the untiled decode would not fit what is left (the VAE decides per call, from the
   same planner: `models/vae.py` "auto").

The plan also says how many bytes cross PCIe per image: that, not the FLOPs, is what a small card pays.
Nothing here touches a pipeline: `pipeline/placement.py` turns a plan into options (`VramPlan.options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..options import WEIGHTS
from .arch import NONE, Arch
from .memory import Calibration, GiB, MemoryPlanner, ModelSizes

__all__ = ["VramPlan", "WEIGHTS", "plan", "weights_for", "TooSmall"]

MARGIN = 0.9  # plan for 90% of the budget: the caching allocator's fragmentation counts against a hard cap


class TooSmall(ValueError):
    """The model does not fit the budget even with every block streaming."""


def weights_for(card: Arch, asked: str) -> str:
    """The weight format that runs: `asked`, or for "auto" this card's fastest 8-bit GEMM (bf16 without
    either, e.g. on the CPU)."""
    if asked not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {asked!r}")
    if asked != "auto":
        return asked
    if card.fp8_gemm:
        return "fp8"
    return "int8" if card.int8_gemm else "bf16"


def eight_bit(sizes: ModelSizes) -> ModelSizes:
    """`sizes` (bf16 or fp16 weights) with the blocks' big Linears in 8 bits, as FP8 and INT8 store them
    (1 byte per weight + a per-channel scale; the modulation Linears, norms and everything outside the
    blocks stay 16-bit)."""
    other = sizes.transformer_block - sizes.block_modulation  # the 8-bit Linears (norms: ~0.01%)
    block = sizes.block_modulation + other // 2
    return replace(
        sizes,
        transformer=sizes.transformer - sizes.num_blocks * (sizes.transformer_block - block),
        transformer_block=block,
    )


@dataclass(frozen=True)
class VramPlan:
    """Where the weights of one model live under a memory budget, and what a call of the planned size costs."""

    vram_gib: float
    weights: str  # "bf16" | "fp8" | "int8"
    offload: str  # "none" | "model" | "blocks"
    resident_blocks: int
    num_blocks: int
    te_resident_layers: int
    te_layers: int
    vae_tiled: bool
    peak_gib: float  # predicted peak of a call of the planned size
    phases_gib: dict[str, float]
    step_bytes: int  # transformer weights copied host -> GPU per denoising step
    prompt_bytes: int  # text-encoder weights copied in per new prompt
    once_bytes: int = 0  # streamed blocks alone in a ring slot: copied once, then kept there
    schedule_bytes: int = 0  # the modulation Linears (host memory), brought in once per new step schedule
    height: int = 1024
    width: int = 1024
    notes: tuple[str, ...] = field(default_factory=tuple)

    def options(self) -> dict[str, Any]:
        """The `EngineOptions` fields this plan sets."""
        out: dict[str, Any] = {
            "offload": self.offload,
            "fp8": self.weights == "fp8",
            "int8": self.weights == "int8",
        }
        out["offload_budget"] = self.vram_gib if self.offload == "blocks" else None
        return out

    def image_bytes(self, steps: int, new_prompt: bool = True, first: bool = False) -> int:
        """Bytes copied host -> GPU for one image of `steps` steps (CFG runs as one batched forward);
        `first`: the first image of a new step schedule (the ring's first fill, the modulation Linears)."""
        once = self.once_bytes + self.schedule_bytes if first else 0
        return steps * self.step_bytes + (self.prompt_bytes if new_prompt else 0) + once

    def lines(self, steps: int = 50) -> list[str]:
        """The plan as text (`qwenfast doctor --vram N`)."""
        where = {
            "none": "everything resident",
            "model": "text encoder in host memory (its layers stream while encoding), transformer resident",
            "blocks": f"{self.resident_blocks} of {self.num_blocks} transformer blocks resident, "
            f"{self.num_blocks - self.resident_blocks} stream each step; text encoder: "
            f"{self.te_resident_layers} of {self.te_layers} layers resident",
        }[self.offload]
        ph = ", ".join(f"{k} {v:.1f}" for k, v in self.phases_gib.items())
        return [
            f"budget {self.vram_gib:g} GiB, {self.height}x{self.width}: weights {self.weights}, offload {self.offload}",
            f"  {where}",
            f"  VAE: {'tiled' if self.vae_tiled else 'untiled'} decode; predicted peak {self.peak_gib:.1f} GiB ({ph})",
            f"  host -> GPU per image: {self.image_bytes(steps) / 1e9:.1f} GB at {steps} steps "
            f"({self.step_bytes / 1e9:.2f} GB a step + {self.prompt_bytes / 1e9:.1f} GB per new prompt)",
            *(f"  note: {n}" for n in self.notes),
        ]


def plan(
    sizes: ModelSizes,
    vram_gib: float,
    *,
    weights: str = "bf16",
    card: Arch = NONE,
    height: int = 1024,
    width: int = 1024,
    cfg: bool = True,
    eight_bit_sizes: bool = False,
    table_bytes: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    ring: int = 2,
    graphs: bool = False,
    calib: Calibration | None = None,
) -> VramPlan:
    """The plan for a model of `sizes` (16-bit weights unless `eight_bit_sizes`: measured on a loaded
    8-bit model) under `vram_gib` GiB, for one image of height x width (true CFG when `cfg`).
    `table_bytes`: what the modulation table holds on the device; `ring`: the block streamer's slots;
    `graphs`: CUDA graphs capture the streamed forwards (their pool stays held through encode and decode).
    Raises `TooSmall` (saying the least
    budget that works) when even streaming every block does not fit."""
    if not vram_gib > 0:
        raise ValueError(f"vram_gib is GiB of GPU memory (> 0), got {vram_gib!r}")
    fmt = weights_for(card, weights)
    s = sizes if fmt == "bf16" or eight_bit_sizes else eight_bit(sizes)
    pl = MemoryPlanner(s, calib, ring=ring)
    budget = int(MARGIN * vram_gib * GiB) - table_bytes
    kw: dict[str, Any] = dict(cfg=cfg, dtype=dtype)  # the activations' dtype
    notes: list[str] = []
    offload, n, te = "blocks", 0, 0
    for mode in ("none", "model"):
        if pl.predict(height, width, 1, offload=mode, **kw).peak <= budget:
            offload, n, te = mode, s.num_blocks, s.te_blocks if mode == "none" else 0
            break
    else:
        kw.update(modulation_on_host=True, graph_pool=graphs)
        floor = pl.predict(height, width, 1, offload="blocks", tile=256, **kw).peak
        if floor > budget:
            need = (floor + table_bytes) / MARGIN / GiB
            raise TooSmall(
                f"{vram_gib:g} GiB is too little for this model in {fmt} at {height}x{width} even with every "
                f"transformer block streaming: it needs about {need:.3g} GiB"
                + (
                    ""
                    if fmt != "bf16"
                    else "; 8-bit weights halve the blocks (weights='auto' / --weights auto)"
                )
            )
        n = pl.resident_blocks(budget, height, width, 1, **kw)
        if n == s.num_blocks:
            te = pl.te_resident_layers(budget, height, width, 1, resident_blocks=n, **kw)
    kw.pop("modulation_on_host", None)
    kw.pop("graph_pool", None)
    pkw = dict(
        kw,
        offload=offload,
        resident_blocks=n if offload == "blocks" else 0,
        te_resident_layers=te if offload != "none" else 0,
        modulation_on_host=offload == "blocks",
        graph_pool=graphs and offload == "blocks",
    )
    pred = pl.predict(height, width, 1, **pkw)
    tiled = pred.phases["decode"] + pl.calib.overhead > budget
    if tiled:
        pred = pl.predict(height, width, 1, tile=256, **pkw)
        notes.append(
            "the VAE decodes in 256-pixel tiles (diffusers' tiling: seams blended, not bitwise untiled)"
        )
    if offload == "blocks" and n < s.num_blocks:
        notes.append(
            "blocks stream: the transformer runs without the step cache"
            + ("; CUDA graphs hold each forward's block copies" if graphs else ", eagerly")
        )
    streamed = s.num_blocks - n if offload == "blocks" else 0
    per_block = s.transformer_block - s.block_modulation  # the modulation Linears stay on the host
    # the streamer gives block k of the stream ring slot k % ring: a slot shared by several blocks reloads
    # each of them every step; a slot of one block loads it once and keeps it
    per_slot = [len(range(j, streamed, ring)) for j in range(min(ring, streamed))]
    per_step = sum(c for c in per_slot if c > 1) * per_block
    once = sum(c for c in per_slot if c == 1) * per_block
    te_streamed = (s.te_blocks - te) * s.te_block + pl.text_encoder_moved_in() if offload != "none" else 0
    return VramPlan(
        vram_gib=float(vram_gib),
        weights=fmt,
        offload=offload,
        resident_blocks=n,
        num_blocks=s.num_blocks,
        te_resident_layers=te,
        te_layers=s.te_blocks,
        vae_tiled=tiled,
        peak_gib=round((pred.peak + table_bytes) / GiB, 2),
        phases_gib={k: round(v / GiB, 2) for k, v in pred.phases.items()},
        step_bytes=int(per_step),
        prompt_bytes=int(te_streamed),
        once_bytes=int(once),
        schedule_bytes=s.num_blocks * s.block_modulation if offload == "blocks" else 0,
        height=height,
        width=width,
        notes=tuple(notes),
    )
