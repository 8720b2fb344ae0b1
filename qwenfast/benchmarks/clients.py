"""Closed-loop load for the serving benchmarks (`bench serve`'s uniform and mixed workloads): c client
threads, each sending its next request as soon as the last one is answered, and the nearest-rank quantile
their latencies are read with; and the GPU memory sampler a load is watched with (the server runs in the
benchmark's process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T, R = TypeVar("T"), TypeVar("R")  # the items the clients take, the results `one` returns


def closed_loop(
    items: Iterable[T],
    c: int,
    one: Callable[[T], R],
    stop_at: float | None = None,
    take: Callable[[T], T] | None = None,
) -> list[R]:
    """c client threads, each taking the next item and running `one(item)` (a request and its wait) until
    the items run out or `stop_at` (a perf_counter time) has passed -> the results in completion order.
    `take(item)`, if given, runs under the clients' lock as an item is taken (and may replace it)."""
    out: list[R] = []
    lock = threading.Lock()
    it = iter(items)

    def client() -> None:
        while True:
            with lock:
                x = next(it, None)
                if x is None or (stop_at is not None and time.perf_counter() >= stop_at):
                    return
                if take is not None:
                    x = take(x)
            r = one(x)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def quantile(xs: list[float], p: float) -> float:
    """The p-quantile of the sorted `xs` (nearest rank); NaN when there are none."""
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else float("nan")


class MemorySampler:
    """torch.cuda.memory_allocated / memory_reserved every `every` s in a thread (the server runs in this
    process); `mark()` starts the window the summary covers (after the warm-up)."""

    def __init__(self, every: float = 0.5):
        self.every, self.samples, self.start = every, [], 0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        t0 = time.perf_counter()
        while not self._stop.is_set():
            if torch.cuda.is_available():
                self.samples.append(
                    (time.perf_counter() - t0, torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
                )
            self._stop.wait(self.every)

    def __enter__(self) -> MemorySampler:
        self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._th.join()

    def mark(self) -> None:
        self.start = len(self.samples)

    def summary(self) -> dict:
        s = self.samples[self.start :]
        if not s:
            return {}
        gib = 2**30
        alloc, res = [a for _, a, _ in s], [r for _, _, r in s]
        return {
            "samples": len(s),
            "allocated_min_gib": round(min(alloc) / gib, 3),
            "allocated_max_gib": round(max(alloc) / gib, 3),
            "allocated_spread_gib": round((max(alloc) - min(alloc)) / gib, 3),
            "reserved_max_gib": round(max(res) / gib, 3),
            "series": [(round(t, 1), round(a / gib, 2)) for t, a, _ in s[:: max(1, len(s) // 120)]],
        }


def memory_windows(mem: MemorySampler, width: float = 60.0) -> dict:
    """The resting floor (min) and the peak (max) of allocated memory per `width`-second window after the
    warm-up: a leak moves the floor, a growing pool or cache moves the peaks."""
    s = mem.samples[mem.start :]
    if not s:
        return {}
    w0 = s[0][0]
    wins: dict[int, list[int]] = {}
    for t, a, _ in s:
        wins.setdefault(int((t - w0) // width), []).append(a)
    lows, highs = [min(v) for v in wins.values()], [max(v) for v in wins.values()]
    gib = 2**30
    return {
        "window_s": width,
        "floor_gib": [round(x / gib, 2) for x in lows],
        "peak_gib": [round(x / gib, 2) for x in highs],
        "floor_drift_gib": round((max(lows) - min(lows)) / gib, 3),
        "peak_drift_gib": round((max(highs) - min(highs)) / gib, 3),
    }
