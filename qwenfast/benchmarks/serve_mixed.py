"""`qwenfast bench serve --workload mixed`: many users on one GPU, each with their own size, step count,
LoRA and step cache, against the same workload through the old batcher and a plain diffusers loop.

The workload (`workload`, seeded): sizes 1024² (55%), 1328², 928x1664 and 1664x928 (15% each); 4-step
(50%) and 8-step (40%) requests without CFG, as with Lightning LoRAs, and 50-step true-CFG requests
(10%, half of them with the `fast` step cache: a 50-step CFG request costs ~25 times a 4-step one); each request names one of `--loras` random LoRAs
(rank 32 or 64 on every block Linear, diffusers names, written to a folder first) or none, at a strength
in 0.6..1; 30% stream (SSE, with progress events), 5% of the clients hang up mid-request (after the
first event, or after 0.3 s without streaming).

Closed loop at each concurrency c: c client threads take the next request of the sequence, wait for its
answer, take the next. Each level runs its requests twice and times the second pass: the first captures
the CUDA graphs and loads the adapters its shapes, batches and LoRAs need (a few dozen captures in a
one-minute level), so the figures are a warmed server's, as in service; the first pass's captures are
recorded too (`warm_captures`); `--warm-shapes` runs every shape the load can make once before a server's
first level or the soak (`shapes_warm`: what a deployment's warm-up would send). Figures per level:
images/min, p50/p95 latency per class (queue included), the answers by status, the GPU memory sampled
every 0.5 s, graph captures, adapter loads/evictions, batches run between two steps of a longer one.
Rows, in one run on one GPU with the same weights:

- `per-row`: `--row-loras` (each request its LoRA inside any batch) with step-boundary interleaving;
- `old batcher`: the LoRA set in the batch key (one LoRA group at a time, `set_loras` between batches),
  no interleaving: what the server did before;
- `diffusers loop` (`--diffusers-s S`): diffusers' QwenImagePipeline in bf16 with the same LoRAs loaded
  as PEFT adapters, one request at a time for S seconds (what a user would write); images/min only.

Also measured: each class's idle latency (one request alone, warm), and the per-row LoRA overhead of one
transformer forward (batch 4 at 1024², four different rank-64 LoRAs, and all rows without one) against
the same forward with no adapters installed.

`--duration S` turns it into a soak: the per-row server at the top concurrency for S seconds, after a
warm-up: with `--warm-shapes` that pass alone (what a deployment's `--warm-up` sends; ~3 minutes on an
H100 at full size, so that the build, the warm-up and a 4-minute soak fit one 10-minute device call),
else its first requests once (twice a level's count, untimed, as a level's first pass); halfway a
broken LoRA file is dropped into the folder and some requests name it (answered 400 invalid_lora);
the record says whether anything answered 5xx, was lost (sent but never answered), or was answered twice
(the server's 200 count against the clients'), and how far allocated memory moved after the warm-up.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import clients
from .clients import MemorySampler, memory_windows, quantile

SIZES_FULL = [((1024, 1024), 0.55), ((1328, 1328), 0.15), ((928, 1664), 0.15), ((1664, 928), 0.15)]
SIZES_DEMO = [((128, 128), 0.55), ((144, 144), 0.15), ((96, 160), 0.15), ((160, 96), 0.15)]  # its own scale
CLASSES = {  # name -> (steps, true CFG, step cache, share)
    "4-step": (4, 1.0, None, 0.50),
    "8-step": (8, 1.0, None, 0.40),
    "50-step": (50, 4.0, None, 0.05),
    "50-step fast": (50, 4.0, "fast", 0.05),
}
# the servers' --max-cfg-batch, and the largest true-CFG batch the warm-up runs: two images (two forwards a step
# each: two fill the GPU at these sizes). Uncapped, 50-step requests queued behind short ones could form
# batches the warm-up never ran, and a larger batch with a step cache grows the cache's buffers, which makes
# every graph captured with a cache unusable (an H100 soak that warmed up to two, uncapped, captured 12 graphs
# during the load, each with an eager forward's memory above the floor; `graphs_dropped_stale` now counts)
CFG_BATCH = 2
# timed requests per level at least (3 per client above that): ~20 of them 4-step, for a p95
LEVEL_REQUESTS = 40
PROMPTS = [
    "a watercolor painting of a lighthouse at dawn",
    "a red fox in deep snow, telephoto",
    "isometric pixel art of a tiny bakery with a striped awning",
    'a poster that says "OPEN LATE" in bold neon letters',
    "macro photo of dew on a spider web",
    "an astronaut riding a horse on the moon, oil painting, dramatic light",
]


@dataclass
class Req:
    k: int
    cls: str
    width: int
    height: int
    steps: int
    cfg: float
    cache: str | None
    lora: str | None
    strength: float
    prompt: str
    seed: int
    stream: bool
    hang_up: bool


def workload(n: int, seed: int, loras: list[str], demo: bool = False) -> list[Req]:
    """The seeded request sequence (see the module docstring); `demo`: the embedded model's sizes."""
    rng = random.Random(seed)
    sizes = SIZES_DEMO if demo else SIZES_FULL
    out = []
    for k in range(n):
        (w, h) = rng.choices([s for s, _ in sizes], [p for _, p in sizes])[0]
        cls = rng.choices(list(CLASSES), [c[3] for c in CLASSES.values()])[0]
        steps, cfg, cache, _ = CLASSES[cls]
        lora = rng.choice([*loras, None])
        out.append(
            Req(
                k,
                cls,
                w,
                h,
                steps,
                cfg,
                cache,
                lora,
                round(rng.uniform(0.6, 1.0), 2),
                rng.choice(PROMPTS),
                1000 + k,
                rng.random() < 0.3,
                rng.random() < 0.05,
            )
        )
    return out


