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
from dataclasses import dataclass
from pathlib import Path

from .schemas import Params

log = logging.getLogger("qwenfast.server")

PROMPT = "a warm-up image"  # a short prompt: the first text bucket


@dataclass(frozen=True)
class Shape:
    """One warm-up batch: `n` images of one size, true-CFG scale, step-cache preset and LoRA (a path or
    None), `steps` steps (six with a cache: its first, full and cached steps; one without)."""

    width: int
    height: int
    cfg: float
    cache: str | None
    lora: str | None
    n: int
    steps: int


def shapes(
    sizes,
    kinds: list[tuple[float, str | None]],
    max_batch: int,
    lora: str | None,
    cfg_batch: int | None = None,
) -> list[Shape]:
    """THE warm-up order (the server's `plan` and the serve benchmark's `shapes_warm`): sizes largest first;
    for each, the (CFG scale, cache preset) `kinds` in their order, each without and then with `lora`, at
    batch sizes the powers of two up to `max_batch` (up to `cfg_batch` with true CFG, when given), largest
    first (see the module docstring for why largest)."""
    out = []
    for w, h in sorted(dict.fromkeys(sizes), key=lambda s: -s[0] * s[1]):
        for cfg, cache in kinds:
            top = max_batch if cfg <= 1 or cfg_batch is None else min(max_batch, cfg_batch)
            for lo in (None, lora) if lora else (None,):
                for i in reversed(range(top.bit_length())):
                    out.append(Shape(w, h, cfg, cache, lo, 1 << i, 6 if cache else 1))
    return out


def plan(
    sizes: tuple[tuple[int, int], ...],
    max_batch: int,
    cfg: float,
    cache: str | None,
    lora: str | None,
    cfg_batch: int | None = None,
) -> list[tuple[Params, tuple]]:
    """The server's warm-up batches in the order they run: (the request's parameters with n = the batch
    size, its LoRAs as a job holds them, ((path, strength),) or ()). `cfg`: the model's default true-CFG
    scale (with the blank negative prompt a request without one gets); `cache`: the server's step-cache
    preset (None: off; the requests leave theirs unset, so the server's applies); `lora`: a path in the
    LoRA folder or None; `cfg_batch`: the largest true-CFG batch (`--max-cfg-batch`; None: `max_batch`)."""
    kinds = ([(cfg, cache)] if cfg > 1 else []) + [(1.0, cache)]
    return [
        (
            Params(PROMPT, " " if s.cfg > 1 else None, s.width, s.height, s.steps, cfg=s.cfg, n=s.n, seed=0),
            ((s.lora, 1.0),) if s.lora else (),
        )
        for s in shapes(sizes, kinds, max_batch, lora, cfg_batch)
    ]


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
    todo = plan(sizes, sched.cfg.max_batch, cfg, sched._default_cache, lora, sched.cfg.max_cfg_batch)
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
