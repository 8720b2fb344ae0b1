"""Benchmarks behind `qwenfast bench ...`; each prints a table and a final JSON line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def versions() -> dict:
    """GPU name (or "cpu"), torch and triton versions: the header of every benchmark record."""
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_v}


def save_record(record: dict, path: Path) -> None:
    """Append one JSON line to `path` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32; NaN when `got` has a non-finite value (NaN never passes)."""
    got, want = got.float(), want.float()
    if not bool(got.isfinite().all()):
        return float("nan")
    return ((got - want).norm() / want.norm()).item()


def emit(record: dict, name: str, out_dir: Path | str | None) -> None:
    """Print the record as the final JSON line; append it to <out_dir>/<name> only when `out_dir` is
    given (`--results DIR`): a benchmark run from any folder leaves no files behind unless asked to."""
    print(json.dumps(record))
    if out_dir is not None:
        save_record(record, Path(out_dir) / name)


def emit_lines(records: list[dict], path: Path | str | None) -> None:
    """Print each record as a JSON line; append them to the file `path` when given (`--out FILE`)."""
    for r in records:
        print(json.dumps(r))
    if path is not None:
        for r in records:
            save_record(r, Path(path))


def results_dir(value: str | None) -> Path | None:
    """`--results` -> the folder for the JSON records, or None (print only)."""
    return Path(value) if value else None


RESULTS_HELP = "append the JSON record to DIR/<bench>.jsonl (default: only print it)"


def median_ms(fn, warmup: int = 3, iters: int = 10, pause_s: float = 0.0) -> float:
    """Median GPU time of `fn()` in ms over `iters` calls after `warmup` (CUDA events, synchronised per
    call); `pause_s`: idle before each timed call (the GPU's clocks recover from sustained load)."""
    import statistics
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if pause_s:
            time.sleep(pause_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
