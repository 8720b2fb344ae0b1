"""`qwenfast bench cache-pareto`: step caching at matched quality, qwenfast's step cache against cache-dit's
DBCache on diffusers, on the demo model.

Why: a step cache trades image quality for skipped work, so a speed-up alone says nothing; what counts is
where a configuration sits on (work computed, quality kept), and whose front is higher. Both engines run
the one trained model the project has (the demo, `qwenfast/assets/demo-t2i` and `demo-edit`), same seeds,
and every configuration is scored the same way. CPU time is printed only to size the run: it is no speed
figure (step-cache speed is measured on a GPU: `qwenfast bench pipeline`, `qwenfast bench peers`).

Method:
- Suite: the first `n` items of the held-out text-to-image prompts (default 24 of 120) or edit
  instructions (default 12 of 36; 2 of each edit kind), item i with `torch.Generator("cpu").manual_seed(i)`,
  50 steps, true CFG at the model's scale (negative prompt " "), one image per call: cache-dit decides on
  the whole batch's residual, so a batch would change its decisions; one image per call is what a single
  request gets, on both engines.
- Engines, loaded from the same folder: diffusers' `QwenImagePipeline` / `QwenImageEditPlusPipeline` (the
  classes the folders' model_index.json name; the edit one with the torchvision-free processor and its
  resize areas set to the model's `image_areas` from qwenfast.json, as tools/train_demo_edit.py checks it),
  and qwenfast's pipeline (`pipeline.auto.from_pretrained`).
- cache-dit on diffusers: `cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...),
  calibrator_config=TaylorSeerCalibratorConfig(...))`, `cache_dit.disable_cache(pipe)` after each. Its
  documented settings (examples/configs/cache.yaml of the cache-dit repository: F1B0, 8 warm-up steps
  every 2nd, at most 2 cached in a row, threshold 0.12, TaylorSeer order 1, the "fast" step mask), parsed
  by its own `load_cache_config`, with and without the mask; and a sweep of `residual_diff_threshold` at
  DBCacheConfig's defaults otherwise (8 warm-up steps, no cap on cached steps), for F1B0 with and without
  TaylorSeer and, TaylorSeer on, F2B0 and F1B1 (the demo has 5 blocks: F8B0 / F4B4 do not fit; F2B0 and
  F1B1 are their analogues, a cached step still computing 2 of 5 blocks); and the documented settings
  (no mask) at other thresholds, since its warm-up every 2nd step and cap of 2 cached steps in a row
  measured better than DBCacheConfig's defaults.
- qwenfast: every `CACHE_PRESETS` entry and variations built with the public `CachePolicy` (static every
  2nd / 3rd / 6th step, a warm-up of 8 with every 2nd full then every 5th, adaptive at three
  thresholds), through `pipe.configure(cache=...)`.
- Computed fraction: `BlockCounter` puts a forward pre-hook on the first projection of each block's
  image-stream attention (`attn.to_qkv` in qwenfast, `attn.to_q` in diffusers), which both engines call
  once per block and forward, fused or not, and adds up the batch rows it sees. Every configuration runs
  block 0, so its rows are the forwards (uncached: steps x 2 per image with CFG); a forward is computed in
  full when its rows went through every block: computed fraction = min over blocks / block 0's rows.
  Block fraction = all blocks' rows / (blocks x block 0's rows), the work done, which also charges the
  Fn/Bn blocks a cached forward still runs (1/5 of a forward each here, 1/60 on the real model).
- Quality: the demo score (`demo.score`), and PSNR / SSIM of each image against the same engine's uncached
  image of the same seed (means over the suite; PSNR capped at 99 dB per image). Sanity line: PSNR of
  diffusers' uncached images against qwenfast's (the same model and seeds give the same images).
- Pareto fronts: per engine and metric (score, PSNR), the cached configurations no other of that engine
  beats, i.e. none has a lower or equal computed fraction and a higher or equal value, one of them strictly.
  Each qwenfast row gets its margin over cache-dit's front: its value minus the best cache-dit value at an
  equal or lower computed fraction (>= 0: on or above the front).

Output: a table per configuration, each engine's fronts, one JSON record (with `--results DIR` appended to
DIR/cache_pareto.jsonl). `--plot PNG` draws the figure (docs/cache-pareto.png) from the newest record of
each suite and runs nothing. About half an hour for the text-to-image suite and 20 minutes for edits on
two shared CPU cores (`--threads 1`: a second thread only contended there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import RESULTS_HELP, emit, results_dir

STEPS = 50
N_DEFAULT = {"t2i": 24, "edit": 12}  # subsets of the 120 / 36 held-out items: the run fits ~1 h on 2 cores
THRESHOLDS = (0.04, 0.08, 0.12, 0.16, 0.24, 0.32, 0.5)  # cache-dit's residual_diff_threshold sweep
PSNR_CAP = 99.0  # dB for an identical image (PSNR is infinite there)
# cache-dit's documented settings: examples/configs/cache.yaml of its repository (num_inference_steps set
# to the run's; the mask is its predefined "fast" step mask, spread over that many steps)
CACHE_DIT_DOCUMENTED = {"max_warmup_steps": 8, "warmup_interval": 2, "max_cached_steps": -1,
                        "max_continuous_cached_steps": 2, "Fn_compute_blocks": 1, "Bn_compute_blocks": 0,
                        "residual_diff_threshold": 0.12, "enable_taylorseer": True, "taylorseer_order": 1}  # fmt: skip


@dataclass(frozen=True)
class Config:
    """One configuration: engine "diffusers" or "qwenfast"; `spec`: what enables it (None: uncached)."""

    engine: str
    name: str
    spec: object = None  # qwenfast: a preset name or CachePolicy; diffusers: cache-dit settings (dict)
    params: dict = field(default_factory=dict)  # the settings as plain data, for the record


# ------------------------------------------------------------------------------ computed fraction
class BlockCounter:
    """Batch rows seen by each transformer block, counted with forward pre-hooks (the package replaces
    no module's forward) on the block's first image-stream projection; `close()` removes them."""

    def __init__(self, blocks: Sequence[torch.nn.Module]):
        self.rows = [0] * len(blocks)
        self._hooks = []
        for i, b in enumerate(blocks):
            probe = getattr(b.attn, "to_qkv", None) or b.attn.to_q  # qwenfast fuses Q|K|V; diffusers not
            self._hooks.append(probe.register_forward_pre_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable:
        def add(_module, args):
            self.rows[i] += int(args[0].shape[0])  # (B, L, D): B rows

        return add

    @property
    def forwards(self) -> int:
        """Rows into block 0: transformer forwards, one per image and CFG branch and step."""
        return self.rows[0]

    def computed_fraction(self) -> float:
        return min(self.rows) / max(1, self.rows[0])

    def block_fraction(self) -> float:
        return sum(self.rows) / max(1, len(self.rows) * self.rows[0])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


# ------------------------------------------------------------------------------ Pareto fronts
def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (lower or equal x and higher or equal y, one of them
    strictly), in increasing x; of equal points the first."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front, best = [], -float("inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def front_value(front: Sequence[tuple[float, float]], x: float) -> float | None:
    """The best y of `front` points at x or lower (the front as a step function); None left of it."""
    ys = [fy for fx, fy in front if fx <= x + 1e-9]
    return max(ys) if ys else None


# ------------------------------------------------------------------------------ configurations
def cache_dit_configs(thresholds: Sequence[float] = THRESHOLDS, steps: int = STEPS) -> list[Config]:
    """cache-dit's documented settings (with and without their step mask) and the threshold sweep."""
    doc = {**CACHE_DIT_DOCUMENTED, "num_inference_steps": steps}
    out = [
        Config(
            "diffusers",
            "cache-dit documented (F1B0 R0.12 + TaylorSeer + fast mask)",
            {"yaml": {**doc, "steps_computation_mask": "fast"}},
            {**doc, "steps_computation_mask": "fast"},
        ),
        Config("diffusers", "cache-dit documented, no mask (F1B0 R0.12 + TaylorSeer)", {"yaml": doc}, doc),
    ]
    sweep = [(1, 0, 0), (1, 0, 1), (2, 0, 1), (1, 1, 1)]  # (Fn, Bn, TaylorSeer order)
    for fn, bn, ts in sweep:
        for r in thresholds if (fn, bn) == (1, 0) else thresholds[1::2]:
            kw = dict(Fn_compute_blocks=fn, Bn_compute_blocks=bn, residual_diff_threshold=r)
            kw["num_inference_steps"] = steps
            name = f"DBCache F{fn}B{bn} R{r:g}" + (" + TaylorSeer" if ts else "")
            out.append(Config("diffusers", name, {"config": kw, "taylorseer": ts}, {**kw, "taylorseer": ts}))
    for r in thresholds[1::2]:  # the documented settings at other thresholds: its own front, traced further
        d = {**doc, "residual_diff_threshold": r}
        out.append(Config("diffusers", f"cache-dit documented settings at R{r:g} (no mask)", {"yaml": d}, d))
    return out


def qwenfast_configs() -> list[Config]:
    """Every preset, and variations through the public CachePolicy to trace qwenfast's own front."""
    from dataclasses import asdict

    from ..options import CACHE_PRESETS, CachePolicy

    pols = list(CACHE_PRESETS.values())
    # static: warm-up (its every n-th step full), every, last blocks; W2 every 3 was balanced before
    for w, we, e, b in [(2, 1, 2, 0), (2, 1, 3, 0), (2, 1, 6, 0), (4, 1, 4, 0), (2, 1, 3, 1), (8, 2, 5, 0)]:
        name = f"static W{w}{f'/{we}' if we > 1 else ''} every {e}" + (f" B{b}" if b else "")
        pols.append(CachePolicy(warmup=w, warmup_every=we, tail=1, every=e, last=b, taylor=1, name=name))
    for t, m in [(0.1, 3), (0.2, 3), (0.4, 6)]:  # adaptive: threshold, max cached steps in a row
        pols.append(
            CachePolicy(
                "adaptive",
                warmup=2,
                tail=1,
                threshold=t,
                max_skips=m,
                taylor=1,
                name=f"adaptive {t:g}, max {m}",
            )
        )
    return [Config("qwenfast", p.name, p, asdict(p)) for p in pols]


# ------------------------------------------------------------------------------ engines
@contextlib.contextmanager
def diffusers_edit_areas(folder: Path) -> Iterator[None]:
    """diffusers' Edit-Plus pipeline resizes its inputs to fixed areas (384² for the VL encoder, 1024² for
    the VAE); a model trained at another scale says so in qwenfast.json "image_areas" (the demo: 64², 128²).
    Set them for the duration, as tools/train_demo_edit.py does when it checks that both engines agree."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    areas = json.loads((folder / "qwenfast.json").read_text()).get("image_areas", {})
    saved = plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE
    plus.CONDITION_IMAGE_SIZE = areas.get("vl_area", saved[0])
    plus.VAE_IMAGE_SIZE = areas.get("vae_area", saved[1])
    try:
        yield
    finally:
        plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = saved


def load_diffusers(folder: Path, edit: bool, device: torch.device, dtype: torch.dtype):
    """diffusers' pipeline for the demo folder (the class its model_index.json names)."""
    import diffusers

    kw = {}
    if edit:
        from ..testing.tiny import load_processor  # no torchvision: diffusers' own loader needs it

        kw["processor"] = load_processor(folder / "processor")
    cls = diffusers.QwenImageEditPlusPipeline if edit else diffusers.QwenImagePipeline
    pipe = cls.from_pretrained(str(folder), dtype=dtype, **kw).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def suite_items(edit: bool, n: int) -> list[tuple]:
    """(prompt,) per text-to-image item, (before scene, instruction) per edit: the held-out suites' first n."""
    from ..demo import data as D

    if edit:
        return [(before, ins) for before, ins, _ in D.eval_edits(36)[:n]]
    return [(p,) for p, _ in D.eval_prompts()[:n]]


def generate(pipe, engine: str, items: list[tuple], steps: int, cfg: float) -> list[np.ndarray]:
    """One image (uint8 HxWx3) per item, item i with seed i, one image per call."""
    from PIL import Image

    from ..demo import data as D
    from ..demo import score as S

    out = []
    for i, item in enumerate(items):
        kw = dict(negative_prompt=" ", num_inference_steps=steps, true_cfg_scale=cfg, output_type="np")
        kw["generator"] = torch.Generator("cpu").manual_seed(i)
        if len(item) == 1:
            res = pipe(item[0], height=D.SIZE, width=D.SIZE, **kw)
        elif engine == "qwenfast":
            res = pipe(D.render(item[0]), item[1], **kw)
        else:
            before = D.render(item[0])  # (H, W, 3): the output keeps its size, as qwenfast's does here
            res = pipe(
                image=[Image.fromarray(before)],
                prompt=item[1],
                height=before.shape[0],
                width=before.shape[1],
                **kw,
            )
        out.append(S.to_uint8(res.images[0]))
    return out


def score(items: list[tuple], images: list[np.ndarray]) -> float:
    from ..demo import score as S

    if len(items[0]) == 1:
        return S.score_prompts(images, [it[0] for it in items]).score
    return S.score_edits(images, [it[0] for it in items], [it[1] for it in items]).score


@contextlib.contextmanager
def enabled(pipe, cfg: Config) -> Iterator[None]:
    """`cfg`'s cache on `pipe` for the duration (qwenfast: configure; diffusers: cache-dit on, then off)."""
    if cfg.engine == "qwenfast":
        pipe.configure(cache=cfg.spec)
        try:
            yield
        finally:
            pipe.configure(cache=None)
        return
    if cfg.spec is None:
        yield
        return
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    if "yaml" in cfg.spec:  # parsed by cache-dit itself, as its examples load cache.yaml
        cache_config, calibrator = cache_dit.load_cache_config({"cache_config": dict(cfg.spec["yaml"])})
    else:
        cache_config = DBCacheConfig(**cfg.spec["config"])
        ts = cfg.spec["taylorseer"]
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=ts) if ts else None
    cache_dit.enable_cache(pipe, cache_config=cache_config, calibrator_config=calibrator)
    try:
        yield
    finally:
        cache_dit.disable_cache(pipe)


