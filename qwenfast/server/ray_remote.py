"""The ingress side of qwenfast on Ray Serve: the app's scheduler seam, forwarding to engine replicas.

`create_app(pipe, cfg, scheduler=...)` (app.py) runs unchanged in the ingress replica: parsing, limits,
auth, LoRA names, SSE, the page and /files. Only two things differ from one-process serving:

- `RemotePipe` stands in for the pipeline: what the app reads of it (defaults, size multiple,
  capabilities, trained size, output sizes) comes from one engine's `describe()`.
- `RemoteScheduler` replaces the local batcher: `submit` sends the job to an engine replica through
  the Ray Serve handle (the replica runs the local batcher, batcher.py) and relays its events and its
  images back into the job, so app.py cannot tell the difference.

Failure: when the replica holding a job dies (process killed, node lost, CUDA error that kills the
actor), the call fails with a Ray actor error, and the job is sent again; Ray routes it to a live
replica. The job's seeds are fixed before it is first sent, so the image is the same wherever it
runs, and the job is resolved once (`Job.finish` is idempotent), so every request is answered once.
A replica whose queue is full answers 429 and the job tries again; the client gets 429 only when the
ingress sees every live replica's queue full.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from typing import Any

from .metrics import Metrics
from .schemas import APIError

log = logging.getLogger("qwenfast.server")
MAX_RETRIES = 5  # replica losses one request may live through
REPLICA_SERIES = [  # (stats key, metric, type, help)
    ("queue", "queue_depth", "gauge", "Requests waiting on this replica."),
    ("running", "in_flight_requests", "gauge", "Requests being generated on this replica."),
    ("images_total", "images_generated_total", "counter", "Images this replica generated."),
    ("images_per_second", "images_per_second", "gauge", "This replica's images per second, last minute."),
]


class ReplicaBoard:
    """Latest stats of each engine replica the router knows, plus the last stats of retired ones."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: dict[str, dict] = {}  # replica id -> stats (with "node")
        self.retired: dict[str, dict] = {}
        self.updated = 0.0

    def update(self, replicas: dict[str, dict]) -> None:
        with self.lock:
            for rid in set(self.live) - set(replicas):
                self.retired[rid] = self.live[rid]
            self.live = {rid: {**self.live.get(rid, {}), **s} for rid, s in replicas.items()}
            self.updated = time.time()

    def view(self) -> tuple[dict[str, dict], dict[str, dict]]:
        with self.lock:
            return dict(self.live), dict(self.retired)


BOARD = ReplicaBoard()  # filled by ray_router.BatchAffinityRouter in this (the ingress) process


class RemotePipe:
    """What app.py reads of a pipeline, for a pipeline that lives in the engine replicas.

    Sizes, the size note, capabilities and `for_task` come from a stand-in of the replica's pipeline
    class over its settings (`pipeline.auto.stand_in`), so the ingress answers exactly as a local
    server would without loading the model; running or changing the model happens in the replicas."""

    def __init__(self, desc: dict):
        from ..pipeline.auto import stand_in

        self.desc = desc
        local = stand_in(desc["pipeline"], desc["settings"])
        self.model_path, self.extra, self.defaults = local.model_path, local.extra, local.defaults
        self.vae_scale_factor, self.capabilities = local.vae_scale_factor, local.capabilities
        self.output_size, self.size_note, self.for_task = local.output_size, local.size_note, local.for_task
        self.device, self.dtype = f"{desc['device']} (Ray Serve replicas)", desc["dtype"]
        self.options = desc["options"]

    def set_loras(self, *a, **kw):
        raise RuntimeError("LoRAs are applied in the engine replicas, never in the ingress")


def _error_dict(e: APIError) -> dict:
    return {
        "status": e.status,
        "message": e.message,
        "param": e.param,
        "code": e.code,
        "type": e.type,
        "headers": dict(e.headers),
    }


def api_error(d: dict) -> APIError:
    return APIError(
        d["status"], d["message"], param=d["param"], code=d["code"], type=d["type"], headers=d["headers"]
    )


def job_spec(job) -> dict:
    """What an engine replica needs to run `job` exactly as the ingress validated it (seeds included)."""
    p = job.params
    if not p.stream:  # previews are only for clients that stream (batcher.py); keep it so remotely
        p = dataclasses.replace(p, partial_images=0)
    return {"params": p, "kind": job.kind, "loras": job.loras, "images": job.images, "mask": job.mask}


def route_key(job) -> str:
    return repr(job.key) if job.kind == "t2i" else ""  # edits run alone: no batch to join