def body(r: Req) -> dict:
    b = {
        "prompt": r.prompt,
        "size": f"{r.width}x{r.height}",
        "steps": r.steps,
        "true_cfg_scale": r.cfg,
        "seed": r.seed,
        "cache": r.cache or "off",
    }
    if r.lora:
        b["lora"] = [{"name": r.lora, "strength": r.strength}]
    if r.stream:
        b.update(stream=True, progress=True)
    return b


def send(base: str, r: Req, timeout: float = 3600) -> tuple[str, float]:
    """One request -> (outcome, seconds): "200", another status, "hung up" (on purpose) or "error: ..."."""
    req = urllib.request.Request(
        base + "/v1/images/generations",
        data=json.dumps(body(r)).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=0.3 if r.hang_up and not r.stream else timeout) as resp:
            if not r.stream:
                ok = len(json.loads(resp.read())["data"]) == 1
                return ("200" if ok else "error: no image"), time.perf_counter() - t
            outcome = "error: stream ended early"
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                if r.hang_up:
                    return "hung up", time.perf_counter() - t  # closing the response drops the connection
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if ev["type"] == "image_generation.completed":
                    outcome = "200"
                elif ev["type"] == "error":
                    code = ev["error"].get("code")
                    outcome = {"invalid_lora": "400", "timeout": "504"}.get(code, f"stream error {code}")
            return outcome, time.perf_counter() - t
    except urllib.error.HTTPError as e:
        return str(e.code), time.perf_counter() - t
    except TimeoutError:
        if r.hang_up:
            return "hung up", time.perf_counter() - t
        return "error: timeout", time.perf_counter() - t
    except (urllib.error.URLError, OSError) as e:
        if r.hang_up and "timed out" in str(e):
            return "hung up", time.perf_counter() - t
        return f"error: {type(e).__name__}: {e}", time.perf_counter() - t


def closed_loop(base: str, reqs: list[Req], c: int, stop_at: float | None = None, hook=None) -> list[dict]:
    """c clients through `reqs` in order (until `stop_at`, a perf_counter time, if given); one dict per
    request sent: its class, outcome, latency. `hook(r)` runs as request r is taken (the soak's drop)."""

    def one(r: Req) -> dict:
        t = time.monotonic()
        outcome, s = send(base, r)
        return {
            "t": t,
            "k": r.k,
            "cls": r.cls,
            "outcome": outcome,
            "s": s,
            "lora": r.lora,
            "size": f"{r.width}x{r.height}",
        }

    return clients.closed_loop(reqs, c, one, stop_at, take=hook)


