"""What each GPU architecture can run, and what runs fastest there: the one table every dispatch reads.

Why one table: whether FlashAttention-3 runs (its kernels are built for sm_90 only), whether FP8 GEMMs
or FP8 attention run (FP8 tensor cores from sm_89; FA3's FP8 attention on sm_90, cuDNN's on sm_90 and
sm_100), and which
GEMM precision is fastest (GeForce Ampere/Ada run bf16 and FP8 with fp32 accumulation at half rate but
INT8 at full rate) were answered by capability checks scattered over the kernels and the attention
backends. Here they are rows of one table, so `qwenfast doctor` can print what a card gets and a test
can ask every dispatch site the same question for every architecture.

`QWENFAST_ARCH` = sm_80 | sm_86 | sm_89 | sm_90 | sm_100 | sm_120 (read at each lookup) makes the table
answer as that architecture would, whatever GPU is present (or none): a Hopper machine, or a CPU test,
exercises another card's choices, and nothing the named row forbids is called. It changes decisions
only; a kernel the real GPU cannot run still fails there (use it to test dispatch, not to run).

Rates are dense spec-sheet figures of one representative card per architecture (TFLOP/s, or TOP/s for
INT8), with fp32 accumulation where a card has two rates; they are what the docs' estimates use, never
measurements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch

ENV_VAR = "QWENFAST_ARCH"


@dataclass(frozen=True)
class Arch:
    """One architecture's row. Booleans say what qwenfast may call there."""

    name: str  # "sm_90"
    family: str  # "Hopper"
    card: str  # the representative card of `rates`
    fp8_gemm: bool  # FP8 (e4m3) tensor-core GEMMs (`torch._scaled_mm`)
    int8_gemm: bool  # INT8 tensor-core GEMMs (int32 accumulation)
    fa3: bool  # FlashAttention-3 kernels (built for sm_90 only)
    fp8_attention: (
        bool  # FP8 attention kernels: cuDNN's FP8 SDPA (sm_90, sm_100), FA3's FP8 forward (where fa3)
    )
    cuda_graphs: bool = True
    triton: bool = True  # qwenfast's Triton kernels (written with tl.dot, no Hopper-only instructions)
    rates: dict[str, float] = field(default_factory=dict)  # precision -> dense spec rate of `card`

    @property
    def capability(self) -> tuple[int, int]:
        digits = self.name.removeprefix("sm_")
        return int(digits[:-1]), int(digits[-1])

    @property
    def fastest_gemm(self) -> str:
        """The GEMM precision with the highest spec rate here (ties: the more accurate, listed first)."""
        return max(self.rates, key=lambda p: self.rates[p])

    @property
    def attention(self) -> str:
        """The default exact attention here (runtime/attention.py "auto")."""
        return "FA3 where installed, else cuDNN SDPA" if self.fa3 else "cuDNN SDPA"


# fmt: off
ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("sm_80", "Ampere (data centre)", "A100 SXM", fp8_gemm=False, int8_gemm=True, fa3=False,
         fp8_attention=False, rates={"bf16": 312, "int8": 624}),
    Arch("sm_86", "Ampere (GeForce / workstation)", "RTX 3090", fp8_gemm=False, int8_gemm=True, fa3=False,
         fp8_attention=False, rates={"bf16": 35.6, "int8": 284}),
    Arch("sm_89", "Ada", "RTX 4090", fp8_gemm=True, int8_gemm=True, fa3=False, fp8_attention=False,
         rates={"bf16": 165.2, "fp8": 330.3, "int8": 660.6}),
    Arch("sm_90", "Hopper", "H100 SXM", fp8_gemm=True, int8_gemm=True, fa3=True, fp8_attention=True,
         rates={"bf16": 989, "fp8": 1979, "int8": 1979}),
    Arch("sm_100", "Blackwell (data centre)", "B200", fp8_gemm=True, int8_gemm=True, fa3=False,
         fp8_attention=True, rates={"bf16": 2250, "fp8": 4500, "int8": 4500}),  # cuDNN's FP8 SDPA (not FA3's)
    Arch("sm_120", "Blackwell (GeForce)", "RTX 5090", fp8_gemm=True, int8_gemm=True, fa3=False,
         fp8_attention=False, rates={"bf16": 209.5, "fp8": 419, "int8": 838}),
)}
# fmt: on
NONE = Arch(
    "none",
    "no CUDA GPU",
    "-",
    fp8_gemm=False,
    int8_gemm=False,
    fa3=False,
    fp8_attention=False,
    cuda_graphs=False,
    triton=False,
)  # fmt: skip


def forced() -> str | None:
    """The architecture `QWENFAST_ARCH` names, or None; an unknown name is an error that lists the rows."""
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name:
        return None
    if name.isdigit():  # "90" -> "sm_90"
        name = f"sm_{name}"
    if name not in ARCHS:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: choose one of {', '.join(ARCHS)}")
    return name


def of_capability(major: int, minor: int) -> Arch:
    """The row for a compute capability: the exact one, else the newest row of the same major version at
    or below it (sm_87 -> sm_86), else the newest row below it; NONE below sm_80 (not supported)."""
    name = f"sm_{major}{minor}"
    if name in ARCHS:
        return ARCHS[name]
    below = [a for a in ARCHS.values() if a.capability <= (major, minor)]
    return below[-1] if below else NONE


@lru_cache(maxsize=16)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def arch(device: torch.device | str | None = None) -> Arch:
    """The row that governs `device` (default: the current CUDA device): `QWENFAST_ARCH`'s when set (CPU
    devices included: that is how tests ask), else the GPU's own; NONE for a CPU device."""
    name = forced()
    if name is not None:
        return ARCHS[name]
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return NONE
    if not torch.cuda.is_available():
        return NONE
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return of_capability(*_device_capability(index))


def table_lines(present: Arch | None = None) -> list[str]:
    """The table as text lines (`qwenfast doctor`): one line per architecture, the present one marked."""
    lines = [
        f"{'':2}{'arch':7}{'family':32}{'FP8 GEMM':9}{'INT8 GEMM':10}{'FA3':4}{'FP8 attn':9}"
        f"{'fastest GEMM (spec, card)':30}"
    ]
    for a in ARCHS.values():
        yes = {True: "yes", False: "no"}
        mark = "->" if present is not None and present.name == a.name else ""
        rate = f"{a.fastest_gemm} {a.rates[a.fastest_gemm]:g} ({a.card})"
        lines.append(
            f"{mark:2}{a.name:7}{a.family:32}{yes[a.fp8_gemm]:9}{yes[a.int8_gemm]:10}{yes[a.fa3]:4}"
            f"{yes[a.fp8_attention]:9}{rate}"
        )
    return lines
