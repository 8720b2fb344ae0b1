"""Which optional GPU attention engines must run (not skip) on the machine a test runs on.

The FP8-attention and attention-backend tests exist for engines that are optional packages. On the only
hardware that runs those tests, "the engine did not load" must not turn a regression (a broken wheel, a
build for another torch, an import path renamed) into a skip. Rule, per engine:

| engine | must run on | when this package is installed (its module found) |
| --- | --- | --- |
| `fa3` (FP8 attention, and FA3's bf16 forward behind `auto` / `fa3`) | compute capability 9.x (Hopper: H100, H200) | `fa3-fwd` (`fa3_fwd_interface`) or flash-attn's hopper build (`flash_attn_interface`) |
| `cudnn` (FP8 attention) | compute capability 9.x | `nvidia-cudnn-frontend` (`cudnn`) |

"Installed" is whether the module can be found (`importlib.util.find_spec`), not whether it imports:
a package that is there but fails to import is exactly what must fail. Everywhere else (no GPU, another
architecture: FA3 ships Hopper kernels only, and the FP8 engines are measured on Hopper only; or the
package absent) the tests may skip, saying why. `must_run` is a pure function of (engine, capability,
installed), unit-tested on CPU in test_attention_backends.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

MODULES = {
    "fa3": ("fa3_fwd_interface", "flash_attn_interface"),
    "cudnn": ("cudnn",),
}


def installed(module: str) -> bool:
    """Whether `module` can be found on this machine (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def must_run(engine: str, capability: tuple[int, int] | None,
             is_installed: Callable[[str], bool] = installed) -> str | None:  # fmt: skip
    """Why `engine` must load and run here (a reason to fail with), or None where a skip is allowed.
    `capability`: the GPU's (major, minor), None without CUDA."""
    if engine not in MODULES:
        raise ValueError(f"unknown engine {engine!r}; one of {sorted(MODULES)}")
    if capability is None or capability[0] != 9:
        return None
    found = [m for m in MODULES[engine] if is_installed(m)]
    if not found:
        return None
    return f"sm_{capability[0]}{capability[1]} with {', '.join(found)} installed"


def cuda_capability() -> tuple[int, int] | None:
    """The GPU's compute capability as qwenfast's arch table answers for it: QWENFAST_ARCH's row when set (an
    H100 playing an sm_86 card must not be required to run Hopper-only engines), else the GPU's own."""
    import torch

    if not torch.cuda.is_available():
        return None
    from qwenfast.runtime.arch import arch

    return arch(torch.device("cuda")).capability