def summarise(rows: list[dict], wall: float) -> dict:
    """Per-level figures from the per-request dicts of `closed_loop`."""
    done = [r for r in rows if r["outcome"] == "200"]
    by = {}
    for cls in CLASSES:
        lat = sorted(r["s"] for r in done if r["cls"] == cls)
        if lat:
            sizes: dict[str, int] = {}
            for r in done:
                if r["cls"] == cls and "size" in r:
                    sizes[r["size"]] = sizes.get(r["size"], 0) + 1
            by[cls] = {
                "n": len(lat),
                "p50_s": round(quantile(lat, 0.5), 3),
                "p95_s": round(quantile(lat, 0.95), 3),
                "sizes": sizes,  # how many of them at each size (the idle ratio's matched mix)
            }
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "sent": len(rows),
        "images": len(done),
        "wall_s": round(wall, 2),
        "images_per_min": round(60 * len(done) / wall, 2),
        "classes": by,
        "outcomes": outcomes,
        "server_errors": sum(v for k, v in outcomes.items() if k.startswith("5") or k.startswith("error")),
    }


def phase_means(before: dict, after: dict) -> dict[str, float]:
    """Mean seconds per request of each phase between two `phase_sums`."""
    out = {}
    for ph, (s, n) in after.items():
        s0, n0 = before.get(ph, (0.0, 0))
        if n > n0:
            out[ph] = round((s - s0) / (n - n0), 3)
    return out


def level(
    app, pipe, base: str, reqs: list[Req], c: int, stop_at: float | None = None, hook=None, warm: bool = False
) -> dict:
    """One closed-loop level against a running server, with the server-side counters it moved; `warm`:
    the same requests once untimed first (see the module docstring)."""
    w0, tw = pipe.graph_stats()["captures"], time.monotonic()
    if warm:
        closed_loop(base, reqs, c)
    warm_captures = pipe.graph_stats()["captures"] - w0
    m = app.state.metrics
    ph0 = m.phase_sums("generations")
    g0 = pipe.graph_stats()
    before = (dict(m.requests), m.interleaved, m.batch_size.count, m.batch_size.sum)
    rows_ = pipe.row_loras
    ad0 = (rows_.loads, rows_.evictions) if rows_ is not None else (0, 0)
    t0, m0 = time.perf_counter(), time.monotonic()
    rows = closed_loop(base, reqs, c, stop_at, hook)
    wall = time.perf_counter() - t0
    res = {"concurrency": c, **summarise(rows, wall)}
    if stop_at is None:  # (levels, not the soak) what each request and batch did, for the p95's why
        with m.lock:  # (the worker thread appends to it)
            log = list(m.batch_log)
        res["trace"] = _trace(rows, log, m0)
    if warm:
        res["warm_captures"] = warm_captures
    ok_server = sum(v for (ep, st), v in m.requests.items() if st == 200) - sum(
        v for (ep, st), v in before[0].items() if st == 200
    )
    res["server_200"] = ok_server  # against the clients' 200s: a duplicate or a lost answer shows here
    res["interleaved"] = m.interleaved - before[1]
    res["mean_batch"] = round((m.batch_size.sum - before[3]) / max(1, m.batch_size.count - before[2]), 2)
    g = pipe.graph_stats()
    res["graph_captures"], res["graph_replays"] = g["captures"] - g0["captures"], g["replays"] - g0["replays"]
    res["graphs_resident"] = g["resident"]
    res["graphs_dropped_stale"] = g["stale"] - g0["stale"]  # a step cache's buffers grew during the load
    res["decode_captures"] = g["decode_captures"] - g0["decode_captures"]
    res["decode_graphs_resident"] = g["decode_resident"]
    # each graph the load captured: [s from the pass's start, shapes and variant, allocated GiB before, after]
    log = [
        [round(t - m0, 1), what, round(a, 2), round(b, 2)] for t, what, a, b in g.get("log", ()) if t >= tw
    ]
    res["captured"] = [c for c in log if c[0] >= 0]
    if warm:  # the untimed first pass's (negative times)
        res["warm_captured"] = [c for c in log if c[0] < 0]
    res["server_phases_s"] = phase_means(ph0, m.phase_sums("generations"))  # mean per successful request
    if rows_ is not None:
        res["adapter_loads"], res["adapter_evictions"] = rows_.loads - ad0[0], rows_.evictions - ad0[1]
    return res