class RemoteScheduler:
    """app.py's scheduler interface over Ray Serve engine replicas (see the module docstring)."""

    def __init__(self, engine, cfg, metrics: Metrics, target: dict):
        self.engine, self.cfg, self.metrics, self.target = engine, cfg, metrics, target
        self.tasks: dict[Any, asyncio.Task] = {}  # job -> the task that drives it
        self.waiting: set = set()
        self.running: set = set()
        self.stopping = False
        self.retries = 0
        self._status_cache: tuple[float, dict] = (0.0, {})

    # ------------------------------------------------------------------ app.py's interface
    def start(self) -> None:
        pass

    def up(self) -> int:
        live, _ = BOARD.view()
        return len(live)

    def submit(self, job) -> int:
        if self.stopping:
            raise APIError(
                503, "the server is shutting down; retry on another instance", code="shutting_down"
            )
        cap = self.cfg.max_queue * max(1, self.up())
        if len(self.waiting) >= cap:  # every live replica's queue is full
            self.metrics.reject("queue_full")
            wait = self.retry_after()
            raise APIError(
                429,
                f"every replica's queue is full ({len(self.waiting)} requests waiting); retry in ~{wait} s",
                code="queue_full",
                headers={"Retry-After": str(wait)},
            )
        self.waiting.add(job)
        self.tasks[job] = asyncio.get_running_loop().create_task(self._drive(job))
        return len(self.waiting)

    def cancel(self, job, reason: str) -> None:
        if job.cancelled:
            return
        job.cancelled = True
        self.metrics.reject(reason)
        task = self.tasks.get(job)
        if task is not None and task is not asyncio.current_task():
            job.loop.call_soon_threadsafe(task.cancel)  # cancels the Ray call: the replica drops the job

    def depth(self) -> tuple[int, int, int]:
        return len(self.waiting), sum(j.params.n for j in list(self.waiting)), len(self.running)

    def retry_after(self) -> int:
        live, _ = BOARD.view()
        per_batch = max([s.get("avg_batch_s", 1.0) for s in live.values()] or [1.0])
        batches = len(self.waiting) / max(1, self.cfg.max_batch * max(1, len(live))) + 1
        return max(1, math.ceil(batches * per_batch))

    def stop(self, timeout: float | None = None) -> None:
        """Graceful drain: refuse new jobs, wait (up to `timeout`) for the ones already sent."""
        self.stopping = True
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.tasks and time.monotonic() < deadline:
            time.sleep(0.05)

    # ------------------------------------------------------------------ one job's life
    async def _drive(self, job) -> None:
        import ray.exceptions as rex

        spec, key, attempt, busy = job_spec(job), route_key(job), 0, 0
        try:
            while True:
                gen = self.engine.options(stream=True).generate.remote(spec, key=key)
                try:
                    outcome = await self._relay(job, gen)
                except asyncio.CancelledError:
                    gen.cancel()
                    raise
                except (rex.RayActorError, rex.ActorUnavailableError) as e:  # the replica died under the job
                    attempt += 1
                    self.retries += 1
                    log.warning(
                        "replica lost while running request %s (%s); retry %d",
                        job.id,
                        type(e).__name__,
                        attempt,
                    )
                    self.running.discard(job)
                    self.waiting.add(job)
                    if attempt > MAX_RETRIES:
                        job.finish(
                            APIError(
                                503,
                                f"the request lost {attempt} replicas in a row; retry later",
                                code="replicas_lost",
                            )
                        )
                        return
                    job.post({"type": "image_generation.retrying", "attempt": attempt})
                    continue
                if outcome is None:  # that replica's queue was full: back off and let Ray pick again
                    busy += 1
                    await asyncio.sleep(min(1.0, 0.05 * 2**busy))
                    continue
                return
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a bug, never the client's fault: answer 500 rather than hang
            log.exception("ray ingress: request %s failed", job.id)
            job.finish(
                APIError(
                    500, f"internal error: {type(e).__name__} (see the server log)", code="internal_error"
                )
            )
        finally:
            self.waiting.discard(job)
            self.running.discard(job)
            self.tasks.pop(job, None)

    async def _relay(self, job, gen) -> bool | None:
        """Relay one attempt's events; True when the job got its answer, None when the replica was full."""
        async for ev in gen:
            t = ev["type"]
            if t == "result":
                job.finish(ev["images"])
                return True
            if t == "error":
                err = api_error(ev["error"])
                if err.code == "queue_full" and not self.stopping:
                    return None
                job.finish(err)
                return True
            if t == "image_generation.started":
                if job.started is None:  # (the request's phases: queue until here, then generate)
                    job.started = time.monotonic()
                self.waiting.discard(job)
                self.running.add(job)
            job.post(ev)
        raise RuntimeError("the engine replica ended the stream without an answer")

    # ------------------------------------------------------------------ /health and /metrics
    def _status(self) -> dict:
        """Replica counts from Ray Serve's controller (cached 1 s): the target and how many run."""
        t, cached = self._status_cache
        if time.monotonic() - t < 1.0:
            return cached
        out = {}
        try:
            from ray import serve

            st = serve.status().applications[self.target["app"]].deployments[self.target["deployment"]]
            out = {"states": {str(k): v for k, v in st.replica_states.items()}}
            target = getattr(st, "target_num_replicas", None)
            if target is not None:
                out["target"] = target
        except Exception as e:  # the controller may be busy or restarting; /health must still answer
            log.debug("serve.status() failed: %s", e)
        self._status_cache = (time.monotonic(), out)
        return out

    def health(self) -> dict:
        live, _ = BOARD.view()
        st = self._status()
        running = st.get("states", {}).get("RUNNING", len(live))
        total = max(st.get("target") or self.target.get("replicas") or 0, running, len(live))
        up = min(len(live), running) if st else len(live)
        each = [
            {
                "id": rid,
                "node": s.get("node"),
                "pid": s.get("pid"),
                "queue": s.get("queue"),
                "running": s.get("running"),
                "images": s.get("images_total"),
            }
            for rid, s in sorted(live.items())
        ]
        body = {
            "replicas": {
                "up": up,
                "total": total,
                "states": st.get("states", {}),
                "list": each,
                "nodes": len({s.get("node") for s in live.values()}),
            },
            "ray_retries": self.retries,
        }
        if up == 0:
            body["status"] = "no_replicas"
        return body

    def render_metrics(self) -> str:
        live, retired = BOARD.view()
        total = Metrics()  # the ingress's request series + every replica's batch series
        total.started = self.metrics.started
        with self.metrics.lock:
            total.requests, total.rejected = dict(self.metrics.requests), dict(self.metrics.rejected)
            total.latency = dict(self.metrics.latency)
        for s in [*live.values(), *retired.values()]:
            if "metrics" in s:
                total.merge(s["metrics"])
        q, qi, run = self.depth()
        lines = [total.render(q, qi, run, {})]
        h = self.health()["replicas"]
        lines += [
            "# HELP qwenfast_replicas Engine replicas: up (serving) and total (Ray Serve's target).",
            "# TYPE qwenfast_replicas gauge",
            f'qwenfast_replicas{{state="up"}} {h["up"]}',
            f'qwenfast_replicas{{state="total"}} {h["total"]}',
            "# HELP qwenfast_ray_retries_total Requests sent again after their replica died.",
            "# TYPE qwenfast_ray_retries_total counter",
            f"qwenfast_ray_retries_total {self.retries}",
            "# HELP qwenfast_replica_up 1 for a serving replica, 0 for one that is gone.",
            "# TYPE qwenfast_replica_up gauge",
        ]
        rows = [(rid, s, 1) for rid, s in sorted(live.items())] + [
            (rid, s, 0) for rid, s in sorted(retired.items())
        ]
        lines += [
            f'qwenfast_replica_up{{replica="{rid}",node="{str(s.get("node"))[:12]}"}} {up}'
            for rid, s, up in rows
        ]
        for key, name, kind, help_ in REPLICA_SERIES:
            lines += [f"# HELP qwenfast_replica_{name} {help_}", f"# TYPE qwenfast_replica_{name} {kind}"]
            lines += [
                f'qwenfast_replica_{name}{{replica="{rid}"}} {s.get(key, 0)}'
                for rid, s, _ in rows
                if key in s
            ]
        gpu = [(rid, k, v) for rid, s, up in rows if up for k, v in (s.get("gpu") or {}).items()]
        for k in sorted({k for _, k, _ in gpu}):
            lines += [
                f"# HELP qwenfast_replica_gpu_memory_{k}_bytes torch.cuda memory {k} on the replica's GPU.",
                f"# TYPE qwenfast_replica_gpu_memory_{k}_bytes gauge",
            ]
            lines += [
                f'qwenfast_replica_gpu_memory_{k}_bytes{{replica="{rid}"}} {int(v)}'
                for rid, kk, v in gpu
                if kk == k
            ]
        return "\n".join(lines) + "\n"
