"""How a submitted job becomes its HTTP answer: one JSON body when it finishes, or a stream of
Server-Sent Events (queue position, progress, partial and finished images); the deadline, a client that
hangs up, and the images' encoding (on a thread-pool thread, never on the event loop) are handled here.

`create_app` (app.py) builds one `Responder` over the scheduler, the server's config, its metrics and
URL store, and hands it every validated job.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .imaging import MIME, b64, encode_image
from .jobs import Job
from .schemas import APIError

NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}  # fmt: skip


def sse_event(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


async def wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body is already read, so receive() only reports that)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class UrlStore:
    """Images served at /files/<token> for response_format=url; they expire (--url-ttl), oldest first past the memory cap."""

    def __init__(self, ttl: float, max_bytes: int):
        self.ttl, self.max_bytes = ttl, max_bytes
        self.items: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def put(self, data: bytes, mime: str, ext: str) -> str:
        token = f"{secrets.token_urlsafe(24)}.{ext}"  # unguessable: the token is the only credential
        with self.lock:
            self._purge()
            self.items[token] = (time.monotonic() + self.ttl, data, mime)
            self.size += len(data)
            while self.size > self.max_bytes and len(self.items) > 1:
                _, (_, d, _) = self.items.popitem(last=False)
                self.size -= len(d)
        return token

    def get(self, token: str) -> tuple[bytes, str] | None:
        with self.lock:
            self._purge()
            v = self.items.get(token)
            return None if v is None else (v[1], v[2])

    def _purge(self):
        now = time.monotonic()
        while self.items:
            tok, (exp, d, _) = next(iter(self.items.items()))
            if exp > now:
                break
            self.items.popitem(last=False)
            self.size -= len(d)


class Responder:
    """The answers of one app: `respond(request, job, endpoint, t0)` submits the job and returns its
    response (JSON, or an event stream when the job asks for one)."""

    def __init__(self, sched, cfg, metrics, urls, model_id: str) -> None:
        self.sched, self.cfg, self.metrics, self.urls, self.model_id = sched, cfg, metrics, urls, model_id

    async def respond(self, request: Request, job: Job, endpoint: str, t0: float):
        position = self.sched.submit(job)
        deadline = t0 + self.cfg.timeout_s
        base = str(request.base_url)
        if job.params.stream:
            return StreamingResponse(
                self.sse(job, endpoint, t0, deadline, base, position),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watch = asyncio.create_task(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait(
                {job.future, watch},
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        except asyncio.CancelledError:  # server shutting down past its grace period
            self.sched.cancel(job, "shutdown")
            raise
        finally:
            watch.cancel()
        if not job.future.done():
            if watch in done:
                self.sched.cancel(job, "disconnect")
                self.metrics.request(endpoint, 499)
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            self.sched.cancel(job, "timeout")
            raise APIError(
                504,
                f"the request did not finish within {self.cfg.timeout_s:g} s (queue wait included)",
                code="timeout",
            )
        images = job.future.result()  # raises the job's APIError
        enc = time.monotonic()
        data = await asyncio.to_thread(self.encode_all, job, images, base)
        done = time.monotonic()
        self.metrics.request(endpoint, 200, done - t0)
        self.metrics.request_phases(endpoint, job.spans(t0, enc, done))
        p = job.params
        return {
            "created": int(time.time()),
            "data": data,
            "size": f"{images[0].width}x{images[0].height}",
            "output_format": p.output_format,
            "quality": "auto",
            "background": "opaque",
        }

    def encode_all(self, job: Job, images: list, base: str) -> list[dict]:
        p, out = job.params, []
        for i, img in enumerate(images):
            meta = {
                "prompt": p.prompt,
                "negative_prompt": p.negative or "",
                "seed": str(job.seeds[i]),
                "steps": str(p.steps),
                "self.cfg": str(p.cfg),
                "size": f"{img.width}x{img.height}",
                "model": self.model_id,
                "loras": json.dumps(p.loras),
                "generator": "qwenfast serve",
            }
            data = encode_image(img, p.output_format, p.compression, meta)
            item = {"seed": job.seeds[i], "revised_prompt": None}
            if p.response_format == "url":
                item["url"] = base + "files/" + self.urls.put(data, MIME[p.output_format], p.output_format)
            else:
                item["b64_json"] = b64(data)
            out.append(item)
        return out

    async def sse(self, job: Job, endpoint: str, t0: float, deadline: float, base: str, position: int):
        p, status = job.params, 499
        extra = {
            "size": f"{p.width}x{p.height}" if not p.size_auto else "auto",
            "output_format": p.output_format,
            "quality": "auto",
            "background": "opaque",
        }
        try:
            if p.progress:
                yield sse_event(
                    {"type": "image_generation.queued", "position": position, "created_at": int(time.time())}
                )
            while True:
                get = asyncio.ensure_future(job.events.get())
                try:
                    done, _ = await asyncio.wait(
                        {get, job.future},
                        timeout=min(2.0, max(0.0, deadline - time.monotonic())),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:  # a client gone cancels the wait: the get would stay pending, then be destroyed
                    if not get.done():
                        get.cancel()
                if get in done:
                    ev = get.result()
                    if ev["type"] == "image_generation.partial_image":
                        yield sse_event({**ev, **extra, "created_at": int(time.time())})
                    elif p.progress:  # qwenfast's own event types only when asked for
                        yield sse_event(ev)
                    continue
                if job.future.done():
                    break
                if time.monotonic() >= deadline:
                    self.sched.cancel(job, "timeout")
                    status = 504
                    yield sse_event(
                        {
                            "type": "error",
                            "error": APIError(
                                504,
                                f"the request did not finish within {self.cfg.timeout_s:g} s",
                                code="timeout",
                            ).body()["error"],
                        }
                    )
                    return
                yield ": keep-alive\n\n"  # also notices a vanished client while queued
            exc = job.future.exception()
            if exc is not None:
                status = getattr(exc, "status", 500)
                err = (
                    exc.body()["error"]
                    if isinstance(exc, APIError)  # anything else: its text may hold host paths
                    else {
                        "message": f"internal error: {type(exc).__name__}",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
                )
                yield sse_event({"type": "error", "error": err})
                return
            images = job.future.result()
            enc = time.monotonic()
            data = await asyncio.to_thread(self.encode_all, job, images, base)
            for i, d in enumerate(data):
                ev = {
                    "type": "image_generation.completed",
                    "index": i,
                    "created_at": int(time.time()),
                    **extra,
                    "size": f"{images[i].width}x{images[i].height}",
                    "usage": NO_USAGE,
                    **d,
                }
                if "b64_json" not in ev:  # streams always carry the image; url is extra
                    ev["b64_json"] = b64(encode_image(images[i], p.output_format, p.compression))
                yield sse_event(ev)
            status = 200
            yield "data: [DONE]\n\n"
            self.metrics.request_phases(endpoint, job.spans(t0, enc, time.monotonic()))
        finally:
            if not job.future.done():
                self.sched.cancel(job, "disconnect")
            self.metrics.request(endpoint, status, time.monotonic() - t0 if status == 200 else None)