def _trace(rows: list[dict], log, m0: float) -> dict:
    """The timed pass as it ran: requests [sent s, class, size, latency s, outcome] and the server's batches
    [start s, seconds, images, steps, size, depth (1: run between two steps of another batch)], times from
    the pass's start (one clock: time.monotonic)."""
    reqs = sorted([round(r["t"] - m0, 2), r["cls"], r["size"], round(r["s"], 2), r["outcome"]] for r in rows)
    batches = []
    for end, dt, n, *what in log:
        if end - dt >= m0:
            steps, w, h, depth = what
            batches.append([round(end - dt - m0, 2), round(dt, 2), n, steps, f"{w}x{h}", depth])
    return {"requests": reqs, "batches": batches}


def print_level(name: str, r: dict) -> None:
    cls = "  ".join(f"{k} {v['p50_s']:.2f}/{v['p95_s']:.2f}s" for k, v in r["classes"].items())
    print(
        f"  {name:<12} c={r['concurrency']:<3} {r['images_per_min']:7.1f} img/min  batch {r['mean_batch']:.2f}  "
        f"interleaved {r['interleaved']}  captures {r['graph_captures']}  outcomes {r['outcomes']}\n"
        f"               p50/p95: {cls}"
    )


def json_default(o):
    return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)


def run(
    model: str | None = None,
    concurrency: tuple[int, ...] = (4, 8, 16),
    requests: int | None = None,
    n_loras: int = 10,
    slots: int | None = None,
    old_concurrency: tuple[int, ...] = (8,),
    diffusers_s: float = 0.0,
    duration: float | None = None,
    weights: str = "fp8",
    cuda_graphs: bool = True,
    graph_slots: int | None = None,
    text_bucket: int = 0,
    max_batch: int = 8,
    device=None,
    dtype=None,
    seed: int = 0,
    lora_folder: str | None = None,
    out_dir: Path | None = None,
    warm_shapes: bool = False,
) -> dict:
    """The mixed workload (see the module docstring); `duration`: the soak instead of the levels;
    `warm_shapes`: each server runs every shape of the load once first (`shapes_warm`)."""
    import gc
    import tempfile

    import torch

    from ..options import EngineOptions
    from ..server.app import create_app
    from ..server.options import ServerConfig
    from ..server.run import load_pipeline, start_server, stop_server
    from . import emit, versions
    from .serve_baselines import diffusers_loop, save_loras

    full = model == "random-full"
    slots_graphs = graph_slots or EngineOptions().graph_slots
    t0 = time.perf_counter()
    ref = None
    if full:
        if not torch.cuda.is_available():
            raise RuntimeError("--model random-full builds full-size weights on a CUDA GPU; none is visible")
        from .pipeline import build

        pipe, ref = build(smoke=False, diffusers_transformer=diffusers_s > 0 and duration is None)
        ref = ref if diffusers_s > 0 and duration is None else None
    else:
        pipe = load_pipeline(model, device, dtype, EngineOptions.from_env(cuda_graphs=cuda_graphs))
    folder = Path(lora_folder) if lora_folder else Path(tempfile.mkdtemp(prefix="qwenfast-loras-"))
    names = [f"lora-{i}" for i in range(n_loras)]
    if not all((folder / f"{n}.safetensors").is_file() for n in names):  # (a folder of an earlier run: kept)
        names = save_loras(folder, pipe.transformer, n_loras)
    (folder / "broken.safetensors").unlink(missing_ok=True)
    reqs = workload(20_000 if duration else max(64, 4 * max(concurrency)), seed, names, demo=not full)
    res = {
        "bench": "serve_mixed",
        "mode": "soak" if duration else "levels",
        **versions(),
        "model": model or "demo-t2i",
        "weights": weights,
        "loras": n_loras,
        "lora_ranks": [32, 64],
        "max_batch": max_batch,
        "max_cfg_batch": CFG_BATCH,
        "cuda_graphs": cuda_graphs,
        "graph_slots": slots_graphs,
        "text_bucket": text_bucket,
        "classes": {k: v[:3] for k, v in CLASSES.items()},
        "sizes": [s for s, _ in (SIZES_DEMO if not full else SIZES_FULL)],
    }
    print(f"qwenfast bench serve --workload mixed: {res['model']} ({weights}) on {res.get('gpu') or 'cpu'}")
    if ref is not None:
        res["diffusers_loop"] = diffusers_loop(ref, reqs, folder, diffusers_s)
        print(f"  diffusers loop: {res['diffusers_loop']}")
        ref = None
        gc.collect()
        torch.cuda.empty_cache()
    pipe.set_progress_bar_config(disable=True)
    pipe.configure(
        cuda_graphs=cuda_graphs,
        graph_slots=slots_graphs,
        text_bucket=text_bucket,
        decode_per_image=True,
        fp8=weights == "fp8",
        int8=weights == "int8",
    )
    res["build_s"] = round(time.perf_counter() - t0, 1)
    warm = [
        _plain(-1 - i, "4-step", _size(reqs, i), n, PROMPTS[i % len(PROMPTS)], i)
        for i, n in enumerate([*names, None])
    ]

    def server(row_loras: int, interleave: bool):
        scfg = ServerConfig(
            max_batch=max_batch,
            max_cfg_batch=CFG_BATCH,
            max_queue=4096,
            batch_wait_s=0.02,
            timeout_s=3600,
            lora_dir=str(folder),
            row_loras=row_loras,
            interleave=interleave,
        )
        app = create_app(pipe, scfg)
        return app, *start_server(app)

    with MemorySampler() as mem:
        if duration is None and old_concurrency:  # the old batcher first: per-row LoRAs stay on once enabled
            app, srv, th, base = server(0, False)
            try:
                closed_loop(base, warm, 4)
                if warm_shapes:
                    res["old_batcher_shapes_warm"] = shapes_warm(pipe, base, reqs, names[0], max_batch)
                res["old_batcher"] = []
                for c in old_concurrency:
                    r = level(app, pipe, base, reqs[: requests or max(LEVEL_REQUESTS, 3 * c)], c, warm=True)
                    res["old_batcher"].append(r)
                    print_level("old batcher", r)
            finally:
                stop_server(srv, th)
            pipe.set_loras([])
        app, srv, th, base = server(slots or n_loras, True)
        try:
            closed_loop(base, warm, len(warm) if duration else 4)
            if warm_shapes:
                res["shapes_warm"] = shapes_warm(pipe, base, reqs, names[0], max_batch)
                print(f"  shapes warmed: {res['shapes_warm']}")
            if duration is None:  # (the soak spends its time on the load)
                res["idle_s"], res["idle_server_phases_s"] = {}, {}
                for cls in ("4-step", "8-step"):
                    size = (SIZES_FULL if full else SIZES_DEMO)[0][0]
                    one = [
                        _plain(-100 - i, cls, size, names[i % len(names)], PROMPTS[0], i) for i in range(4)
                    ]
                    send(base, one[0])  # (the first may capture a graph)
                    ph0 = app.state.metrics.phase_sums("generations")
                    lat = sorted(s for _, s in (send(base, r) for r in one[1:]))
                    res["idle_s"][cls] = round(statistics.median(lat), 3)
                    res["idle_server_phases_s"][cls] = phase_means(
                        ph0, app.state.metrics.phase_sums("generations")
                    )
                res["idle_4step_by_size_s"] = _idle_by_size(base, reqs, names)
                res["idle_pipeline_s"] = _pipeline_s(
                    pipe, *(SIZES_FULL if full else SIZES_DEMO)[0][0], names[0]
                )
                print(
                    f"  idle latency (one request alone): {res['idle_s']}; the pipeline call: {res['idle_pipeline_s']}"
                    f"; in the server: {res['idle_server_phases_s']}; 4-step by size: {res['idle_4step_by_size_s']}"
                )
            else:
                if not warm_shapes:  # the soak's warm-up: its first requests once, untimed (as a level's)
                    g0 = pipe.graph_stats()["captures"]
                    closed_loop(base, reqs[: 2 * max(LEVEL_REQUESTS, 3 * max(concurrency))], max(concurrency))
                    res["warm_captures"] = pipe.graph_stats()["captures"] - g0
                # (~15 s: the soak's 4-step p95 set against the same sizes alone, as a level's)
                res["idle_4step_by_size_s"] = _idle_by_size(base, reqs, names)
            mem.mark()
            if duration is None:
                res["per_row"] = []
                for c in concurrency:
                    r = level(app, pipe, base, reqs[: requests or max(LEVEL_REQUESTS, 3 * c)], c, warm=True)
                    res["per_row"].append(r)
                    print_level("per-row", r)
                res["memory"] = mem.summary()
            else:
                res["soak"] = soak(app, pipe, base, reqs, max(concurrency), duration, folder)
                res["memory"] = mem.summary()
                res["memory"].update(memory_windows(mem))
                print(f"  soak: {json.dumps({k: v for k, v in res['soak'].items() if k != 'classes'})}")
                print(f"  memory: {json.dumps({k: v for k, v in res['memory'].items() if k != 'series'})}")
        finally:
            stop_server(srv, th)
    _verdicts(res)
    emit(res, "serve_mixed.jsonl", out_dir)
    return res


