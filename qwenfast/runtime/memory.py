"""Memory planner: predicts the peak GPU memory of a generation and picks the largest batch that fits.

Why a model and not trial and error: an OOM in the middle of a 50-step batch wastes the steps already
run (see `runtime/oom.py` for the back-off that handles it anyway). The peak is the largest of three
phases, each = the weights resident on the device in that phase + the phase's activations:

- encode:  resident weights (+ the text encoder when it is offloaded and moved in only now)
           + text-encoder activations (small: prompts are short);
- denoise: resident weights + transformer activations, linear in (batch x CFG) x tokens x dim;
- decode:  resident weights + VAE activations, linear in batch x output pixels x base channels
           (+ a term quadratic in latent tokens for the mid-block attention, zero when SDPA uses a
           memory-efficient kernel), or the same for one tile when tiled.

Weights come from the real modules (`ModelSizes.from_pipeline`) or from configs. Activation
coefficients are in `Calibration`; the defaults are estimates from tensor counts, and
`STAGE=memory bash bench/pipeline.sh` fits them on a GPU (`qwenfast bench pipeline --memory`) and writes
`memory_calibration.json`, which `Calibration.load()` reads when it sits next to this file.
All sizes are bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..config import VAEConfig

__all__ = [
    "Calibration",
    "ModelSizes",
    "MemoryPlanner",
    "Prediction",
    "default_budget",
    "graph_pools",
    "vae_activation_bytes",
]

OFFLOAD_MODES = ("none", "model", "blocks")
CALIBRATION_FILE = Path(__file__).with_name("memory_calibration.json")
GiB = 1024**3


@dataclass(frozen=True)
class Calibration:
    """Activation coefficients (dimensionless unless named)."""

    transformer: float = (
        14.0  # peak live activations of one block, in units of (B_eff * tokens * dim) elements
    )
    vae_decode: float = 6.0  # fast path: decoder peak, units of (B * pixels * base_dim) elements
    vae_decode_ref: float = 9.0  # reference path (materialised 4x upsample)
    vae_encode: float = 5.0
    vae_attention: float = 0.0  # units of (B * latent_tokens^2) elements: mid-block attention scores
    text_encoder: float = 40.0  # units of (prompts * tokens * hidden) elements
    overhead: int = 512 * 1024**2  # CUDA context-independent slack: cuBLAS workspaces, RoPE tables, allocator
    source: str = "default estimates"

    @classmethod
    def load(cls, path: Path | None = None) -> Calibration:
        """The calibration file written by the GPU script if present, else the defaults."""
        p = Path(path) if path is not None else CALIBRATION_FILE
        if not p.is_file():
            return cls()
        d = json.loads(p.read_text())
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs to know about a model set: weight bytes and the shapes that scale activations."""

    transformer: int  # all transformer weights
    transformer_block: int  # the largest block (offload="blocks" keeps a ring of these on the GPU)
    num_blocks: int
    text_encoder: int
    vae: int
    te_block: int = 0  # the largest text-encoder decoder layer (offload streams these through a ring)
    te_blocks: int = 0
    te_vision: int = 0  # the text encoder's vision tower: not moved in for a text-only encode when offloaded
    block_modulation: int = (
        0  # a block's modulation Linears (host memory under offload with a modulation table)
    )
    te_embed: int = (
        0  # the text encoder's token embedding + LM head: left on the host by an offloaded text-only encode
    )
    dim: int = 3072  # transformer inner dim
    te_hidden: int = 3584
    vae_base_dim: int = 96
    vae_scale: int = 8
    patch: int = 2

    @classmethod
    def qwen_image(cls, dtype: torch.dtype = torch.bfloat16) -> ModelSizes:
        """Qwen-Image at full size without loading anything (parameter counts of the released model)."""
        e = torch.empty((), dtype=dtype).element_size()
        block = 339_725_312  # parameters of one of the 60 transformer blocks
        mod = 2 * (3072 * 18432 + 18432)  # img_mod + txt_mod of one block
        te_layer = 233_057_792  # one of Qwen2.5-VL-7B's 28 decoder layers
        return cls(
            transformer=20_430_401_088 * e,
            transformer_block=block * e,
            num_blocks=60,
            text_encoder=8_292_166_656 * e,
            vae=126_892_531 * e,
            te_block=te_layer * e,
            te_blocks=28,
            block_modulation=mod * e,
            te_embed=2 * 152_064 * 3584 * e,
        )

    @classmethod
    def from_pipeline(cls, pipe: Any) -> ModelSizes:  # a qwenfast pipeline, duck-typed (runtime is below it)
        def nbytes(m: torch.nn.Module) -> int:
            return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))

        tr = pipe.transformer
        blocks = list(tr.blocks)  # tr: a runtime.contract.DenoisableTransformer
        te_model = getattr(pipe.text_encoder, "model", pipe.text_encoder)
        te_cfg = getattr(te_model, "config", None)
        te_hidden = getattr(getattr(te_cfg, "text_config", te_cfg), "hidden_size", 3584)
        layers = getattr(pipe.text_encoder, "decoder_layers", None)  # models.text_encoder.TextEncoder
        te_layers = list((layers() if layers is not None else None) or [])
        vision = getattr(getattr(te_model, "model", None), "visual", None) or getattr(
            te_model, "visual", None
        )
        mods = tr.modulation_modules()[:1]  # the first block's (all blocks are alike); none per block: 0
        host_parts = getattr(pipe.text_encoder, "host_parts", None)  # models.text_encoder.TextEncoder
        prefixes = host_parts() if host_parts is not None else ()
        te_embed = sum(
            t.numel() * t.element_size()
            for n, t in te_model.named_parameters()
            if n.startswith(prefixes) and "visual." not in n
        )
        return cls(
            block_modulation=sum(nbytes(m) for ms in mods for m in ms),
            te_embed=te_embed,
            transformer=nbytes(tr),
            transformer_block=max(nbytes(b) for b in blocks),
            num_blocks=len(blocks),
            text_encoder=nbytes(te_model),
            vae=nbytes(pipe.vae),
            dim=tr.cfg.inner_dim,
            te_hidden=te_hidden,
            te_block=max((nbytes(b) for b in te_layers), default=0),
            te_blocks=len(te_layers),
            te_vision=nbytes(vision) if isinstance(vision, torch.nn.Module) else 0,
            vae_base_dim=pipe.vae.cfg.base_dim,
            vae_scale=pipe.vae.cfg.scale_factor,
            patch=tr.cfg.patch_size,
        )


