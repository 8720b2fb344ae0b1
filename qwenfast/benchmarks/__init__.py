"""Benchmarks behind `qwenfast bench ...`; each prints a table and a final JSON line."""

from __future__ import annotations

import json
from pathlib import Path


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
