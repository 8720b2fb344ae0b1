"""Register spills of a Triton kernel compiled for a GPU it does not need: Triton builds the PTX for a target
(sm_90a here) on the CPU and the ptxas its wheel ships reports the machine code's spills.

Why: a kernel whose registers spill moves its spilled values through local memory (L1, then L2) on every
use, which a tile sweep on the GPU cannot tell from plain memory traffic: the per-row LoRA expand spilled
~3.4 KB per thread at its chosen tiles, and at every other tile compiled to check (its y tile addressed
through a (BM, BN) tile of 64-bit pointers kept live across the products). A test can assert a kernel's
chosen tiles compile without spills, on any machine with the triton wheel."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

__all__ = ["spills"]


def spills(
    fn,
    signature: dict[str, str],
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    arch: int = 90,
    maxnreg: int | None = None,
) -> dict[str, int]:
    """{"stores", "loads", "registers"} of `fn` (a @triton.jit function) compiled for sm_`arch`: `signature`
    maps every argument to its Triton type ("*bf16", "i32", ...; "constexpr" for those in `constexprs`);
    `maxnreg`: the launch's register cap per thread, if any (the PTX carries it to ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, signature, constexprs=constexprs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        err = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", err, re.S)
    if m is None:
        raise RuntimeError(f"ptxas -v said nothing of spills: {err[-300:]}")
    return {"stores": int(m[1]), "loads": int(m[2]), "registers": int(m[3])}