@dataclass
class Prediction:
    peak: int
    phases: dict[str, int] = field(default_factory=dict)  # phase -> predicted bytes at its peak
    resident: int = 0  # weights on the device during denoising

    def gib(self) -> dict[str, float]:
        return {"peak": round(self.peak / GiB, 3), **{k: round(v / GiB, 3) for k, v in self.phases.items()}}


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def vae_activation_bytes(
    vae_cfg: VAEConfig,
    batch: int,
    height: int,
    width: int,
    dtype: torch.dtype,
    *,
    encode: bool,
    fast: bool = True,
    calib: Calibration | None = None,
) -> int:
    """Predicted VAE activation peak for one untiled pass over (batch, height, width) pixels."""
    c = calib or Calibration.load()
    px = batch * height * width
    k = c.vae_encode if encode else (c.vae_decode if fast else c.vae_decode_ref)
    tokens = (height // vae_cfg.scale_factor) * (width // vae_cfg.scale_factor)
    return int(k * px * vae_cfg.base_dim * _elem(dtype) + c.vae_attention * batch * tokens**2 * _elem(dtype))


def default_budget(
    device: torch.device | str | None = None, fraction: float = 0.9, include_allocated: bool = True
) -> int:
    """Bytes this process may plan for: `fraction` of the free GPU memory (+ what torch already holds
    when `include_allocated`, since predictions count the resident weights). Respects
    `torch.cuda.set_per_process_memory_fraction`. CPU: effectively unlimited (2**62)."""
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if dev.type != "cuda":
        return 2**62
    if dev.index is None:  # torch's memory-fraction query wants an index
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        cap = int(torch.cuda.get_per_process_memory_fraction(dev) * total)
        free = min(free + reserved, cap) - reserved  # the allocator's own limit
    # memory the caching allocator holds but does not use is available to us too (not a CUDA graph's pool)
    free += cached_free(dev)
    used = torch.cuda.memory_allocated(dev) if include_allocated else 0
    return int(fraction * max(free, 0)) + used


def graph_pools(device: torch.device) -> tuple[int, int]:
    """(bytes reserved by CUDA graphs' private memory pools, bytes of the default pool cached but unused)
    on `device`, from the caching allocator's segment list. A graph pool's free blocks are kept for its
    graphs' replays: no other allocation can use them (a streamed forward's graph holds ~1 GiB there)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)  # (no allocation history: fast)
    except TypeError:  # an older torch
        segments = torch.cuda.memory_snapshot()
    private = free = 0
    for seg in segments:
        if seg.get("device", idx) != idx:
            continue
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            private += seg["total_size"]
        else:
            free += seg["total_size"] - seg["allocated_size"]
    return private, free


def cached_free(device: torch.device) -> int:
    """Bytes the caching allocator holds unused that a new allocation could take (not graph pools')."""
    try:
        return graph_pools(device)[1]
    except Exception:  # noqa: BLE001 - an allocator without segment lists: every cached byte
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _largest(hi: int, fits: Any) -> int:
    """The largest k in 0..hi with fits(k) (fits is monotone: true up to some k, false after); 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class MemoryPlanner:
    """`MemoryPlanner(ModelSizes.from_pipeline(pipe)).predict(1024, 1024, batch=2, offload="none")`."""

    def __init__(self, sizes: ModelSizes, calib: Calibration | None = None, ring: int = 2):
        self.sizes = sizes
        self.calib = calib or Calibration.load()
        self.ring = ring  # GPU block buffers for offload="blocks"

    @classmethod
    def from_pipeline(cls, pipe: Any, calib: Calibration | None = None) -> MemoryPlanner:
        return cls(ModelSizes.from_pipeline(pipe), calib)

    def with_calibration(self, **kw: Any) -> MemoryPlanner:  # Calibration fields
        return MemoryPlanner(self.sizes, replace(self.calib, **kw), self.ring)

    def resident(
        self,
        offload: str,
        offload_vae: bool = False,
        resident_blocks: int = 0,
        modulation_on_host: bool = False,
        te_resident_layers: int = 0,
    ) -> int:
        """Weights on the GPU while denoising (`resident_blocks`: blocks kept on it under "blocks";
        `modulation_on_host`: their modulation Linears stay in host memory, a modulation table serving
        them; `te_resident_layers`: text-encoder layers that stay on it instead of streaming)."""
        s = self.sizes
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        vae = 0 if offload_vae else s.vae
        if offload == "none":
            return s.transformer + s.text_encoder + vae
        te_ring = min(self.ring, s.te_blocks) * s.te_block  # the text encoder's layer ring stays allocated
        te_ring += min(te_resident_layers, s.te_blocks) * s.te_block
        if offload == "model":
            return s.transformer + vae + te_ring
        rest = s.transformer - s.num_blocks * s.transformer_block  # embeddings, norm_out, proj_out (approx.)
        ring = min(self.ring, s.num_blocks - resident_blocks)
        block = s.transformer_block - (s.block_modulation if modulation_on_host else 0)
        brought = s.block_modulation if modulation_on_host else 0  # one block's, brought in by a table miss
        return max(rest, 0) + (ring + resident_blocks) * block + brought + vae + te_ring

    def text_encoder_moved_in(self) -> int:
        """Text-encoder bytes copied to the GPU for a (text-only) encode when offloaded: its layers
        stream, its vision tower stays on the host."""
        s = self.sizes
        return s.text_encoder - s.te_blocks * s.te_block - s.te_vision - s.te_embed

    def predict(
        self,
        height: int,
        width: int,
        batch: int = 1,
        *,
        cfg: bool = True,
        batched_cfg: bool = True,
        offload: str = "none",
        dtype: torch.dtype = torch.bfloat16,
        txt_len: int = 256,
        decode_batch: int | None = None,
        tile: int | None = None,
        fast_vae: bool = True,
        offload_vae: bool = False,
        resident_blocks: int = 0,
        modulation_on_host: bool = False,
        te_resident_layers: int = 0,
        graph_pool: bool = False,
    ) -> Prediction:
        """Peak bytes of one call generating `batch` images of height x width (pixels). `graph_pool`: the
        denoise activations stay held after the loop (a CUDA graph's private pool, which streamed
        forwards capture: the encode and decode cannot reuse it)."""
        if batch < 1 or height < 1 or width < 1:
            raise ValueError(f"batch, height and width must be >= 1, got {batch}, {height}, {width}")
        s, c, e = self.sizes, self.calib, _elem(dtype)
        res = self.resident(
            offload,
            offload_vae,
            resident_blocks,
            modulation_on_host and offload == "blocks",
            te_resident_layers if offload != "none" else 0,
        )
        # text encoder: moved in for the encode when offloaded; prompts + negatives
        te_in = self.text_encoder_moved_in() if offload in ("model", "blocks") else 0
        prompts = batch * (2 if cfg else 1)
        encode = res + te_in + int(c.text_encoder * prompts * (txt_len + 34) * s.te_hidden * e)
        # denoise: tokens of the packed latents (patch 2 over the /8 latents) + text
        img_tokens = math.ceil(height / (s.vae_scale * s.patch)) * math.ceil(width / (s.vae_scale * s.patch))
        b_eff = batch * (2 if cfg and batched_cfg else 1)
        act = int(c.transformer * b_eff * (img_tokens + txt_len) * s.dim * e)
        denoise = res + act
        pool = act if graph_pool else 0
        # decode (the transformer activations are gone, unless a graph pool holds them; latents are tiny)
        db = decode_batch or batch
        th, tw = (min(tile, height), min(tile, width)) if tile else (height, width)
        k = c.vae_decode if fast_vae else c.vae_decode_ref
        tokens = (th // s.vae_scale) * (tw // s.vae_scale)
        out_img = batch * 3 * height * width * e  # the decoded images (tiling writes into one output)
        dec_in = s.vae if offload_vae else 0
        decode = (
            res
            + dec_in
            + out_img
            + int(k * db * th * tw * s.vae_base_dim * e + c.vae_attention * db * tokens**2 * e)
        )
        phases = {"encode": encode + pool, "denoise": denoise, "decode": decode + pool}
        return Prediction(peak=max(phases.values()) + c.overhead, phases=phases, resident=res)

    def resident_blocks(self, budget: int, height: int, width: int, batch: int = 1, **kw: Any) -> int:
        """How many transformer blocks can stay on the GPU under offload="blocks" while a call of this
        size still fits `budget` bytes (0: stream them all; num_blocks: none needs streaming)."""
        kw["offload"] = "blocks"
        n = self.sizes.num_blocks
        if self.predict(height, width, batch, resident_blocks=n, **kw).peak <= budget:
            return n
        return _largest(
            n, lambda k: self.predict(height, width, batch, resident_blocks=k, **kw).peak <= budget
        )

    def te_resident_layers(self, budget: int, height: int, width: int, batch: int = 1, **kw: Any) -> int:
        """Under offload="blocks" with every transformer block resident (`kw` as for `predict`): how many
        text-encoder layers can stay on the GPU too (they stream for every new prompt otherwise)."""
        kw["offload"] = "blocks"
        return _largest(
            self.sizes.te_blocks,
            lambda k: self.predict(height, width, batch, te_resident_layers=k, **kw).peak <= budget,
        )

    def max_batch(
        self, height: int, width: int, budget: int | None = None, limit: int = 64, **kw: Any
    ) -> int:
        """The largest batch <= limit whose predicted peak fits `budget` (default: `default_budget()`); 0 if none."""
        budget = default_budget() if budget is None else budget
        lo = 0
        for b in range(1, limit + 1):  # peaks grow with b: stop at the first that does not fit
            if self.predict(height, width, b, **kw).peak > budget:
                break
            lo = b
        return lo