def _idle_by_size(base: str, reqs: list[Req], names: list[str]) -> dict[str, float]:
    """A 4-step request alone at each size of the mix (median of 2, after one that may capture a graph):
    what each 4-step request of a level would take on an idle server, so that its p95 under load is set
    against the idle p95 of the same sizes (the 1024² idle figure alone flatters the larger sizes' wait)."""
    out = {}
    for i, (w, h) in enumerate(dict.fromkeys((r.width, r.height) for r in reqs)):
        one = [
            _plain(-200 - 3 * i - j, "4-step", (w, h), names[j % len(names)], PROMPTS[0], j) for j in range(3)
        ]
        send(base, one[0])
        out[f"{w}x{h}"] = round(statistics.median(s for _, s in (send(base, r) for r in one[1:])), 3)
    return out


def _pipeline_s(pipe, width: int, height: int, lora: str) -> dict:
    """The 4-step request's pipeline call alone (median of 3, no HTTP, no PNG): with its LoRA, and without."""
    import torch

    out = {}
    for name, loras in (("4-step with LoRA", [[(lora, 1.0)]]), ("4-step no LoRA", [[]])):
        ts = []
        for i in range(3):
            t = time.perf_counter()
            pipe(prompt=[PROMPTS[0]], height=height, width=width, num_inference_steps=4, true_cfg_scale=1.0,
                 generator=[torch.Generator("cpu").manual_seed(i)], output_type="pil", loras=loras)  # fmt: skip
            ts.append(time.perf_counter() - t)
        out[name] = round(statistics.median(ts), 3)
    return out


