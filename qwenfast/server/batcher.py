"""The bounded queue and the worker thread that batches compatible requests.

Why one worker thread: one GPU runs one pipeline call at a time anyway, and the call (seconds of
GPU work) must not run on the event loop, which keeps answering /health, /metrics, new requests
and streams meanwhile. torch releases the GIL inside its ops, so the loop stays responsive.

Batching: requests with the same batch key (size, steps, CFG scale and on/off, LoRA set, step cache; one model
per server) share a pipeline call of up to `max_batch` images. Each image keeps its own
`torch.Generator(seed)`, so it draws the same noise as alone. The server's pipelines decode per
image (`EngineOptions.decode_per_image`, set by `load_pipeline`), so the decode is batch-invariant.
What remains
batch-dependent is inside the transformer (see `tests/test_server.py::test_batched_equals_alone`).

A lone request waits at most `batch_wait_s` for batch-mates, counted from when it was queued, so
batching never adds more than that to anyone's latency. The next batch starts with the waiting request
of fewest steps (then the oldest), so a 4-step request does not queue behind 50-step ones, unless the
oldest request has waited `age_bound_s`: then the oldest goes first, so nothing starves (`_first`); the
pick is made again after the wait for batch-mates (8 clients starting at once: the first to arrive was an
8-step request, and the 4-step ones that came within the wait ran inside it, after its first step).
With CUDA graphs a batch takes a power of two of the images that share its key (`_graph_sizes`).
Between two steps of a running batch, the waiting shorter requests may run to the end first
(`_interleave`), for at most `age_bound_s` of pauses per running batch. "Shorter" is GPU work (steps x
image tokens x rows, twice with true CFG: `pace.work`): less than each of the batch's images has left, or,
for a request of fewer steps than the batch, less than the batch has left in all (`pace.may_run_inside`).
And the host keeps pace with the GPU (`StepPace`): the steps of a batch replayed from CUDA graphs are
queued in a few milliseconds, so without it every "between two steps" came before the GPU had run the
first, and a request that arrived later waited for the whole batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path

from .. import validation as V
from ..errors import ConfigureError
from . import warmup
from .imaging import jpeg_b64
from .jobs import Cancelled, Item, Job
from .metrics import Metrics
from .options import ServerConfig
from .pace import StepPace, may_run_inside, true_cfg
from .schemas import APIError, Params

log = logging.getLogger("qwenfast.server")


class Scheduler:
    nesting = 2  # interleaved batches inside one another at most (`_interleave`)

    def __init__(self, pipe, cfg: ServerConfig, metrics: Metrics):
        self.pipe, self.cfg, self.metrics = pipe, cfg, metrics
        self.cond = threading.Condition()
        self.pending: deque[Item] = deque()
        self.queued: set[Job] = set()  # jobs none of whose images has started
        self.running: set[Job] = set()
        self.stopping = False
        self.avg_batch_s = 1.0
        self._loras = None  # the LoRA set currently applied to the pipeline
        self._lora = pipe.capabilities.lora  # what the pipeline declares (pipeline/tasks.py)
        self._rows = None  # per-row LoRAs (--row-loras): each request its own inside a batch
        if cfg.row_loras and cfg.lora_dir:
            if not pipe.capabilities.row_loras:
                raise ConfigureError(
                    f"--row-loras: this model ({pipe.capabilities.model_type}, {', '.join(pipe.capabilities.tasks)}) "
                    "does not take LoRAs per request; leave the flag out"
                )
            pipe.enable_row_loras(cfg.lora_dir, slots=cfg.row_loras)
            self._rows = pipe.row_loras
        self._depth = 0  # batches interleaved into running ones that are running now (`_interleave`)
        self._default_cache = pipe.options.cache  # the server's --cache
        # --warm-up's progress (warmup.py), for /health; while it runs nothing is interleaved into it
        self.warm_state = (
            {"batches": 0, "of": None, "failed": 0, "s": 0.0, "done": False} if cfg.warm_up else None
        )
        for w, h in cfg.warm_up:  # the size rule of requests (`schemas.validate`), checked before serving
            try:
                lim = cfg.limits
                V.check_size(
                    w,
                    h,
                    min_side=lim.min_side,
                    max_side=lim.max_side,
                    max_pixels=lim.max_pixels,
                    multiple=pipe.capabilities.size_multiple,
                    name="--warm-up size",
                )
            except ValueError as e:
                raise ConfigureError(str(e)) from None
        self._thread = threading.Thread(target=self._loop, name="qwenfast-worker", daemon=True)

    # ------------------------------------------------------------------ called from the event loop
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> int:
        """Queue `job`; its queue position, or APIError(429/503) when full or shutting down."""
        with self.cond:
            if self.stopping:
                raise APIError(
                    503, "the server is shutting down; retry on another instance", code="shutting_down"
                )
            if len(self.queued) >= self.cfg.max_queue:
                self.metrics.reject("queue_full")
                wait = self.retry_after()
                raise APIError(
                    429,
                    f"the queue is full ({len(self.queued)} requests waiting); retry in ~{wait} s",
                    code="queue_full",
                    headers={"Retry-After": str(wait)},
                )
            self.pending.extend(Item(job, i) for i in range(job.params.n))
            self.queued.add(job)
            self.cond.notify_all()
            return len(self.queued)

    def cancel(self, job: Job, reason: str) -> None:
        """The client went away or timed out: drop its waiting images; a running batch stops at the
        next step if nobody else is in it."""
        with self.cond:
            if job.cancelled:
                return
            job.cancelled = True
            self.metrics.reject(reason)
            self.pending = deque(it for it in self.pending if it.job is not job)
            self.queued.discard(job)
            self.cond.notify_all()

    def retry_after(self) -> int:
        batches = len(self.pending) / max(1, self.cfg.max_batch) + 1
        return max(1, math.ceil(batches * self.avg_batch_s))

    def depth(self) -> tuple[int, int, int]:
        """(requests waiting, images waiting, requests running)."""
        with self.cond:
            return len(self.queued), len(self.pending), len(self.running)

    def alive(self) -> bool:
        """Whether the worker thread runs (a health check: a dead worker would hang every request)."""
        return self._thread.is_alive() or not self._thread.ident

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued (nobody waits for cancelled work), then end the worker."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _loop(self) -> None:
        if self.cfg.warm_up:
            warmup.run(self, self.cfg.warm_up, self._warm_items)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            except BaseException as e:  # never let the worker die: that would hang every request
                log.exception("worker: unexpected error")
                err = APIError(
                    500, f"internal error: {type(e).__name__} (see the server log)", code="internal_error"
                )
                for job in {it.job for it in batch}:
                    self._finish(job, err)
            finally:
                with self.cond:
                    for job in {it.job for it in batch}:
                        if job.done >= job.params.n or job.cancelled:
                            self.running.discard(job)

    def _warm_items(self, p: Params, loras: tuple, loop) -> list[Item]:
        """The items of a warm-up request (`warmup.run`): a job on a loop nobody runs."""
        job = Job(p, loop, kind="t2i", loras=loras, per_row=self._rows is not None)
        return [Item(job, i) for i in range(p.n)]

    def _next_batch(self) -> list[Item] | None:
        with self.cond:
            while True:
                while not self.pending:
                    if self.stopping:
                        return None
                    self.cond.wait()
                first = self._first()
                key, limit = first.job.key, self._limit(first)
                deadline = first.job.enqueued + self.cfg.batch_wait_s
                while not self.stopping and not first.job.cancelled:
                    n = sum(1 for it in self.pending if it.job.key == key)
                    now = time.monotonic()
                    if n >= limit or now >= deadline:
                        break
                    self.cond.wait(deadline - now)
                if self.pending:  # a shorter request may have come while this one waited: pick again
                    first = self._first()
                    key, limit = first.job.key, self._limit(first)
                take = self._take(key, limit)
                if not take:  # the first request was cancelled while waiting for batch-mates
                    continue
                return take

    def _limit(self, first: Item) -> int:
        """How many images a batch started by `first` may take: text-to-image batches (`max_cfg_batch` with
        true CFG, when set), other tasks run alone."""
        if first.job.kind != "t2i":
            return 1
        cap = self.cfg.max_cfg_batch if true_cfg(first.job.params) else None
        return self.cfg.max_batch if cap is None else min(cap, self.cfg.max_batch)

    def _first(self) -> Item:
        """The next batch's first item (hold `cond`): fewest steps, then oldest; the oldest once it has
        waited `age_bound_s` (pending is in arrival order)."""
        oldest = self.pending[0]
        if time.monotonic() - oldest.job.enqueued >= self.cfg.age_bound_s:
            return oldest
        return min(self.pending, key=lambda it: (it.job.params.steps, it.job.enqueued))

    def _take(self, key: tuple, limit: int) -> list[Item]:
        """Up to `limit` pending items of batch `key`, in arrival order, moved to running (hold `cond`); with
        CUDA graphs a power of two of them (`_graph_sizes`)."""
        if self._graph_sizes():
            n = min(limit, sum(1 for it in self.pending if it.job.key == key))
            limit = 1 << (n.bit_length() - 1) if n else 0
        take, rest = [], deque()
        for it in self.pending:
            (take if len(take) < limit and it.job.key == key else rest).append(it)
        self.pending = rest
        for job in {it.job for it in take}:
            self.queued.discard(job)
            self.running.add(job)
        return take

    def _graph_sizes(self) -> bool:
        """Whether batches run at 1, 2, 4 or 8 images (a power of two, up to `max_batch`): with CUDA graphs
        each batch size of a shape is a graph of its own, captured the first time it runs (a few forwards'
        time, during which nothing else runs, and an eager forward's memory on top). Three same-shape
        requests run as two and one: two graphs that the same load needs anyway, instead of a third one
        (a mixed load's timed pass that captured 7 graphs spent about an eighth of its time on them)."""
        return bool(self.pipe.options.cuda_graphs) and self.pipe.device.type == "cuda"

    def _interleave(self, job0: Job, rows0: int, remaining: int) -> None:
        """Between two steps of a running text-to-image batch of `rows0` images (its step callback): run the
        waiting batches of shorter requests to the end first, so that a 4-step request is not held for a
        50-step batch's whole run. Policy (`pace.may_run_inside`, in GPU work): among pending text-to-image
        requests that are less work than each image of the running batch has left (Smith's rule), or have
        fewer steps than it and are less work than it has left in all (short requests first), the fewest
        steps first (then the oldest), batch after batch while any waits (requests of other sizes or step
        counts make batches of their own: running only one of them per step of the long batch held each of
        the others for that step too); `nesting` levels deep (an 8-step batch run inside a 50-step one lets
        a 4-step one run inside it in turn: with one level, a 4-step request waited for the 8-step batch's
        whole run); and none once the running batch has been paused `age_bound_s` in all, so a stream of
        short requests slows a long batch by a bounded time (that bound plus the nested batches under way).
        The pauses count, not the long batch's wait in the queue: under a saturating load long requests
        have often waited that long already, and bounding by their age then held every short request for a
        long batch's whole run (the mixed soak's 4-step p95). Only what cannot disturb the running batch:
        the same LoRA set (any with --row-loras: each forward selects its rows), no step cache for the
        short batch (a running batch's step cache is bypassed for it and its state left alone:
        `pipe.step_cache_bypassed`), one process (not --parallel). Same images as batches run one after
        the other."""
        o = self.pipe.options
        # (--parallel: the followers run rank 0's calls in order; a call inside a call would deadlock them)
        if self._depth >= self.nesting or not self.cfg.interleave or o.parallel is not None:
            return
        if self.warm_state is not None and not self.warm_state["done"]:  # requests wait for the warm-up
            return
        while job0.paused_s < self.cfg.age_bound_s:  # until the long batch has yielded enough
            with self.cond:
                ok = [it for it in self.pending if self._can_interleave(it.job, job0, rows0, remaining)]
                if not ok:
                    return
                first = min(ok, key=lambda it: (it.job.params.steps, it.job.enqueued))
                take = self._take(first.job.key, self._limit(first))
            self._depth += 1
            self.metrics.interleaved += 1
            t0 = time.monotonic()
            try:
                with self.pipe.step_cache_bypassed() if o.cache is not None else contextlib.nullcontext():
                    self._run(take)
            finally:
                self._depth -= 1
                job0.paused_s += time.monotonic() - t0
                with self.cond:
                    for job in {it.job for it in take}:
                        if job.done >= job.params.n or job.cancelled:
                            self.running.discard(job)

    def _can_interleave(self, job: Job, job0: Job, rows0: int, left: int) -> bool:
        """Whether `job` may run now inside `job0`'s batch of `rows0` images with `left` steps to go."""
        c = job.params.cache
        cache = self._default_cache if c is None else (None if c == "off" else c)
        return (
            job.kind == "t2i"
            and not job.cancelled
            and may_run_inside(job.params, job0.params, rows0, left)
            and cache is None
            and (self._rows is not None or job.loras == job0.loras)
        )

    def _run(self, items: list[Item]) -> None:
        jobs = list(dict.fromkeys(it.job for it in items))
        t0 = time.perf_counter()
        for job in jobs:
            if job.started is None:
                job.started = time.monotonic()
            job.post({"type": "image_generation.started", "batch_size": len(items)})
        items = self._load_row_loras(items)
        if not items:
            return
        try:
            images = self._generate(items)
        except Cancelled:
            log.info("batch of %d cancelled: every client went away", len(items))
            return
        except APIError as e:  # e.g. a broken LoRA file: the same answer for every batch-mate
            for job in jobs:
                self._finish(job, e)
            return
        except Exception as e:
            self._empty_cache()
            if len(jobs) > 1:  # find the culprit: one bad request must not fail its batch-mates
                log.warning(
                    "batch of %d failed (%s: %s); retrying its requests one by one",
                    len(items),
                    type(e).__name__,
                    e,
                )
                for job in jobs:
                    self._run([it for it in items if it.job is job])
                return
            log.exception("generation failed")
            # the exception's text stays in the log: it may name files on this host
            self._finish(
                jobs[0],
                APIError(
                    500,
                    f"generation failed ({type(e).__name__}); the server log has the details",
                    code="generation_failed",
                ),
            )
            return
        dt = time.perf_counter() - t0
        self.avg_batch_s = 0.8 * self.avg_batch_s + 0.2 * dt
        p = items[0].job.params
        self.metrics.batch(len(items), dt, (p.steps, p.width, p.height, self._depth))
        for it, img in zip(items, images):
            job = it.job
            job.results[it.index] = img
            job.done += 1
            if job.done == job.params.n:
                self._finish(job, list(job.results))

    def _finish(self, job: Job, result) -> None:
        """Leave the running set first, so that a client that has its answer sees the queue as it is."""
        with self.cond:
            self.running.discard(job)
        job.finish(result)

    def _empty_cache(self) -> None:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - best effort
            pass

    def _load_row_loras(self, items: list[Item]) -> list[Item]:
        """Per-row LoRAs: read each request's adapters before the batch runs, so that a broken file fails
        its own requests (400 invalid_lora) and not their batch-mates; returns the items that can run."""
        if self._rows is None:
            return items
        keep = frozenset(Path(path).stem for it in items if it.job.kind == "t2i" for path, _ in it.job.loras)
        ok = []
        for job in dict.fromkeys(it.job for it in items):
            try:
                if job.kind == "t2i":
                    for path, _ in job.loras:
                        self._rows.put(Path(path).stem, path, keep=keep)
            except Exception as e:  # noqa: BLE001 - a LoRA that cannot be read fails its request only
                log.error("LoRA of request %s could not be loaded: %s: %s", job.id, type(e).__name__, e)
                self._finish(
                    job,
                    APIError(
                        400,
                        f"LoRA {', '.join(repr(Path(p).stem) for p, _ in job.loras)} could not be loaded: "
                        "the file in the server's LoRA folder is not a LoRA this model can run per request "
                        "(the server log says why)",
                        param="lora",
                        code="invalid_lora",
                    ),
                )
                continue
            ok += [it for it in items if it.job is job]
        return ok

    def _apply_loras(self, loras: tuple) -> None:
        """`pipe.set_loras([(path, strength), ...])` when the batch's LoRA set differs from the last."""
        if self._rows is not None:  # per-row LoRAs: text-to-image passes them per row (`_generate`)
            if loras:
                raise APIError(
                    400,
                    "this server runs LoRAs per request for text-to-image only (--row-loras); "
                    "this task cannot use a LoRA here",
                    param="lora",
                    code="lora_not_supported",
                )
            return
        if loras == self._loras:
            return
        if not self._lora:
            if loras:  # the app refuses such requests earlier; a bug if reached
                raise RuntimeError("this pipeline applies no LoRAs")
            return
        try:
            self.pipe.set_loras(list(loras))
        except Exception as e:
            self._loras = None  # re-apply next time whatever the pipeline kept
            names = [Path(path).stem for path, _ in loras]
            bad = [Path(path).stem for path, _ in loras if Path(path).name in str(e)] or names
            log.error("LoRA set %s could not be applied: %s: %s", [p for p, _ in loras], type(e).__name__, e)
            raise APIError(
                400,
                f"LoRA {', '.join(repr(n) for n in bad)} could not be loaded: the file in the "
                "server's LoRA folder is not a valid LoRA (the server log says why)",
                param="lora",
                code="invalid_lora",
            ) from None
        self._loras = loras

    def _apply_cache(self, cache: str | None) -> None:
        """The batch's step-cache preset (requests batch only with the same one); None = the server's."""
        want = self._default_cache if cache is None else (None if cache == "off" else cache)
        if self.pipe.options.cache != want:
            self.pipe.configure(cache=want)

    def _generate(self, items: list[Item]) -> list:
        """Run one batch through the pipeline's public call; PIL images, one per item."""
        import torch

        job0 = items[0].job
        p = job0.params
        jobs = list(dict.fromkeys(it.job for it in items))
        rows = self._rows is not None and job0.kind == "t2i"
        if not rows:
            self._apply_loras(job0.loras)
        if not self._depth:  # a nested batch has no cache of its own (`_can_interleave`)
            self._apply_cache(p.cache)
        # previews only for clients that stream: nobody else would receive them (a decode each)
        preview_at = {
            job: _preview_steps(job.params.steps, job.params.partial_images if job.events else 0)
            for job in jobs
        }
        sent = {job: 0 for job in jobs}
        # blocking events: the worker sleeps while it waits instead of spinning a core the event loop's
        # image encoding can use
        cuda = self.pipe.device.type == "cuda"
        pace = StepPace((lambda: torch.cuda.Event(blocking=True)) if cuda else None)

        def callback(i: int, n: int, x) -> None:
            pace()  # decide (and report progress) at most `lag` steps ahead of the GPU
            if all(j.cancelled for j in jobs):
                raise Cancelled
            for job in jobs:
                job.post({"type": "image_generation.progress", "step": i + 1, "steps": n})
            if job0.kind == "t2i":
                self._interleave(job0, len(items), n - i - 1)
            rows = [r for r, it in enumerate(items) if i in preview_at[it.job] and not it.job.cancelled]
            if rows and not p.size_auto:
                try:
                    previews = self.pipe.preview_images(x[rows], p.height, p.width, self.cfg.preview_px)
                except Exception as e:  # a preview must never break the image
                    log.warning("preview failed: %s", e)
                    return
                for r, im in zip(rows, previews):
                    it = items[r]
                    it.job.post(
                        {
                            "type": "image_generation.partial_image",
                            "b64_json": jpeg_b64(im),
                            "index": it.index,
                            "partial_image_index": sent[it.job],
                            "step": i + 1,
                            "steps": n,
                        }
                    )
                for job in {items[r].job for r in rows}:
                    sent[job] += 1

        gens = [torch.Generator("cpu").manual_seed(it.job.seeds[it.index]) for it in items]
        common = dict(num_inference_steps=p.steps, true_cfg_scale=p.cfg, callback=callback, output_type="pil")
        if job0.kind == "edit":
            out = []
            for it, g in zip(items, gens):
                hw = {} if p.size_auto else {"height": p.height, "width": p.width}
                out += self.pipe(
                    image=it.job.images,
                    prompt=p.prompt,
                    negative_prompt=p.negative,
                    generator=g,
                    **hw,
                    **common,
                ).images
            return out
        if job0.kind != "t2i":  # img2img, inpaint, edit-inpaint: the loaded model under that task's class
            run, out = self.pipe.for_task(job0.kind), []
            mask = {} if job0.mask is None else {"mask_image": job0.mask}
            for it, g in zip(items, gens):
                out += run(
                    image=it.job.images[0],
                    prompt=p.prompt,
                    negative_prompt=p.negative,
                    generator=g,
                    height=p.height,
                    width=p.width,
                    strength=p.strength,
                    **mask,
                    **common,
                ).images
            return out
        prompts = [it.job.params.prompt for it in items]
        negs = [it.job.params.negative for it in items] if p.negative is not None else None
        # decode_per_image (load_pipeline): each image equals its request run alone
        per_row = {"loras": [[(Path(f).stem, s) for f, s in it.job.loras] for it in items]} if rows else {}
        return self.pipe(
            prompt=prompts,
            negative_prompt=negs,
            height=p.height,
            width=p.width,
            generator=gens,
            **common,
            **per_row,
        ).images


def _preview_steps(steps: int, k: int) -> set[int]:
    """Step indices (0-based) after which to send the k partial images, evenly spread, never the last."""
    if k <= 0 or steps < 2:
        return set()
    return {min(steps - 2, max(0, round(j * steps / (k + 1)) - 1)) for j in range(1, k + 1)}
