"""Run a test file's Triton-interpreter cases in a child process (TRITON_INTERPRET must be set before
triton is imported, so the interpreter cases of a file cannot run in the parent pytest process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["run_interpreter_cases"]


def run_interpreter_cases(test_file: str | Path, at_least: int, timeout: int = 900) -> int:
    """Run `test_file -k "interp and not subprocess"` with TRITON_INTERPRET=1 and the Triton backend;
    raise AssertionError (with the output's tail) unless it passes at least `at_least` cases and
    nothing failed, errored or was skipped. Returns the number passed."""
    test_file = Path(test_file).resolve()
    env = dict(os.environ, TRITON_INTERPRET="1", QWENFAST_KERNELS="triton")
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
           "-k", "interp and not subprocess"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=test_file.parents[1], env=env, capture_output=True, text=True, timeout=timeout)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least, tail
    assert not re.search(r"\d+ (failed|error|errors|skipped)\b", proc.stdout), tail
    return int(passed.group(1))
