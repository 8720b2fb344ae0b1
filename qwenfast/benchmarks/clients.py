"""Closed-loop load for the serving benchmarks (`bench serve`'s uniform and mixed workloads): c client
threads, each sending its next request as soon as the last one is answered, and the nearest-rank quantile
their latencies are read with."""

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
