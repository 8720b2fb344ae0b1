"""`EngineOptions`: every speed switch of a pipeline in one frozen object.

Why one object: the switches interact (FP8 needs weights resident, `blocks` offload re-points
weights so no CUDA graph can be captured, a step cache needs a graph per step variant), and a
pipeline whose switches are scattered over attributes that any layer may set cannot check them.
So: options are given once (`from_pretrained(..., options=EngineOptions(...))` or keyword
shortcuts), read through `pipe.options`, and changed only through `pipe.configure(**changes)`,
which validates the new combination and rebuilds what depends on it.

Environment variables only provide defaults (`EngineOptions.from_env()`): `QWENFAST_KERNELS`,
`QWENFAST_ATTENTION`, `QWENFAST_CUDA_GRAPHS` (0/1), `QWENFAST_OFFLOAD`.

This module imports nothing from qwenfast but `errors`: every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigureError, OptionsError

__all__ = ["EngineOptions", "KERNELS", "ATTENTION", "OFFLOAD", "OOM", "BATCHED_CFG"]

KERNELS = ("auto", "triton", "torch")  # qwenfast.kernels.BACKENDS
ATTENTION = ("auto", "cudnn", "flash", "efficient", "math", "fa3", "fp8")  # qwenfast.runtime.attention.CHOICES
OFFLOAD = ("none", "model", "blocks")
OOM = ("backoff", "raise")
BATCHED_CFG = (True, False, "auto")
_ORDER = {m: i for i, m in enumerate(OFFLOAD)}


@dataclass(frozen=True)
class EngineOptions:
    """How a pipeline runs; never what it computes (same images up to rounding), except `fp8`.

    kernels: fused-op backend for this pipeline's calls: "triton", "torch" (the references), "auto"
      (Triton on CUDA when it imports); None = the process-wide switch (`qwenfast.kernels`).
    fused: the transformer's fused block path (False: the plain reference blocks, op for op diffusers).
    attention: joint-attention backend for this pipeline's calls ("auto": cuDNN first on CUDA; "fp8":
      8-bit attention, lossy; see runtime/attention.py); None = the process-wide switch.
    cuda_graphs: replay the transformer forward and the text encode as CUDA graphs (CUDA only).
    batched_cfg: cond and uncond in one batch-2 forward; "auto" only when no padding mask is needed.
    fp8: the transformer blocks' big Linears as FP8 e4m3 GEMMs (not bitwise diffusers; one-way).
    offload: "none" | "model" (text encoder in host memory, streamed while encoding) | "blocks"
      (also the transformer blocks streamed; no CUDA graphs). Goes only none -> model -> blocks.
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
    modulation_cache: how many timesteps' modulation vectors the modulation table keeps
      (runtime/modulation.py; 4.4 MB each at full size); 0 = compute them in every forward. With
      `offload="blocks"` the table lets the modulation weights (half of each FP8 block) stay in host memory.
    """

    kernels: str | None = None
    fused: bool = True
    attention: str | None = None
    cuda_graphs: bool = True
    batched_cfg: bool | str = "auto"
    fp8: bool = False
    offload: str = "none"
    offload_budget: float | None = None
    oom: str = "backoff"
    decode_per_image: bool = False
    cache: Any = None
    parallel: Any = None
    modulation_cache: int = 64

    def __post_init__(self):
        _choice("kernels", self.kernels, (None, *KERNELS))
        _choice("attention", self.attention, (None, *ATTENTION))
        _choice("offload", self.offload, OFFLOAD)
        _choice("oom", self.oom, OOM)
        if self.batched_cfg not in BATCHED_CFG or not isinstance(self.batched_cfg, (bool, str)):
            raise OptionsError(f"batched_cfg must be True, False or 'auto', got {self.batched_cfg!r}")
        for name in ("fused", "cuda_graphs", "fp8", "decode_per_image"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be True or False, got {getattr(self, name)!r}")
        from .runtime.cache import resolve_policy

        try:
            resolve_policy(self.cache)
        except ValueError as e:
            raise OptionsError(str(e)) from None
        if self.offload == "blocks" and resolve_policy(self.cache) is not None:
            raise OptionsError("the step cache does not run with offload='blocks' yet (both own the block loop)")
        if self.parallel is not None:
            from .runtime.parallel import ParallelConfig

            if isinstance(self.parallel, str):
                try:
                    object.__setattr__(self, "parallel", ParallelConfig.parse(self.parallel))
                except ValueError as e:
                    raise OptionsError(str(e)) from None
            if not isinstance(self.parallel, ParallelConfig):
                raise OptionsError(f"parallel must be a ParallelConfig or 'cfg=2,ulysses=2', got {self.parallel!r}")
            if self.parallel.world > 1 and self.offload != "none":
                raise OptionsError("parallel layouts need every weight resident (offload='none')")
        if isinstance(self.modulation_cache, bool) or not isinstance(self.modulation_cache, int) \
                or self.modulation_cache < 0:  # fmt: skip
            raise OptionsError(f"modulation_cache is a number of timesteps (>= 0), got {self.modulation_cache!r}")
        if self.offload_budget is not None and (isinstance(self.offload_budget, bool) or not isinstance(
                self.offload_budget, (int, float)) or not self.offload_budget > 0):  # fmt: skip
            raise OptionsError(f"offload_budget is GiB of GPU memory (> 0), got {self.offload_budget!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineOptions:
        """Defaults from the environment, then `overrides` (None values are ignored)."""
        env: dict[str, Any] = {}
        for name, var in (("kernels", "QWENFAST_KERNELS"), ("attention", "QWENFAST_ATTENTION"),
                          ("offload", "QWENFAST_OFFLOAD")):  # fmt: skip
            if os.environ.get(var):
                env[name] = os.environ[var].strip().lower()
        if os.environ.get("QWENFAST_CUDA_GRAPHS"):
            env["cuda_graphs"] = os.environ["QWENFAST_CUDA_GRAPHS"].strip().lower() not in ("0", "false", "no", "off")
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
        raise ConfigureError("FP8 cannot be turned off on a loaded pipeline (the bf16 weights are gone): "
                           "load the model again without fp8")  # fmt: skip
    if _ORDER[new.offload] < _ORDER[old.offload]:
        raise ConfigureError(f"offload is already {old.offload!r}; load the model again to use {new.offload!r}")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise OptionsError(f"{name} must be one of {allowed}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Command line: ONE argument group for `generate`, `edit` and `serve` (argparse only; no torch)


def positive_int(s: str) -> int:
    """argparse type: a whole number >= 1, with a message that says what was wrong."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_engine_arguments(parser: argparse.ArgumentParser, *, cuda_graphs_default: bool | None = None) -> None:
    """--device --dtype --offload --fp8 --cuda-graphs/--no-cuda-graphs --kernels --attention --preset.

    `cuda_graphs_default`: None = the options' default (on; $QWENFAST_CUDA_GRAPHS); the server passes
    False (every new prompt length or batch size would be a new capture).
    """
    from .config import PRESETS, TURBO_SIGMAS
    from .runtime.cache import PRESETS as CACHE_PRESETS

    g = parser.add_argument_group("engine (how it runs: the same switches for generate, edit and serve)")
    g.add_argument("--device", default=None, help="cuda | cpu | cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--offload", choices=list(OFFLOAD), default=None,
                   help="smaller GPUs: model = text encoder on the GPU only while encoding; blocks = also stream "
                        "the transformer blocks that do not fit --offload-budget from host memory")  # fmt: skip
    g.add_argument("--offload-budget", type=float, default=None, metavar="GIB",
                   help="with --offload blocks: GPU memory to plan for; blocks that fit stay resident, the rest "
                        "stream (default: the free GPU memory)")  # fmt: skip
    g.add_argument("--fp8", action="store_true",
                   help="FP8 e4m3 GEMMs in the transformer blocks (Hopper/Ada GPUs): faster, not bitwise diffusers")
    g.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=cuda_graphs_default,
                   help="replay the transformer as CUDA graphs" + (" (default: on)" if cuda_graphs_default is None
                                                                    else " (default: off for the server)"))  # fmt: skip
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run eagerly")
    g.add_argument("--kernels", choices=list(KERNELS), default=None,
                   help="fused-op backend (default: $QWENFAST_KERNELS or auto)")
    g.add_argument("--attention", choices=list(ATTENTION), default=None,
                   help="attention backend (default: $QWENFAST_ATTENTION or auto; fp8: 8-bit, lossy)")
    g.add_argument("--cache", choices=["off", *CACHE_PRESETS], default=None,
                   help="step cache: skip the middle blocks on some steps (lossy; README 'Step caching' has the "
                        "measured quality; default off)")  # fmt: skip
    g.add_argument("--parallel", default=None, metavar="LAYOUT",
                   help="several GPUs for one image: 'cfg=2', 'ulysses=2', 'cfg=2,ulysses=2' (one process per GPU, "
                        "started for you; --device cpu: CPU processes over gloo)")  # fmt: skip
    g.add_argument("--preset", choices=list(dict.fromkeys([*PRESETS, *TURBO_SIGMAS])), default=None,
                   help="sampling recipe for distilled LoRAs (steps, cfg, scheduler shift; Qwen-Image-2.1: turbo-8 "
                        "and turbo-4 sigma schedules); --steps/--cfg still win")  # fmt: skip


def engine_options_from_args(a: argparse.Namespace, **extra: Any) -> EngineOptions:
    """EngineOptions from `add_engine_arguments`' flags over the environment's defaults. `--fp8` is an
    option of the load: the transformer streams in as FP8 (LoRAs then run beside the FP8 GEMMs)."""
    if getattr(a, "fp8", False):
        extra.setdefault("fp8", True)
    if getattr(a, "offload_budget", None) is not None:
        extra.setdefault("offload_budget", a.offload_budget)
    return EngineOptions.from_env(offload=a.offload, cuda_graphs=a.cuda_graphs, kernels=a.kernels,
                                  attention=a.attention, cache=getattr(a, "cache", None),
                                  parallel=getattr(a, "parallel", None), **extra)  # fmt: skip