def run_config(pipe, blocks, cfg: Config, items, steps: int, cfg_scale: float, ref) -> tuple[dict, list]:
    """Generate the suite under `cfg`; its row (fractions, score, PSNR / SSIM vs `ref`) and its images."""
    from ..demo.bench import psnr, ssim

    t0 = time.perf_counter()
    with enabled(pipe, cfg):
        counter = BlockCounter(blocks)  # after cache-dit's hooks are in, removed before they go
        try:
            images = generate(pipe, cfg.engine, items, steps, cfg_scale)
        finally:
            counter.close()
    row = {
        "engine": cfg.engine,
        "config": cfg.name,
        "params": cfg.params,
        "cached": cfg.spec is not None,
        "forwards": counter.forwards,
        "computed_fraction": round(counter.computed_fraction(), 4),
        "block_fraction": round(counter.block_fraction(), 4),
        "score": round(score(items, images), 2),
    }
    if ref is not None:
        row["psnr_db"] = round(float(np.mean([min(psnr(a, b), PSNR_CAP) for a, b in zip(images, ref)])), 2)
        row["ssim"] = round(float(np.mean([ssim(a, b) for a, b in zip(images, ref)])), 4)
    row["s"] = round(time.perf_counter() - t0, 1)  # CPU wall time: sizes the run, not a speed figure
    return row, images


