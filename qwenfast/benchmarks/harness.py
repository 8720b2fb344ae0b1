"""The pipeline benchmarks' shared harness: synchronised timing and memory peaks around model calls,
the benchmark prompt, and one call of a pipeline in the benchmarks' standard form (used by
`pipeline.py`, `pipeline_stages.py`, `tasks.py`, `tasks_inpaint.py`, `parallel.py`)."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

GiB = 1024**3
PROMPT = "a fox reading a newspaper in a cafe, watercolor, soft light"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StageTimer:
    """Wraps methods (instance attributes) to add their synchronised wall time and peak memory to a stage."""

    def __init__(self, stage_peaks: bool = False):
        self.stage_peaks = stage_peaks  # reset the peak counter per stage (then the call's own peak is lost)
        self.t: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self._undo = []
        self._wrapped: list[tuple] = []  # (obj, name, stage, before) of each `wrap`: what `rewrap` redoes

    def wrap(self, obj: object, name: str, stage: str, before: str | None = None) -> None:
        """Time `obj.<name>` (a model's method) as `stage`; `before`: record the memory peak since the
        last reset as that stage first (the phase between two timed calls)."""
        fn = getattr(obj, name)

        def run(*a: Any, **k: Any) -> Any:
            _sync()
            t0 = time.perf_counter()
            if before is not None:
                self.peak[before] = max(self.peak.get(before, 0), _peak())
            if self.stage_peaks:
                _reset_peak()
            try:
                return fn(*a, **k)
            finally:
                _sync()
                self.t[stage] = self.t.get(stage, 0.0) + time.perf_counter() - t0
                self.peak[stage] = max(self.peak.get(stage, 0), _peak())

        had = name in obj.__dict__
        self._undo.append((obj, name, obj.__dict__.get(name), had))
        self._wrapped.append((obj, name, stage, before))
        setattr(obj, name, run)

    def reset(self) -> None:
        self.t, self.peak = {}, {}

    def restore(self) -> None:
        for obj, name, old, had in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                obj.__dict__.pop(name, None)
        self._undo = []

    def rewrap(self) -> None:
        """Wrap again what `restore` unwrapped (untimed calls in between run the plain methods)."""
        if self._undo:
            return
        wrapped, self._wrapped = self._wrapped, []
        for args in wrapped:
            self.wrap(*args)


def _call(pipe, engine: str, size: int, steps: int, cfg: bool, prompt: str, seed: int = 0, batch: int = 1):
    kw = dict(
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        true_cfg_scale=4.0 if cfg else 1.0,
        output_type="np",
    )
    if cfg:
        kw["negative_prompt"] = " "
    return pipe([prompt] * batch if batch > 1 else prompt, **kw).images


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
