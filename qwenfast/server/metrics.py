"""Prometheus metrics in the text exposition format, hand-written.

Why not prometheus_client: the server needs a dozen series, and writing the format is 60 lines,
against one more dependency and its global registry (which makes two apps in one test process
share counters). Updates come from the event loop and the worker thread, so one lock guards all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A successful request's time, split: "queue" (queued until its batch started: batch-mates, the GPU
# busy), "generate" (its batch started until its last image was done: the pipeline call), "encode"
# (PNG/JPEG/WebP and base64 of its images; a stream's also sending them) and "other" (the rest: reading
# and checking the request, handing the result from the worker thread to the event loop, the answer's
# JSON). The four add up to the latency.
PHASES = ("queue", "generate", "encode", "other")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lab = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.latency: dict[str, Histogram] = {}  # endpoint -> seconds, successful generations
        self.phases: dict[tuple[str, str], Histogram] = {}  # (endpoint, phase) -> seconds (`PHASES`)
        self.interleaved = 0  # batches run between two steps of a longer one (batcher._interleave)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.batch_seconds = Histogram(LATENCY_BUCKETS)
        self.images_total = 0
        self.rejected: dict[str, int] = {}  # reason -> count (queue_full, timeout, disconnect, ...)
        self._recent: deque[tuple[float, int]] = deque()  # (time, images) over the last minute
        # the last batches run: (time.monotonic() at their end, seconds, images, *what the batcher says:
        # steps, width, height, nesting depth): a trace for benchmarks, not exported
        self.batch_log: deque[tuple] = deque(maxlen=4096)

    def request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1
            if seconds is not None and status == 200:
                self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def request_phases(self, endpoint: str, spans: dict[str, float]) -> None:
        """Where a successful request's time went (`PHASES`): each span in seconds."""
        with self.lock:
            for phase, v in spans.items():
                self.phases.setdefault((endpoint, phase), Histogram(LATENCY_BUCKETS)).observe(max(0.0, v))

    def phase_sums(self, endpoint: str) -> dict[str, tuple[float, int]]:
        """The request phases of `endpoint` so far: phase -> (seconds summed, requests)."""
        with self.lock:
            return {ph: (h.sum, h.count) for (ep, ph), h in self.phases.items() if ep == endpoint}

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def batch(self, size: int, seconds: float, what: tuple = ()) -> None:
        with self.lock:
            self.batch_log.append((time.monotonic(), seconds, size, *what))
            self.batch_size.observe(size)
            self.batch_seconds.observe(seconds)
            self.images_total += size
            now = time.time()
            self._recent.append((now, size))

    def snapshot(self) -> dict:
        """The batch-side series as plain data, for another process to `merge` (Ray Serve: each replica's
        batcher counts its own batches; the ingress adds them up for one /metrics)."""
        with self.lock:
            hist = {
                k: (list(h.counts), h.sum, h.count)
                for k, h in (("batch_size", self.batch_size), ("batch_seconds", self.batch_seconds))
            }
            return {**hist, "images_total": self.images_total, "recent": list(self._recent)}

    def merge(self, snap: dict) -> None:
        """Add another Metrics' `snapshot()` (its batches, images and recent throughput) to this one."""
        with self.lock:
            for name in ("batch_size", "batch_seconds"):
                h, (counts, total, count) = getattr(self, name), snap[name]
                h.counts = [a + b for a, b in zip(h.counts, counts)]
                h.sum, h.count = h.sum + total, h.count + count
            self.images_total += snap["images_total"]
            self._recent = deque(sorted([*self._recent, *map(tuple, snap["recent"])]))

    def images_per_second(self, window: float = 60.0) -> float:
        now = time.time()
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        span = min(window, max(1e-9, now - self.started))
        return sum(n for _, n in self._recent) / span

    def render(self, queue_depth: int, queue_images: int, in_flight: int, gpu: dict[str, float]) -> str:
        L: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            L.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])

        with self.lock:
            head("qwenfast_queue_depth", "gauge", "Requests waiting for the GPU (not started).")
            L.append(f"qwenfast_queue_depth {queue_depth}")
            head("qwenfast_queue_images", "gauge", "Images waiting for the GPU.")
            L.append(f"qwenfast_queue_images {queue_images}")
            head("qwenfast_in_flight_requests", "gauge", "Requests with images being generated now.")
            L.append(f"qwenfast_in_flight_requests {in_flight}")
            head(
                "qwenfast_requests_total",
                "counter",
                "Finished HTTP requests to the image endpoints by status.",
            )
            for (ep, st), c in sorted(self.requests.items()):
                L.append(f'qwenfast_requests_total{{endpoint="{ep}",status="{st}"}} {c}')
            head("qwenfast_request_duration_seconds", "histogram", "Latency of successful image requests.")
            for ep, h in sorted(self.latency.items()):
                L.extend(h.lines("qwenfast_request_duration_seconds", f'endpoint="{ep}"'))
            head(
                "qwenfast_request_phase_seconds",
                "histogram",
                "Where successful image requests spent their time: queue, generate, encode, other.",
            )
            for (ep, ph), h in sorted(self.phases.items()):
                L.extend(h.lines("qwenfast_request_phase_seconds", f'endpoint="{ep}",phase="{ph}"'))
            head("qwenfast_rejected_total", "counter", "Requests not served, by reason.")
            for r, c in sorted(self.rejected.items()):
                L.append(f'qwenfast_rejected_total{{reason="{r}"}} {c}')
            head("qwenfast_images_generated_total", "counter", "Images generated.")
            L.append(f"qwenfast_images_generated_total {self.images_total}")
            head(
                "qwenfast_interleaved_batches_total",
                "counter",
                "Batches run between two steps of a longer one.",
            )
            L.append(f"qwenfast_interleaved_batches_total {self.interleaved}")
            head("qwenfast_images_per_second", "gauge", "Images generated per second over the last minute.")
            L.append(f"qwenfast_images_per_second {self.images_per_second():.4f}")
            head("qwenfast_batch_size", "histogram", "Images per pipeline call.")
            L.extend(self.batch_size.lines("qwenfast_batch_size"))
            head("qwenfast_batch_duration_seconds", "histogram", "Seconds per pipeline call.")
            L.extend(self.batch_seconds.lines("qwenfast_batch_duration_seconds"))
        for k, v in gpu.items():
            head(f"qwenfast_gpu_memory_{k}_bytes", "gauge", f"torch.cuda memory {k} on the serving device.")
            L.append(f"qwenfast_gpu_memory_{k}_bytes {int(v)}")
        head("qwenfast_uptime_seconds", "gauge", "Seconds since the server started.")
        L.append(f"qwenfast_uptime_seconds {time.time() - self.started:.1f}")
        return "\n".join(L) + "\n"


def gpu_memory(device: torch.device | str | None) -> dict[str, float]:
    """allocated / reserved / peak / total bytes on a CUDA device; empty on CPU."""
    import torch

    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "free": free,
        "total": total,
    }


def model_info(model: str, model_type: str, kind: str) -> str:
    """The `qwenfast_model_info` series (always 1): which model this server serves, as labels."""

    def label(v: str) -> str:  # backslash, quote and newline escaped, as the format wants
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return (
        "# HELP qwenfast_model_info The served model (always 1).\n# TYPE qwenfast_model_info gauge\n"
        f'qwenfast_model_info{{model="{label(model)}",type="{label(model_type)}",kind="{label(kind)}"}} 1\n'
    )