def fronts(rows: list[dict]) -> dict:
    """Per engine and metric, the config names on its Pareto front (cached rows only), in increasing x."""
    out = {}
    for engine in ("qwenfast", "diffusers"):
        rs = [r for r in rows if r["engine"] == engine and r["cached"]]
        for metric in ("score", "psnr_db"):
            idx = pareto_front([(r["computed_fraction"], r[metric]) for r in rs])
            out[f"{engine}:{metric}"] = [rs[i]["config"] for i in idx]
    return out


def margins(rows: list[dict]) -> None:
    """Each cached qwenfast row's margin over cache-dit's front (its value minus the best cache-dit value at
    an equal or lower computed fraction; None where cache-dit has no point that low), in place."""
    theirs = [r for r in rows if r["engine"] == "diffusers" and r["cached"]]
    for r in rows:
        if r["engine"] != "qwenfast" or not r["cached"]:
            continue
        for metric in ("score", "psnr_db"):
            best = front_value([(t["computed_fraction"], t[metric]) for t in theirs], r["computed_fraction"])
            r[f"{metric}_vs_cache_dit"] = None if best is None else round(r[metric] - best, 2)


def run(
    model: str | None = None,
    n: int | None = None,
    steps: int = STEPS,
    thresholds: Sequence[float] = THRESHOLDS,
    engines: Sequence[str] = ("qwenfast", "diffusers"),
    only: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> dict:
    """Every configuration on one suite; the record (`qwenfast bench cache-pareto` prints and saves it)."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read at its import: no per-config info lines
    import cache_dit

    from ..about import DEMO_EDIT_MODEL, DEMO_MODEL
    from ..demo.bench import is_edit, load, psnr

    folder = Path(DEMO_EDIT_MODEL if model == "edit" else DEMO_MODEL if model is None else model)
    ours = load(folder, device, dtype)
    edit = is_edit(ours)
    n = n or N_DEFAULT["edit" if edit else "t2i"]
    items = suite_items(edit, n)
    cfg_scale = float(ours.defaults["true_cfg_scale"])
    theirs = load_diffusers(folder, edit, ours.device, ours.dtype)
    pipes = {"qwenfast": ours, "diffusers": theirs}
    blocks = {k: list(p.transformer.transformer_blocks) for k, p in pipes.items()}  # before cache-dit wraps
    configs = {"qwenfast": qwenfast_configs(), "diffusers": cache_dit_configs(thresholds, steps)}
    print(
        f"suite   {'edits' if edit else 'text-to-image'}, {n} items (seed i for item i), {steps} steps, "
        f"CFG {cfg_scale:g}, one image per call, {ours.device} {str(ours.dtype).replace('torch.', '')}"
    )
    rows, refs = [], {}
    with diffusers_edit_areas(folder) if edit else contextlib.nullcontext():
        for engine in engines:
            todo = [Config(engine, "uncached")] + [c for c in configs[engine] if not only or only in c.name]
            for cfg in todo:
                row, images = run_config(
                    pipes[engine], blocks[engine], cfg, items, steps, cfg_scale, refs.get(engine)
                )
                refs.setdefault(engine, images)
                rows.append(row)
                print(
                    f"  {engine:9s} {cfg.name:58s} computed {row['computed_fraction']:6.1%}  blocks "
                    f"{row['block_fraction']:6.1%}  score {row['score']:5.1f}%  PSNR {row.get('psnr_db', '-'):>6}"
                    f"  SSIM {row.get('ssim', '-'):>6}  {row['s']:.0f}s",
                    flush=True,
                )
    rec = {
        "bench": "cache_pareto",
        "model": "edit" if model == "edit" else str(model or "demo-t2i"),
        "suite": "edits" if edit else "text-to-image",
        "n": n,
        "steps": steps,
        "cfg": cfg_scale,
        "device": str(ours.device),
        "dtype": str(ours.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cache_dit": cache_dit.__version__,
        "rows": rows,
    }
    if len(refs) == 2:  # sanity: the two engines' uncached images
        ps = [min(psnr(a, b), PSNR_CAP) for a, b in zip(refs["qwenfast"], refs["diffusers"])]
        diff = max(
            int(np.abs(a.astype(int) - b.astype(int)).max())
            for a, b in zip(refs["qwenfast"], refs["diffusers"])
        )
        rec["uncached_psnr_db"] = round(float(np.mean(ps)), 2)
        rec["uncached_max_abs_diff"] = diff
        print(
            f"sanity  diffusers vs qwenfast uncached: PSNR {rec['uncached_psnr_db']} dB, max |diff| {diff}/255"
        )
    margins(rows)
    rec["fronts"] = fronts(rows)
    for k, names in rec["fronts"].items():
        print(f"front   {k:18s} " + " < ".join(names))
    for r in rows:
        if "score_vs_cache_dit" in r:
            m = {
                k: "no cache-dit point that low" if r[k] is None else f"{r[k]:+}"
                for k in ("score_vs_cache_dit", "psnr_db_vs_cache_dit")
            }
            print(
                f"margin  {r['config']:34s} score {m['score_vs_cache_dit']}  PSNR {m['psnr_db_vs_cache_dit']} "
                "(vs cache-dit's front at <= its computed fraction)"
            )
    return rec


# ------------------------------------------------------------------------------ the figure
def plot(recs: list[dict], path: Path) -> None:
    """docs/cache-pareto.png: per suite (columns), demo score and PSNR (rows) against computed fraction;
    every configuration as a point, each engine's front as a step line, presets and cache-dit's documented
    settings labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"qwenfast": "tab:blue", "diffusers": "tab:orange"}
    labels = {"qwenfast": "qwenfast step cache", "diffusers": "diffusers + cache-dit DBCache"}
    fig, axes = plt.subplots(2, len(recs), figsize=(6.2 * len(recs), 8.4), squeeze=False)
    for col, rec in enumerate(recs):
        for row, (metric, ylabel) in enumerate(
            (("score", "demo score, %"), ("psnr_db", "PSNR vs uncached, dB"))
        ):
            ax = axes[row][col]
            for engine in ("diffusers", "qwenfast"):
                rs = [r for r in rec["rows"] if r["engine"] == engine and r["cached"]]
                pts = [(r["computed_fraction"], r[metric]) for r in rs]
                ax.scatter(
                    *zip(*pts), s=18, alpha=0.45, color=colours[engine], label=f"{labels[engine]} (all)"
                )
                front = sorted(pts[i] for i in pareto_front(pts))
                xs = [p[0] for p in front] + [1.0]
                ys = [p[1] for p in front] + [front[-1][1]]
                ax.step(xs, ys, where="post", color=colours[engine], lw=1.8, label=f"{labels[engine]} front")
                named = {"balanced": ("*", "balanced"), "fast": ("*", "fast")} if engine == "qwenfast" else {}
                for r in rs:
                    if "documented" in r["config"] and "settings at" not in r["config"]:
                        named[r["config"]] = (
                            "D",
                            "cache-dit doc." + (" + mask" if "mask)" in r["config"] else ""),
                        )
                    if r["config"] in named:
                        mark, tag = named[r["config"]]
                        xy = (r["computed_fraction"], r[metric])
                        ax.scatter(
                            *xy,
                            s=90 if mark == "*" else 40,
                            marker=mark,
                            color=colours[engine],
                            edgecolor="k",
                        )
                        ax.annotate(
                            tag,
                            xy,
                            fontsize=7,
                            xytext=(5, -9 if mark == "D" else 4),
                            textcoords="offset points",
                        )
            if metric == "score":
                for engine in ("diffusers", "qwenfast"):
                    u = next(r for r in rec["rows"] if r["engine"] == engine and not r["cached"])
                    ax.axhline(u["score"], color=colours[engine], ls=":", lw=1, label=f"{engine} uncached")
            ax.set_xlim(0, 1.02)
            ax.set_xlabel("computed fraction of transformer forwards")
            ax.set_ylabel(ylabel)
            ax.set_title(
                f"{rec['suite']}, {rec['n']} items, {rec['steps']} steps, CFG {rec['cfg']:g}", fontsize=10
            )
            ax.grid(alpha=0.3)
        axes[1][col].legend(fontsize=7, loc="lower right")
    foot = "; ".join(f"{r['suite']}: {r.get('date', '?')[:10]}, commit {r.get('commit', '?')}" for r in recs)
    fig.text(
        0.5,
        0.005,
        f"demo model, {recs[0]['device']} {recs[0]['dtype']}. {foot}. qwenfast bench cache-pareto [--model edit]",
        ha="center",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def newest_records(results: Path) -> list[dict]:
    """The newest cache_pareto record of each suite (text-to-image first) in `results`."""
    f = results / "cache_pareto.jsonl"
    recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []
    out = []
    for suite in ("text-to-image", "edits"):
        mine = [r for r in recs if r.get("suite") == suite]
        if mine:
            out.append(max(mine, key=lambda r: r.get("date", "")))
    return out


# ------------------------------------------------------------------------------ command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="demo model folder (default: the embedded text-to-image demo; 'edit': the edit demo)",
    )
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help=f"items of the held-out suite (default {N_DEFAULT['t2i']} prompts, {N_DEFAULT['edit']} edits)",
    )
    p.add_argument("--steps", type=int, default=STEPS, help=f"denoising steps (default {STEPS})")
    p.add_argument(
        "--thresholds",
        default=",".join(f"{t:g}" for t in THRESHOLDS),
        help="cache-dit residual_diff_threshold sweep, comma list (F2B0 and F1B1 take every 2nd)",
    )
    p.add_argument(
        "--engine",
        action="append",
        choices=("qwenfast", "diffusers"),
        default=None,
        help="run only this engine's configurations (repeatable; default both)",
    )
    p.add_argument(
        "--only", default=None, metavar="TEXT", help="only configurations whose name contains TEXT"
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default torch's; 1 on a shared 2-core machine)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw the figure from the newest record of each suite in --results (default "
        "bench/results) to PNG and exit",
    )
    p.add_argument("--results", default=None, metavar="DIR", help=RESULTS_HELP)


def run_from_args(a: argparse.Namespace) -> int:
    if a.plot:
        from .report import default_root

        recs = newest_records(Path(a.results) if a.results else default_root() / "bench" / "results")
        if not recs:
            raise SystemExit(
                "error: no cache_pareto record to plot (run `qwenfast bench cache-pareto` first)"
            )
        plot(recs, Path(a.plot))
        print(f"wrote {a.plot} from {len(recs)} record(s)")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    thresholds = tuple(float(t) for t in a.thresholds.split(",") if t)
    rec = run(
        a.model, a.n, a.steps, thresholds, a.engine or ("qwenfast", "diffusers"), a.only, a.device, a.dtype
    )
    emit(rec, "cache_pareto.jsonl", results_dir(a.results))
    return 0