def shapes_warm(
    pipe, base: str, reqs: list[Req], lora: str, max_batch: int, cfg_batch: int = CFG_BATCH
) -> dict:
    """The shapes the load gives a forward, run once before it: each size of `reqs`, each batch size a
    server with CUDA graphs makes (powers of two up to `max_batch`; up to `cfg_batch` for the true-CFG
    kinds, the servers' `max_cfg_batch`), each CFG / step-cache kind of the classes (6 steps with a
    cache: enough for its first, full and cached steps; 1 without), with a LoRA and without (adapter widths 1 and 0). B identical requests
    sent at once make a batch of B. What a deployment's warm-up would send; the load then replays graphs
    instead of capturing them (a capture runs a few eager forwards, with nothing else running and their
    working memory on top); the record's captures during the load say what it missed. In the order of the
    server's `--warm-up` (`server.warmup.shapes`: largest first, so that the step cache's buffers never
    grow after a capture; an H100 soak that warmed the smallest first captured 27 graphs again during the
    load)."""
    from ..server.warmup import shapes  # the server's --warm-up order

    g0, t0 = pipe.graph_stats(), time.perf_counter()
    kinds = sorted({(cfg, cache) for _, cfg, cache, _ in CLASSES.values()}, key=str)
    sizes = [(r.width, r.height) for r in reqs]
    k, failed, sent = -10_000, 0, 0
    for s in shapes(sizes, kinds, max_batch, lora, cfg_batch):
        one = [
            replace(
                _plain(k - i, "4-step", (s.width, s.height), s.lora, PROMPTS[0], i),
                cls="warm",
                steps=s.steps,
                cfg=s.cfg,
                cache=s.cache,
            )
            for i in range(s.n)
        ]
        k -= s.n
        sent += s.n
        failed += sum(r["outcome"] != "200" for r in closed_loop(base, one, s.n))
    g = pipe.graph_stats()
    return {
        "requests": sent,
        "failed": failed,
        "captures": g["captures"] - g0["captures"],
        "decode_captures": g["decode_captures"] - g0["decode_captures"],
        "resident": g["resident"],
        "dropped_stale": g["stale"] - g0["stale"],
        "s": round(time.perf_counter() - t0, 1),
    }


