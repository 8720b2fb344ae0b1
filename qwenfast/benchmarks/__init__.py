"""Benchmarks behind `qwenfast bench ...`; each prints a table and a final JSON line.

Every record says where it comes from (`provenance()`): date, commit, GPU, versions, the command that
made it, the engine switches set in the environment and a run id shared by the records of one process.
`qwenfast bench report` renders the published tables from these records (`benchmarks/report.py`).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Environment switches that change what a benchmark measures (recorded with every record). Only these:
# never the whole environment (QWENFAST_API_KEY and the like must not end up in a results file).
ENGINE_ENV = ("QWENFAST_KERNELS", "QWENFAST_ATTENTION", "QWENFAST_CUDA_GRAPHS", "QWENFAST_OFFLOAD",
              "QWENFAST_FP8_ATTENTION", "QWENFAST_FP8_FUSE", "QWENFAST_ULYSSES_EXCHANGE",
              "QWENFAST_ULYSSES_CHUNKS", "PYTORCH_CUDA_ALLOC_CONF", "QWENFAST_ARCH")  # fmt: skip


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


@cache
def _commit() -> str:
    """The checkout's commit (short), `+dirty` when the package has uncommitted changes; `QWENFAST_COMMIT`
    wins (a GPU machine gets a copy of the tree without `.git`: the caller passes the commit)."""
    if os.environ.get("QWENFAST_COMMIT"):
        return os.environ["QWENFAST_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "qwenfast"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from ..about import __version__

        return f"v{__version__}"
    return sha + ("+dirty" if dirty else "")


@cache
def _run_id() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"


def _command() -> str:
    args = [a for a in sys.argv[1:]]
    prog = Path(sys.argv[0]).name if sys.argv else "python"
    if prog in ("qwenfast", "cli.py", "__main__.py") or prog.endswith("qwenfast"):
        return " ".join(["qwenfast", *args])
    return " ".join(["python", prog, *args])


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def provenance() -> dict:
    """Where a record comes from: date (UTC), commit, command, run id, engine switches, versions."""
    from importlib.util import find_spec

    from ..about import __version__

    env = {k: os.environ[k] for k in ENGINE_ENV if os.environ.get(k)}
    # FlashAttention-3 becomes the default attention on Hopper where installed: say whether it was
    fa3 = any(find_spec(m) is not None for m in ("flash_attn_interface", "fa3_fwd_interface"))
    return {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}",
        "commit": _commit(),
        "command": _command(),
        "run": _run_id(),
        "env": env,
        "python": sys.version.split()[0],
        "qwenfast": __version__,
        "diffusers": _version("diffusers"),
        "fa3_installed": fa3,
    }


def stamp(record: dict) -> dict:
    """`record` with the provenance fields and versions it lacks filled in (the record's own win)."""
    missing = {k: v for k, v in {**provenance(), **versions()}.items() if k not in record}
    if "device" in record and "gpu" in missing:  # older benchmarks name the GPU "device"
        missing["gpu"] = record["device"]
    return {**record, **missing}


def save_record(record: dict, path: Path) -> None:
    """Append one JSON line to `path` (folders created), stamped with its provenance."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(stamp(record)) + "\n")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32; NaN when `got` has a non-finite value (NaN never passes)."""
    got, want = got.float(), want.float()
    if not bool(got.isfinite().all()):
        return float("nan")
    return ((got - want).norm() / want.norm()).item()


def emit(record: dict, name: str, out_dir: Path | str | None) -> None:
    """Print the record as the final JSON line; append it to <out_dir>/<name> only when `out_dir` is
    given (`--results DIR`): a benchmark run from any folder leaves no files behind unless asked to."""
    record = stamp(record)
    print(json.dumps(record))
    if out_dir is not None:
        save_record(record, Path(out_dir) / name)


def emit_lines(records: list[dict], path: Path | str | None) -> None:
    """Print each record as a JSON line; append them to the file `path` when given (`--out FILE`)."""
    records = [stamp(r) for r in records]
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
