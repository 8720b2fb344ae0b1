"""Run a test file's Triton-interpreter cases in a child process (TRITON_INTERPRET must be set before
triton is imported, so the interpreter cases of a file cannot run in the parent pytest process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["run_interpreter_cases", "kernel_devices", "pinned_triton"]

# the test extra's Triton (pyproject.toml). Triton 3.6's interpreter cannot run a kernel whose loop bound is
# a runtime argument (`for k in range(0, K, BLOCK)`: it calls int() on a 1-element NumPy array, which NumPy
# refuses), so the interpreter cases of several files (test_fp8_fused, test_attn_int8) fail under it; its
# compiled kernels on a GPU are unaffected.
PINNED_TRITON = (3, 7)


def pinned_triton() -> bool:
    """Is the installed Triton at least the test extra's (what the interpreter cases are checked on)?
    False without Triton."""
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= PINNED_TRITON


def run_interpreter_cases(
    test_file: str | Path,
    at_least: int,
    *,
    exactly: bool = False,
    timeout: int = 900,
    select: str = "interp and not subprocess",
    allow_skipped: bool = False,
) -> int:
    """Run `test_file -k select` with TRITON_INTERPRET=1 and the Triton backend; raise AssertionError
    (with the output's tail) unless it passes at least `at_least` cases (exactly that many with
    `exactly`) and nothing failed or errored (or was skipped, unless `allow_skipped`). Returns the
    number passed. Skips (a GPU machine's own Triton; CI installs the test extra's) under a Triton older
    than the test extra's, whose interpreter fails some kernels (`PINNED_TRITON`)."""
    import pytest

    from .. import kernels as K

    if K.triton_available() and not pinned_triton():
        pytest.skip(
            "Triton older than the test extra's 3.7.1, whose interpreter the cases are checked on (3.6's fails some)"
        )
    test_file = Path(test_file).resolve()
    env = dict(os.environ, TRITON_INTERPRET="1", QWENFAST_KERNELS="triton")
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-k", select]
    proc = subprocess.run(
        cmd, cwd=test_file.parents[1], env=env, capture_output=True, text=True, timeout=timeout
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    n = int(passed.group(1)) if passed else 0
    assert (n == at_least) if exactly else (n >= at_least), tail
    bad = "failed|error|errors" + ("" if allow_skipped else "|skipped")
    assert not re.search(rf"\d+ ({bad})\b", proc.stdout), tail
    return int(passed.group(1))


def kernel_devices(cuda_ok: bool | None = None, cuda_reason: str = "needs CUDA and triton") -> list:
    """The pytest params of where a Triton kernel under test runs: "cuda" (marked gpu; skipped
    unless `cuda_ok`, default CUDA + triton, and not interpreting) and "interp" (CPU tensors; only in
    a process started with TRITON_INTERPRET=1, which `run_interpreter_cases` starts)."""
    import pytest
    import torch

    from .. import kernels as K

    interp = K.triton_available() and K.interpreting()
    if cuda_ok is None:
        cuda_ok = torch.cuda.is_available() and K.triton_available()
    return [
        pytest.param(
            "cuda",
            id="cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda_ok or interp, reason=cuda_reason)],
        ),
        pytest.param(
            "interp",
            id="interp",
            marks=pytest.mark.skipif(
                not interp, reason="needs TRITON_INTERPRET=1 (see test_interpreter_subprocess)"
            ),
        ),
    ]