def _plain(k: int, cls: str, size: tuple[int, int], lora: str | None, prompt: str, seed: int) -> Req:
    """A request of class `cls` outside the workload (warm-up, idle timing): no CFG, no cache, no stream."""
    return Req(k, cls, *size, CLASSES[cls][0], 1.0, None, lora, 1.0, prompt, seed, False, False)


def _size(reqs: list[Req], i: int) -> tuple[int, int]:
    sizes = list(dict.fromkeys((r.width, r.height) for r in reqs))
    return sizes[i % len(sizes)]


def soak(app, pipe, base: str, reqs: list[Req], c: int, duration: float, folder: Path) -> dict:
    """The per-row server at concurrency c for `duration` s; halfway a broken LoRA file appears and every
    tenth request from then on names it."""
    t0 = time.perf_counter()
    half = t0 + duration / 2
    dropped = []

    def hook(r: Req) -> Req:
        if time.perf_counter() >= half:
            if not dropped:
                (folder / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
                dropped.append(time.perf_counter() - t0)
            if r.k % 10 == 7:
                r = Req(**{**asdict(r), "lora": "broken", "hang_up": False})
        return r

    r = level(app, pipe, base, reqs, c, stop_at=t0 + duration, hook=hook)
    out = r["outcomes"]
    r["broken_dropped_at_s"] = round(dropped[0], 1) if dropped else None
    r["lost"] = sum(v for k, v in out.items() if k.startswith("error"))
    r["fivexx"] = sum(v for k, v in out.items() if k.startswith("5"))
    r["duplicated"] = max(0, r["server_200"] - out.get("200", 0) - out.get("hung up", 0))
    return r


def _verdicts(res: dict) -> None:
    """The acceptance ratios the record should carry: per-row vs old batcher at the same concurrency,
    4-step p95 under load (each level's, the soak's) vs idle."""
    old = {r["concurrency"]: r for r in res.get("old_batcher", [])}
    for r in res.get("per_row", []) + ([res["soak"]] if "soak" in res else []):
        o = old.get(r["concurrency"])
        if o and o["images_per_min"]:
            r["x_old_batcher"] = round(r["images_per_min"] / o["images_per_min"], 2)
        d = res.get("diffusers_loop")
        if d and d["images_per_min"]:
            r["x_diffusers_loop"] = round(r["images_per_min"] / d["images_per_min"], 2)
        idle = res.get("idle_s", {}).get("4-step")
        four = r["classes"].get("4-step", {})
        p95 = four.get("p95_s")
        if idle and p95:
            r["p95_4step_x_idle"] = round(p95 / idle, 2)
        by = res.get("idle_4step_by_size_s", {})
        alone = sorted(by[k] for k, n in four.get("sizes", {}).items() for _ in range(n) if k in by)
        if p95 and alone and len(alone) == four["n"]:  # the same requests' sizes, each alone
            r["idle_4step_same_sizes_p95_s"] = round(quantile(alone, 0.95), 3)
            r["p95_4step_x_idle_same_sizes"] = round(p95 / quantile(alone, 0.95), 2)
