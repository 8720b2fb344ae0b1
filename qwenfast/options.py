"""`EngineOptions`: every speed switch of a pipeline in one frozen object.

Why one object: the switches interact (FP8 quantises before `blocks` offload copies the weights to
host memory, a step cache does not run with streamed blocks and needs a graph per step variant), and a
pipeline whose switches are scattered over attributes that any layer may set cannot check them.
So: options are given once (`from_pretrained(..., options=EngineOptions(...))` or keyword
shortcuts), read through `pipe.options`, and changed only through `pipe.configure(**changes)`,
which validates the new combination and rebuilds what depends on it.

Environment variables only provide defaults (`EngineOptions.from_env()`): `QWENFAST_KERNELS`,
`QWENFAST_ATTENTION`, `QWENFAST_CUDA_GRAPHS` (0/1), `QWENFAST_OFFLOAD`.

The values some options take are defined here too, as plain data: a step-cache policy
(`CachePolicy`, the named `CACHE_PRESETS`) and a multi-GPU layout (`ParallelConfig`). The runtime
implements them (runtime/cache.py, runtime/parallel.py, which re-export these names); what a value
means is checked here, when the options are made, without importing the runtime.

This module imports nothing from qwenfast but `errors`, and only the standard library: every layer
may use it. The command line's argument group for these switches is `qwenfast/engine_args.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigureError, OptionsError

__all__ = [
    "EngineOptions",
    "KERNELS",
    "ATTENTION",
    "OFFLOAD",
    "OOM",
    "BATCHED_CFG",
    "CachePolicy",
    "CACHE_PRESETS",
    "resolve_policy",
    "ParallelConfig",
]

KERNELS = ("auto", "triton", "torch")  # qwenfast.kernels.BACKENDS
ATTENTION = (
    "auto",
    "cudnn",
    "flash",
    "efficient",
    "math",
    "fa3",
    "fp8",
)  # qwenfast.runtime.attention.CHOICES
OFFLOAD = ("none", "model", "blocks")
OOM = ("backoff", "raise")
WEIGHTS = ("bf16", "fp8", "int8", "auto")  # runtime.tiers.WEIGHTS
BATCHED_CFG = (True, False, "auto")
_ORDER = {m: i for i, m in enumerate(OFFLOAD)}


# ---------------------------------------------------------------------------------------------
# Option values: a step-cache policy and a multi-GPU layout (plain data; the runtime runs them)


POLICY_KINDS = ("static", "adaptive")


@dataclass(frozen=True)
class CachePolicy:
    """How a step cache decides which steps run every block (runtime/cache.py says how each kind works)."""

    kind: str = "static"
    first: int = 1  # Fn: blocks always run first (a static policy may take 0: a cached step runs none)
    last: int = 0  # Bn: blocks always run last
    warmup: int = 2  # steps of the warm-up at the start (full, or every `warmup_every`-th full)
    tail: int = 1  # full steps at the end
    every: int = 2  # static: every `every`-th step after the warm-up is full
    threshold: float = 0.1  # adaptive: relative L1 change of the first blocks' residual to skip under
    max_skips: int = 3  # adaptive: at most this many cached steps in a row
    taylor: int = 0  # 0: reuse the residual; 1: extrapolate it linearly from the last two full steps
    name: str = "custom"
    warmup_every: int = 1  # static: every n-th warm-up step is full (cache-dit's warmup_interval)

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"cache kind must be one of {POLICY_KINDS}, got {self.kind!r}")
        if self.first < (1 if self.kind == "adaptive" else 0):  # adaptive: the first blocks are its probe
            raise ValueError(
                f"cache policy: first >= 1 for an adaptive policy, >= 0 for a static one, got {self.first}"
            )
        if self.last < 0 or self.warmup < 1 or self.tail < 0 or self.every < 1:
            raise ValueError("cache policy: last >= 0, warmup >= 1, tail >= 0, every >= 1")
        if self.warmup_every < 1 or (self.kind != "static" and self.warmup_every != 1):
            raise ValueError(
                "cache policy: warmup_every >= 1, and only a static policy takes one other than 1"
            )
        if self.taylor not in (0, 1):
            raise ValueError(f"taylor must be 0 or 1, got {self.taylor}")
        if not (self.threshold >= 0 and math.isfinite(self.threshold)) or self.max_skips < 1:
            raise ValueError("cache policy: threshold must be finite and >= 0, max_skips >= 1")

    def static_full(self, step: int, steps: int) -> bool:
        """Whether a static policy computes every block at `step` of `steps`."""
        if step >= steps - self.tail:
            return True
        if step < self.warmup:
            return step % self.warmup_every == 0
        return (step - self.warmup) % self.every == 0

    def full_fraction(self, steps: int) -> float:
        """Static: the fraction of steps that run every block."""
        return sum(self.static_full(i, steps) for i in range(steps)) / steps


# Named by what they measured on the demo model's held-out suites (50 steps, CFG; docs/quality.md):
# balanced within 1 point of uncached on both suites (38% of the steps computed in full at 50 steps),
# fast within 3 points (30%). Taylor extrapolation measured a higher PSNR than plain reuse at the same
# steps, so both use it. Where the full steps go matters as much as how many: early steps change the
# image most, so balanced spends its warm-up as cache-dit does (8 steps, every 2nd full) and then every
# 3rd: at the same 38% it keeps about 4 dB (text-to-image) and 2.5 dB (edits) more PSNR than 2 full
# warm-up steps and every 3rd after (`qwenfast bench cache-pareto`, docs/quality.md). fast runs no block on
# a cached step (first=0; a static schedule needs no probe block): on the demo (CPU, fp32, same seeds) the
# same scores as with its first block, PSNR vs uncached 0.1 dB (text-to-image) and 0.6 dB (edits) lower,
# while that block is most of a cached step's time on the real model (one block of 60 at batch 2).
CACHE_PRESETS: dict[str, CachePolicy] = {
    "balanced": CachePolicy(
        kind="static", first=1, last=0, warmup=8, warmup_every=2, tail=1, every=3, taylor=1, name="balanced"
    ),
    "fast": CachePolicy(kind="static", first=0, last=0, warmup=2, tail=1, every=4, taylor=1, name="fast"),
}


def resolve_policy(cache: object) -> CachePolicy | None:
    """None / "off" -> None; a preset name -> its policy; a CachePolicy as is."""
    if cache is None or cache == "off":
        return None
    if isinstance(cache, CachePolicy):
        return cache
    if isinstance(cache, str) and cache in CACHE_PRESETS:
        return CACHE_PRESETS[cache]
    raise ValueError(
        f"cache must be None, 'off', one of {sorted(CACHE_PRESETS)} or a CachePolicy, got {cache!r}"
    )


@dataclass(frozen=True)
class ParallelConfig:
    """A multi-GPU layout (runtime/parallel.py runs it). cfg: 1 or 2 (cond / uncond on different ranks);
    ulysses: ranks sharing one sequence."""

    cfg: int = 1
    ulysses: int = 1

    def __post_init__(self):
        if self.cfg not in (1, 2):
            raise ValueError(f"cfg parallel must be 1 or 2, got {self.cfg}")
        if not isinstance(self.ulysses, int) or self.ulysses < 1:
            raise ValueError(f"ulysses must be a whole number >= 1, got {self.ulysses!r}")

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """ "cfg=2,ulysses=2" | "ulysses=4" | "cfg=2" -> ParallelConfig."""
        if not re.fullmatch(r"\s*(cfg|ulysses)\s*=\s*\d+\s*(,\s*(cfg|ulysses)\s*=\s*\d+\s*)?", text or ""):
            raise ValueError(f"--parallel takes e.g. 'cfg=2,ulysses=2', 'ulysses=4' or 'cfg=2', got {text!r}")
        kv = dict((k.strip(), int(v)) for k, v in (p.split("=") for p in text.split(",")))
        return cls(**kv)

    def __str__(self) -> str:
        return f"cfg={self.cfg},ulysses={self.ulysses}"


@dataclass(frozen=True)
class EngineOptions:
    """How a pipeline runs; never what it computes (same images up to rounding), except `fp8`.

    kernels: fused-op backend for this pipeline's calls: "triton", "torch" (the references), "auto"
      (Triton on CUDA when it imports); None = the process-wide switch (`qwenfast.kernels`).
    fused: the transformer's fused block path (False: the plain reference blocks, op for op diffusers).
    attention: joint-attention backend for this pipeline's calls ("auto": cuDNN first on CUDA; "fp8":
      8-bit attention, lossy; see runtime/attention.py); None = the process-wide switch.
    cuda_graphs: replay the transformer forward and the text encode as CUDA graphs (CUDA only).
    graph_slots: how many transformer graphs stay captured (an LRU; one per input shape and block-runner
      variant; they share one memory pool). A server's mixed sizes, batches and prompt lengths hold more
      shapes than the default, and each miss costs a capture (warm-up forwards included).
    text_bucket: pad each prompt's text to a multiple of this many tokens (0: off), so that one captured
      graph serves every prompt of a bucket (a graph's shape holds the text length); the padding costs
      attention nothing where the model takes key lengths (FlashAttention-3: runtime/attention.py's
      `KeyLengths`), else a masked attention. Same images up to rounding. For servers; not with parallel;
      a model that takes no key lengths (Qwen-Image-2.1's) runs its text as it is. "auto" (what
      `qwenfast serve` asks for unless told): 64 with CUDA graphs where the padding is free
      (`runtime.attention.auto_text_bucket`), else 0; `configure` resolves it to that number.
    batched_cfg: cond and uncond in one batch-2 forward; "auto" only when no padding mask is needed.
    fp8: the transformer blocks' big Linears as FP8 e4m3 GEMMs (not bitwise diffusers; one-way).
    int8: the same Linears as INT8 W8A8 GEMMs (kernels/int8_linear.py; the fast precision of Ampere and
      GeForce cards, see runtime/arch.py; lossy, one-way; not with fp8; LoRAs run unmerged as on FP8).
    offload: "none" | "model" (text encoder in host memory, streamed while encoding) | "blocks"
      (also the transformer blocks streamed; graphs hold their copies). Goes only none -> model -> blocks.
    offload_budget: GiB of GPU memory "blocks" may plan for: as many blocks as fit stay resident
      (the memory planner decides for the model's default size) and only the rest stream. None:
      the free GPU memory (respecting `torch.cuda.set_per_process_memory_fraction`); on CPU, all stream.
    oom: "backoff" (split the batch on CUDA OOM, then tile the VAE; per call) | "raise".
    decode_per_image: VAE-decode a batch image by image, so no image depends on its batch-mates
      (the server's default; off: one batched decode, as diffusers).
    cache: the step cache (runtime/cache.py): None / "off", "balanced", "fast" (presets named by the
      quality they measured on the demo model), or a `CachePolicy`. Lossy; off by default.
    parallel: the multi-GPU layout (runtime/parallel.py): None = one device, or a `ParallelConfig` /
      "cfg=2,ulysses=2"; needs torch.distributed with that many processes (`--parallel` starts them).
    weights: the transformer blocks' weight format in one word: "bf16" (the checkpoint's dtype), "fp8",
      "int8" (the same as fp8=True / int8=True), or "auto": this card's fastest 8-bit format
      (runtime/arch.py: FP8 from Ada on, INT8 on Ampere; lossy), chosen when the pipeline loads.
    vram_gib: plan for a card with this much memory (runtime/tiers.py): offload mode and budget, and the
      VAE's tiling follow from the memory planner; the weight format stays `weights` (lossless unless
      asked). None: the free GPU memory, and only when the model would not fit it does a load stream.
    modulation_cache: how many timesteps' modulation vectors the modulation table keeps
      (runtime/modulation.py; 4.4 MB each at full size); 0 = compute them in every forward. With
      `offload="blocks"` the table lets the modulation weights (half of each FP8 block) stay in host memory.
    """

    kernels: str | None = None
    fused: bool = True
    attention: str | None = None
    cuda_graphs: bool = True
    graph_slots: int = 8
    text_bucket: int | str = 0
    batched_cfg: bool | str = "auto"
    fp8: bool = False
    int8: bool = False
    offload: str = "none"
    offload_budget: float | None = None
    oom: str = "backoff"
    decode_per_image: bool = False
    cache: Any = None
    parallel: Any = None
    modulation_cache: int = 64
    weights: str | None = None
    vram_gib: float | None = None

    def __post_init__(self):
        _choice("kernels", self.kernels, (None, *KERNELS))
        _choice("attention", self.attention, (None, *ATTENTION))
        _choice("offload", self.offload, OFFLOAD)
        _choice("oom", self.oom, OOM)
        if self.batched_cfg not in BATCHED_CFG or not isinstance(self.batched_cfg, (bool, str)):
            raise OptionsError(f"batched_cfg must be True, False or 'auto', got {self.batched_cfg!r}")
        for name in ("fused", "cuda_graphs", "fp8", "int8", "decode_per_image"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.weights is not None:
            _choice("weights", self.weights, WEIGHTS)
            said = {"fp8": self.fp8, "int8": self.int8}
            if self.weights in said:
                object.__setattr__(self, self.weights, True)
            elif self.weights == "bf16" and (self.fp8 or self.int8):
                raise OptionsError(f"weights='bf16' with {'fp8' if self.fp8 else 'int8'}=True: choose one")
        if self.fp8 and self.int8:
            raise OptionsError("fp8 and int8 are two 8-bit weight formats for the same layers: choose one")
        if self.vram_gib is not None and (
            isinstance(self.vram_gib, bool)
            or not isinstance(self.vram_gib, (int, float))
            or not self.vram_gib > 0
        ):
            raise OptionsError(f"vram_gib is GiB of GPU memory (> 0), got {self.vram_gib!r}")
        try:
            policy = resolve_policy(self.cache)
        except ValueError as e:
            raise OptionsError(str(e)) from None
        if self.offload == "blocks" and policy is not None:
            raise OptionsError(
                "the step cache does not run with offload='blocks' yet (both own the block loop)"
            )
        if self.parallel is not None:
            if isinstance(self.parallel, str):
                try:
                    object.__setattr__(self, "parallel", ParallelConfig.parse(self.parallel))
                except ValueError as e:
                    raise OptionsError(str(e)) from None
            if not isinstance(self.parallel, ParallelConfig):
                raise OptionsError(
                    f"parallel must be a ParallelConfig or 'cfg=2,ulysses=2', got {self.parallel!r}"
                )
            if self.parallel.world > 1 and self.offload != "none":
                raise OptionsError("parallel layouts need every weight resident (offload='none')")
        if (
            isinstance(self.graph_slots, bool)
            or not isinstance(self.graph_slots, int)
            or self.graph_slots < 1
        ):
            raise OptionsError(f"graph_slots is a number of graphs (>= 1), got {self.graph_slots!r}")
        if self.text_bucket != "auto" and (
            isinstance(self.text_bucket, bool)
            or not isinstance(self.text_bucket, int)
            or self.text_bucket < 0
        ):
            raise OptionsError(
                f'text_bucket is a number of tokens (0: off) or "auto", got {self.text_bucket!r}'
            )
        if self.text_bucket not in (0, "auto") and self.parallel is not None:
            raise OptionsError("text_bucket does not run with parallel layouts yet")
        if (
            isinstance(self.modulation_cache, bool)
            or not isinstance(self.modulation_cache, int)
            or self.modulation_cache < 0
        ):
            raise OptionsError(
                f"modulation_cache is a number of timesteps (>= 0), got {self.modulation_cache!r}"
            )
        if self.offload_budget is not None and (
            isinstance(self.offload_budget, bool)
            or not isinstance(self.offload_budget, (int, float))
            or not self.offload_budget > 0
        ):
            raise OptionsError(f"offload_budget is GiB of GPU memory (> 0), got {self.offload_budget!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineOptions:
        """Defaults from the environment, then `overrides` (None values are ignored)."""
        env: dict[str, Any] = {}
        for name, var in (
            ("kernels", "QWENFAST_KERNELS"),
            ("attention", "QWENFAST_ATTENTION"),
            ("offload", "QWENFAST_OFFLOAD"),
        ):
            if os.environ.get(var):
                env[name] = os.environ[var].strip().lower()
        if os.environ.get("QWENFAST_CUDA_GRAPHS"):
            env["cuda_graphs"] = os.environ["QWENFAST_CUDA_GRAPHS"].strip().lower() not in (
                "0",
                "false",
                "no",
                "off",
            )
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with `changes` (validated); unknown names are refused by name."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise OptionsError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def changed(self, other: EngineOptions) -> set[str]:
        """Names of the fields that differ from `other`."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)}


def check_transition(old: EngineOptions, new: EngineOptions) -> None:
    """Refuse changes a loaded pipeline cannot make, saying what to do instead."""
    if old.fp8 and not new.fp8:
        raise ConfigureError(
            "FP8 cannot be turned off on a loaded pipeline (the bf16 weights are gone): "
            "load the model again without fp8"
        )
    if old.int8 and not new.int8:
        raise ConfigureError(
            "INT8 cannot be turned off on a loaded pipeline (the bf16 weights are gone): "
            "load the model again without int8"
        )
    if _ORDER[new.offload] < _ORDER[old.offload]:
        raise ConfigureError(
            f"offload is already {old.offload!r}; load the model again to use {new.offload!r}"
        )


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise OptionsError(f"{name} must be one of {allowed}, got {value!r}")
