"""One request as the worker sees it (`Job`: its parameters, results, stream and timings; `Item`: one of its
images in a batch), and `Cancelled`, which stops a batch nobody waits for (server/batcher.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from .schemas import Params


class Cancelled(Exception):
    """Every request of a running batch went away; stop spending GPU time on it."""


class Job:
    """One HTTP request: n images, their results, and (if streaming) an event queue for the client."""

    def __init__(
        self,
        params: Params,
        loop: asyncio.AbstractEventLoop,
        *,
        kind: str = "t2i",
        loras: tuple = (),
        images: list | None = None,
        stream_events: bool = False,
        mask=None,
        per_row: bool = False,
    ):
        """`per_row`: the pipeline runs each row's LoRAs (`--row-loras`): they leave the batch key."""
        self.id = uuid.uuid4().hex
        self.params, self.kind, self.loras, self.images, self.mask = params, kind, loras, images, mask
        self.seeds = params.seeds()
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.events: asyncio.Queue | None = asyncio.Queue() if stream_events else None
        self.results: list = [None] * params.n
        self.done = 0
        self.cancelled = False
        self.enqueued = time.monotonic()
        self.started: float | None = None  # its first image's batch began (worker thread)
        self.paused_s = 0.0  # time its running batch spent on interleaved batches (worker thread)
        self.finished: float | None = None  # its answer (images or error) was handed over
        p = params
        if kind == "t2i":
            lkey = () if per_row else loras
            self.key = ("t2i", p.width, p.height, p.steps, p.cfg, p.negative is not None, lkey, p.cache)
        else:  # edit / img2img / inpaint inputs differ per request; run alone (see app.py)
            self.key = (kind, self.id)

    def spans(self, t0: float, encoded_from: float, done: float) -> dict[str, float]:
        """`metrics.PHASES` of a request that arrived at `t0` and was answered at `done`, its images
        encoded from `encoded_from` (all `time.monotonic()`)."""
        started = self.enqueued if self.started is None else self.started
        finished = encoded_from if self.finished is None else self.finished
        q, g, e = started - self.enqueued, finished - started, done - encoded_from
        return {"queue": q, "generate": g, "encode": e, "other": done - t0 - q - g - e}

    # called from the worker thread -------------------------------------------------------------
    def post(self, event: dict) -> None:
        if self.events is not None and not self.cancelled:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def finish(self, result) -> None:
        """Resolve the request with a list of images or an exception (thread-safe, idempotent)."""
        if self.finished is None:
            self.finished = time.monotonic()

        def _set():  # nobody awaits a cancelled request: leave its future alone (no "never retrieved" noise)
            if not self.future.done() and not self.cancelled:
                (self.future.set_exception if isinstance(result, BaseException) else self.future.set_result)(
                    result
                )

        self.loop.call_soon_threadsafe(_set)


@dataclass
class Item:
    job: Job
    index: int  # which of the job's n images
