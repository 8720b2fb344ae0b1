"""Build SageAttention 2's Hopper kernel on the GPU machine, for the "sage" 8-bit attention engine
(`QWENFAST_FP8_ATTENTION=sage`, runtime/attention_fp8.py). SageAttention has no wheel on PyPI and its
setup.py compiles every architecture's kernels; this builds only the two extensions a Hopper GPU runs —
`_qattn_sm90` (the attention kernel) and `_fused` (its quantisation kernels) — for sm_90a with
torch's JIT builder (ninja, all cores), next to a copy of the Python package in `--target`.

The source is not part of qwenfast: put it in `.sage/` (git-ignored) first, e.g. from a clone of
https://github.com/thu-ml/SageAttention (Apache 2.0):

    git -C SageAttention archive HEAD sageattention csrc | tar -x -C .sage
    python bench/build_sageattention.py [--src .sage] [--target /tmp/site]   # then PYTHONPATH=/tmp/site

Prints the build time and imports the result. One H100 / H200 with nvcc (CUDA >= 12.3); a few minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

CXX = ["-O3", "-std=c++17", "-DENABLE_BF16", "-fopenmp"]
NVCC = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "--use_fast_math", "--threads=8", "-diag-suppress=174", "-DENABLE_BF16",
        "-gencode", "arch=compute_90a,code=sm_90a"]  # fmt: skip
# Upstream launches every kernel on the legacy default stream: under CUDA-graph capture (PyTorch captures
# on a side stream) the launches fail unchecked and a replay reads a stale output. Each launch goes to
# PyTorch's current stream instead (`STREAM`), and an all-zero V channel's scale is floored (upstream
# divides by its amax: NaN), as the Q/K quantisers already do.
STREAM = "at::cuda::getCurrentCUDAStream()"
ZERO_V = (
    "s_amax_val = fmaxf(fabsf(block_max_val), fabsf(block_min_val));",
    "s_amax_val = fmaxf(fmaxf(fabsf(block_max_val), fabsf(block_min_val)), 1e-7f);",
)


def _launch_on_stream(m: re.Match) -> str:
    args = [a.strip() for a in m.group(1).split(",")]
    return "<<<" + ", ".join(args + ["0"] * (3 - len(args)) + [STREAM]) + ">>>"


def patch(csrc: Path, narrow: bool) -> int:
    """Rewrite the copied sources (see STREAM, ZERO_V, NARROW); returns the number of launches moved."""
    moved = 0
    for cu in ("qattn/qk_int_sv_f8_cuda_sm90.cu", "fused/fused.cu"):
        f = csrc / cu
        text, n = re.subn(r"<<<([^<>]*?)>>>", _launch_on_stream, f.read_text())
        text = text.replace(*ZERO_V)
        f.write_text(text)
        moved += n
    with open(csrc / "dispatch_utils.h", "a") as f:
        f.write("\n#include <ATen/cuda/CUDAContext.h>\n" + (NARROW if narrow else ""))
    return moved


# What the "sage" engine calls: head dim 128, not causal, no LSE, bf16 (the kernels' dispatch macros, cut
# to these, instantiate 4 of the upstream 64 kernel variants: the build takes minutes, not a quarter hour)
NARROW = r"""
#undef DISPATCH_HEAD_DIM
#define DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...) \
  if (head_dim == 128) { constexpr int HEAD_DIM = 128; __VA_ARGS__ } \
  else { throw std::invalid_argument("this build has head dim 128 only"); }
#undef DISPATCH_CAUSAL
#define DISPATCH_CAUSAL(is_causal, IS_CAUSAL, ...) \
  if (is_causal == 0) { constexpr bool IS_CAUSAL = false; __VA_ARGS__ } \
  else { throw std::invalid_argument("this build is not causal"); }
#undef DISPATCH_RETURN_LSE
#define DISPATCH_RETURN_LSE(return_lse, RETURN_LSE, ...) \
  if (return_lse == 0) { constexpr bool RETURN_LSE = false; __VA_ARGS__ } \
  else { throw std::invalid_argument("this build returns no LSE"); }
#undef DISPATCH_PYTORCH_DTYPE_TO_CTYPE_FP16
#define DISPATCH_PYTORCH_DTYPE_TO_CTYPE_FP16(pytorch_dtype, c_type, ...) \
  if (pytorch_dtype == at::ScalarType::BFloat16) { using c_type = nv_bfloat16; __VA_ARGS__ } \
  else { TORCH_CHECK(false, "this build takes bf16 only"); }
"""
EXTENSIONS = {  # module -> its sources under csrc/ (SageAttention's setup.py, the sm_90 entries)
    "_qattn_sm90": ["qattn/pybind_sm90.cpp", "qattn/qk_int_sv_f8_cuda_sm90.cu"],
    "_fused": ["fused/pybind.cpp", "fused/fused.cu"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--src", default=".sage", help="SageAttention source: sageattention/ and csrc/ (default .sage)"
    )
    ap.add_argument("--target", default="/tmp/site", help="where the package goes (put it on PYTHONPATH)")
    ap.add_argument("--all-variants", action="store_true", help="every upstream kernel variant (slow build)")
    a = ap.parse_args()
    src, target = Path(a.src).resolve(), Path(a.target)
    if not (src / "sageattention").is_dir() or not (src / "csrc").is_dir():
        print(
            f"error: {src} holds no sageattention/ and csrc/ (see this script's docstring)", file=sys.stderr
        )
        return 2
    import torch
    from torch.utils.cpp_extension import load

    pkg = target / "sageattention"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src / "sageattention", pkg)
    csrc = target / ".csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    shutil.copytree(src / "csrc", csrc)
    print(f"{patch(csrc, not a.all_variants)} kernel launches moved to the current stream", flush=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; building {', '.join(EXTENSIONS)}", flush=True
    )
    t0 = time.perf_counter()
    for name, sources in EXTENSIONS.items():
        t1 = time.perf_counter()
        build = target / f".build_{name}"
        build.mkdir(parents=True, exist_ok=True)
        load(name=name, sources=[str(csrc / s) for s in sources], extra_cflags=CXX,
             extra_cuda_cflags=NVCC, extra_ldflags=["-lcuda"], build_directory=str(build),
             verbose=False, is_python_module=True)  # fmt: skip
        so = next(build.glob(f"{name}*.so"))
        shutil.copy(so, pkg / f"{name}.so")  # imported as sageattention.<name>
        print(f"  {name}: {time.perf_counter() - t1:.0f} s", flush=True)
    print(f"built in {time.perf_counter() - t0:.0f} s into {pkg}", flush=True)
    sys.path.insert(0, str(target))
    import sageattention

    ok = getattr(sageattention.core, "SM90_ENABLED", False)
    print(f"import sageattention: sm_90 kernel {'loaded' if ok else 'MISSING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
