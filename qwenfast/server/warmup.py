"""`qwenfast serve --warm-up SIZES`: every batch shape the server will run, once, before it serves.

Why: with CUDA graphs (`--cuda-graphs`) each shape a forward can take (size, batch size, CFG on or off,
step-cache variant, with or without a per-row LoRA) is a graph of its own, captured the first time a batch
of that shape runs: a few eager forwards during which nothing else runs, with an eager forward's working
memory on top of the floor. Under load that is a stall for every request waiting and a peak in memory
(an 8-minute H100 soak that met its shapes during the load: allocated memory spread by GBs while its floor
stayed within a few tenths). Warming them first moves all of that to start-up.

The plan (`plan`): sizes largest first (the step cache's buffers are sized by the first shape that needs
them, and a later larger one would make every graph captured before unusable: runtime/cache.py); for
each, the request defaults (the model's CFG with the blank negative prompt a request without one gets,
the server's `--cache`) and no CFG (the 4- and 8-step Lightning requests); with per-row LoRAs
(`--row-loras`) each once without and once with one adapter (the first in `--lora-dir` by name); batch
sizes the powers of two up to `--max-batch`, largest first (under CUDA graphs batches take a power of two
of their images: `Scheduler._take`). One step without a step cache, six with one (its first, full and
cached steps). The prompt is a short one: graphs are keyed by the text's padded length, so give
`--text-bucket` for one graph per bucket of prompt lengths.

It runs on the worker thread before the first batch, through the same path as requests
(`Scheduler._generate`); requests that come meanwhile wait in the queue. `/health` shows `warm_up`
(batches done of planned, failures, seconds). A batch that fails is logged and skipped: a warm-up never
keeps a server from serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from .schemas import Params

log = logging.getLogger("qwenfast.server")

PROMPT = "a warm-up image"  # a short prompt: the first text bucket


def plan(
    sizes: tuple[tuple[int, int], ...],
    max_batch: int,
    cfg: float,
    cache: str | None,
    lora: str | None,
) -> list[tuple[Params, tuple]]:
    """The warm-up batches in the order they run: (the request's parameters with n = the batch size, its
    LoRAs as a job holds them, ((path, strength),) or ()). `cfg`: the model's default true-CFG scale;
    `cache`: the server's step-cache preset (None: off); `lora`: a path in the LoRA folder or None."""
    kinds = [(cfg, " ")] if cfg > 1 else []
    kinds.append((1.0, None))
    batches = [1 << i for i in reversed(range(max_batch.bit_length()))]
    loras = [()] + ([((lora, 1.0),)] if lora else [])
    out = []
    for w, h in sorted(sizes, key=lambda s: -s[0] * s[1]):
        for c, negative in kinds:
            for lo in loras:
                for b in batches:
                    steps = 6 if cache else 1
                    p = Params(PROMPT, negative, w, h, steps, cfg=c, n=b, seed=0)
                    out.append((p, lo))
    return out


def first_lora(folder: str | None) -> str | None:
    """The first `.safetensors` file of the LoRA folder (sorted by name), or None."""
    if not folder:
        return None
    try:
        files = sorted(Path(folder).glob("*.safetensors"))
    except OSError:
        return None
    return str(files[0]) if files else None


def run(sched, sizes: tuple[tuple[int, int], ...], items_of) -> dict:
    """Run the plan on `sched` (a `batcher.Scheduler`, from its worker thread); `items_of(params, loras,
    loop)`: the batch items of one request made of them (the scheduler's own job type). Returns what
    `/health` shows, kept up to date in `sched.warm_state` while it runs."""
    rows = sched._rows is not None
    lora = first_lora(sched.cfg.lora_dir) if rows else None
    cfg = float(sched.pipe.defaults.get("true_cfg_scale", 1.0))
    todo = plan(sizes, sched.cfg.max_batch, cfg, sched._default_cache, lora)
    state = sched.warm_state  # (made by the scheduler, so /health shows the warm-up from the start)
    state["of"] = len(todo)
    loop = asyncio.new_event_loop()  # the jobs' futures belong to a loop nobody runs: no one awaits them
    t0 = time.monotonic()
    try:
        for p, lo in todo:
            items = items_of(p, lo, loop)
            try:
                if sched._load_row_loras(items):
                    sched._generate(items)
                else:
                    state["failed"] += 1
            except Exception as e:  # noqa: BLE001 - a warm-up never keeps the server from serving
                state["failed"] += 1
                log.warning(
                    "warm-up batch %dx%d x%d failed: %s: %s", p.width, p.height, p.n, type(e).__name__, e
                )
                sched._empty_cache()
            state["batches"] += 1
            state["s"] = round(time.monotonic() - t0, 1)
            if sched.stopping:
                break
    finally:
        loop.close()
        state["done"] = True
    log.info("warm-up: %d batches in %.1f s (%d failed)", state["batches"], state["s"], state["failed"])
    return state
