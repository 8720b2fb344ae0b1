"""The tables of the lossy options and the quality gate `qwenfast bench report` publishes: FP8, 8-bit
attention, the demo quality gate per path and per step cache, the full-size check and the step cache's
Pareto fronts (the helpers and the other tables: report_tables.py)."""

from __future__ import annotations

from collections.abc import Callable

from ..options import CACHE_PRESETS
from .records import Rec
from .report_tables import gib, gpu_name, ms, newest, ratio, run_of, sci, secs, source, table

# ---------------------------------------------------------------------------------------------
# FP8 and 8-bit attention


def fp8(recs: list[Rec]) -> str:
    f = "fp8.jsonl"
    load = newest(recs, f, lambda r: "load" in r.data)
    lora = newest(recs, f, lambda r: "lora" in r.data and "ratio" in r["lora"])
    rows, used = [], []
    if load is not None:
        v = load["load"]
        used.append(load)
        rows.append(
            [
                f"load a {v['file_gib']:.1f} GiB ComfyUI FP8 transformer file (`fp8=True`)",
                f"{secs(v['load_s'])}; GPU peak = FP8 model + {gib(v['peak_minus_model_gib'])}; "
                f"forward rel. err vs the dequantise path {v['forward_rel_err_vs_dequant_path']:.1e}",
            ]
        )
    if lora is not None:
        v = lora["lora"]
        used.append(lora)
        sw = v["switch_s"]
        rows.append(
            [
                f"LoRA rank {v['rank']} on an FP8 base vs bf16 + fused LoRA (mean \\|Δ\\| ratio to FP8 alone)",
                f"{v['ratio']:.3f}",
            ]
        )
        rows.append(
            ["switch to another LoRA (`set_loras`)", f"{secs(min(sw.values()))}–{secs(max(sw.values()))}"]
        )
    for cap in ("24gib", "16gib"):
        b = newest(recs, f, lambda r, cap=cap: _default_budget((r.get("budget") or {}).get(cap) or {}))
        if b is None:
            continue
        used.append(b)
        v = b["budget"][cap]
        rows.append(
            [
                f"FP8, 1024², 4 steps under a {cap[:-3]} GiB cap ({v['resident_blocks']} of 60 blocks resident)",
                f"{secs(v['s'])} = {ratio(v['x_resident'])} resident ({secs(b['budget']['resident_s'])}); peak "
                f"{gib(v['peak_gib'])}, planner {gib(v['predicted_gib'])}",
            ]
        )
    return table(["FP8 (full-size random weights)", "result"], rows) + source(used, "bash bench/fp8.sh")


def _default_budget(v: dict) -> bool:
    """A budget row run as the engine does by default: CUDA graphs while every block is resident,
    eager once blocks stream (capturing the streamed copies was measured and dropped)."""
    if "s" not in v:
        return False
    graphs = v.get("graphs_on", v.get("graphs_replayed"))
    return bool(graphs) == (v.get("streamed_blocks", 0) == 0)


def attention(recs: list[Rec]) -> str:
    f = "attention.jsonl"
    last = newest(recs, f, lambda r: r["bench"] == "attention_micro")
    rows, used = [], []
    if last is not None:
        run = [r for r in run_of(recs, last) if r["bench"] == "attention_micro" and "ms_layer" in r.data]
        used += run
        for r in run:
            rows.append(
                [
                    r["candidate"],
                    f"{r['S']}",
                    ms(r["ms_layer"]),
                    f"{r['tflops']:.0f} TFLOP/s",
                    sci(r["rel_err_vs_fp32"]),
                ]
            )
    out = table(["kernel", "tokens", "per layer (B=1, 24 heads, d=128)", "rate", "rel. err vs fp32"], rows)
    tr = newest(recs, f, lambda r: r["bench"] == "attention_transformer")
    if tr is not None:
        used.append(tr)
        c, p = tr["rows"]["cudnn"], tr["rows"]["fp8"]
        engines = ", ".join(sorted(k for k in (tr.get("fp8_calls") or {}) if " " not in k)) or "auto"
        p_att = p["attention_ms_eager_incl_quant"]
        # (a profile before the int8 kernel's names were counted as attention put it under "other")
        p_att = "not split out" if not p_att and ("int8" in engines or "sage" in engines) else ms(p_att)
        out += "\n\n" + table(
            ["60-layer FP8 forward, 1024²", "forward", "attention (eager profile)"],
            [
                ["bf16 attention", ms(c["ms_forward_graph"]), ms(c["attention_ms_eager_incl_quant"])],
                [f'`attention="fp8"` ({engines} engine)', ms(p["ms_forward_graph"]), p_att],
            ],
        )
    from ..kernels.attn_int8 import gpu_tile

    tiles = newest(recs, f, lambda r: r["bench"] == "attn_int8_tiles")
    if tiles is not None:  # the int8 kernel alone, per tile: its default against the fastest
        used.append(tiles)
        rows = []
        for S in sorted(int(k) for k in tiles["best"]):
            ok = [r for r in tiles["rows"] if r["S"] == S and "ms" in r]
            fast = min(ok, key=lambda r: r["ms"])
            dflt = [r for r in ok if r["tile"] == list(gpu_tile(128))]
            for label, r in (("default", dflt[0] if dflt else None), ("fastest", fast)):
                if r is not None:
                    rows.append([label, str(tuple(r["tile"])), f"{S}", ms(r["ms"]), f"{r['tops']:.0f} TOP/s"])
        out += "\n\n" + table(
            ["int8 kernel alone", "tile (BLOCK_M, BLOCK_N, warps, stages)", "tokens", "per layer", "rate"],
            rows,
        )
    return out + source(used, "bash bench/attention.sh")


def attention_quality(recs: list[Rec]) -> str:
    """Per suite, the newest gate record of each (device, FP8 attention engine): GPU runs of the kernels
    themselves, and CPU runs where each engine's quantisation is emulated in fp32 torch."""
    rows, used = [], []
    for model, what in (("demo-t2i", "text-to-image"), ("edit", "edits")):
        keys = {}
        for r in recs:
            if r.file == "attention.jsonl" and r["bench"] == "attention_quality" and r["model"] == model:
                eng = (r.get("env") or {}).get("QWENFAST_FP8_ATTENTION", "auto")
                tile = r.get("int8_tile")  # its key block (tile[1]) sets where P is rounded
                eng += (
                    f" engine, {tile[1]}-key blocks"
                    if tile and r.get("gpu") not in (None, "cpu")
                    else " engine"
                )
                keys.setdefault((r.get("gpu") in (None, "cpu"), eng), []).append(r)
        for key in sorted(keys):
            r = newest(keys[key], "attention.jsonl")
            used.append(r)
            where = "CPU (emulated)" if key[0] else gpu_name(r)
            for row in r["rows"]:
                att = row.get("attention", "")
                if att == "fp8":
                    att = f"8-bit, {key[1]}"
                rows.append([what, where, row["path"], att, f"{row['score']:.1f}%", f"{row['gap']:+.1f}"])
    head = ["suite (120 items)", "device", "path", "attention", "score", "vs fp32 reference"]
    return table(head, rows) + source(
        used,
        "bash bench/attention.sh (GPU); QWENFAST_FP8_ATTENTION=int8 (or auto) qwenfast bench attention quality "
        "--device cpu [--model edit] (CPU)",
    )


# ---------------------------------------------------------------------------------------------
# the demo quality gate


def quality_demo(recs: list[Rec]) -> str:
    """The demo model's held-out scores at its defaults (`qwenfast bench quality`)."""
    rows, used = [], []
    for model, what in (("demo-t2i", "text-to-image"), ("edit", "edits")):
        r = newest(recs, "quality.jsonl", lambda r, m=model: r["bench"] == "quality" and r.get("model") == m)
        if r is None:
            continue
        used.append(r)
        checks = ", ".join(f"{k} {v:.1f}%" for k, v in (r.get("per_check") or {}).items())
        rows.append(
            [
                f"{what}, {r['n']} items, {r['steps']} steps, CFG {r['cfg']:g}",
                gpu_name(r),
                r.get("dtype", ""),
                f"**{r['score']:.1f}%**",
                checks,
            ]
        )
    head = ["held-out suite (model defaults)", "device", "dtype", "all checks pass", "per check"]
    return table(head, rows) + source(used, "qwenfast bench quality --n 120 [--model edit]")


def quality_paths(recs: list[Rec]) -> str:
    rows, used = [], []
    for model, what in (("demo-t2i", "text-to-image"), ("edit", "edits")):
        r = newest(
            recs,
            "quality.jsonl",
            lambda r, m=model: r["bench"] == "quality_paths" and r.get("model") == m and len(r["rows"]) > 2,
        )
        if r is None:
            continue
        used.append(r)
        for row in r["rows"]:
            rows.append(
                [f"{what}, {r['n']} items", row["path"], f"{row['score']:.1f}%", f"{row['gap']:+.1f}"]
            )
    head = ["suite (20 steps, model defaults)", "path (each adds one speed-up)", "score", "vs fp32 reference"]
    return table(head, rows) + source(used, "qwenfast bench quality --paths [--model edit] (GPU)")


def quality_cache(recs: list[Rec]) -> str:
    rows, used = [], []
    for model, what in (("demo-t2i", "text-to-image, 120 prompts"), ("edit", "edits, 36 instructions")):
        r = newest(
            recs, "quality.jsonl", lambda r, m=model: r["bench"] == "quality_cache" and r.get("model") == m
        )
        if r is None:
            continue
        used.append(r)
        for row in r["rows"]:
            extra = (
                (
                    f"{row['computed_fraction']:.0%}",
                    f"{row['gap']:+.1f}",
                    f"{row['psnr_db']:.1f} dB / {row['ssim']:.3f}",
                )
                if row["cache"] != "off"
                else ("100%", "", "")
            )
            rows.append([what, f"`{row['cache']}`", f"{row['score']:.1f}%", *extra])
    head = [
        "suite (50 steps, CFG)",
        "step cache",
        "score",
        "steps computed",
        "vs uncached",
        "PSNR / SSIM vs uncached",
    ]
    return table(head, rows) + source(
        used, "qwenfast bench quality --cache balanced --cache fast [--model edit]"
    )


def full_size_check(recs: list[Rec]) -> str:
    r = newest(recs, "full_size_check.jsonl")
    if r is None:
        return "*No record yet.*"
    rows = [
        [
            "rel. err vs diffusers, batch 1 / batch 2 with a padded text mask",
            f"{r['rel_err']:.1e} / {r['rel_err_masked_b2']:.1e}",
        ],
        [
            "load the 60-layer transformer (streamed, no second copy)",
            f"{secs(r['load_s'])}, peak {gib(r['load_peak_gib'])}",
        ],
    ]
    return table(
        [f"full-size transformer, {r['size']}², random bf16 weights saved by diffusers", "result"], rows
    ) + source([r], "python bench/full_size_check.py --results bench/results")


def cache_pareto(recs: list[Rec]) -> str:
    """docs/quality.md: step caching at matched quality on the demo model (`qwenfast bench cache-pareto`):
    per suite the uncached rows, qwenfast's presets, cache-dit's documented settings and every point of
    either engine's fronts (the rest of the sweep is in the record and the figure)."""
    rows, used, notes = [], [], []
    for suite in ("text-to-image", "edits"):
        r = newest(recs, "cache_pareto.jsonl", lambda r, s=suite: r.get("suite") == s)
        if r is None:
            continue
        used.append(r)
        fr = r.get("fronts") or {}
        on: dict[tuple[str, str], list[str]] = {}  # (engine, config) -> the fronts it is on
        for k, names in fr.items():
            engine, metric = k.split(":")
            for name in names:
                on.setdefault((engine, name), []).append("score" if metric == "score" else "PSNR")
        base = {x["engine"]: x["score"] for x in r["rows"] if not x["cached"]}
        named = ("balanced", "fast", "cache-dit documented (", "cache-dit documented, no mask")
        shown = [
            x
            for x in r["rows"]
            if not x["cached"] or x["config"].startswith(named) or on.get((x["engine"], x["config"]))
        ]
        for x in shown:
            cached = x["cached"]
            vs = [x.get(f"{m}_vs_cache_dit") for m in ("score", "psnr_db")]
            name = (
                f"**`{x['config']}`**"
                if x["engine"] == "qwenfast" and x["config"] in ("balanced", "fast")
                else x["config"]
            )
            rows.append(
                [
                    f"{suite}, {r['n']}",
                    "qwenfast"
                    if x["engine"] == "qwenfast"
                    else "diffusers + cache-dit"
                    if cached
                    else "diffusers",
                    name,
                    f"{x['computed_fraction']:.0%} ({x['block_fraction']:.0%})",
                    f"{x['score']:.1f}%" + (f" ({x['score'] - base[x['engine']]:+.1f})" if cached else ""),
                    f"{x['psnr_db']:.1f} dB / {x['ssim']:.3f}" if cached else "",
                    ", ".join(on.get((x["engine"], x["config"]), [])),
                    "" if None in vs or not cached else f"{vs[0]:+.1f} / {vs[1]:+.1f} dB",
                ]
            )
        left = len(r["rows"]) - len(shown)
        if "uncached_psnr_db" in r.data:
            notes.append(
                f"{suite}: diffusers vs qwenfast uncached, PSNR {r['uncached_psnr_db']:.1f} dB "
                f"(max pixel difference {r['uncached_max_abs_diff']}/255); {left} more configurations, off both fronts, are in the record and the figure"
            )
    if not rows:
        return "*No cache-pareto record yet: `qwenfast bench cache-pareto [--model edit]`.*"
    head = [
        "suite, items",
        "engine",
        "configuration",
        "computed (block work)",
        "score (vs uncached)",
        "PSNR / SSIM vs uncached",
        "on own front",
        "vs cache-dit's front: score / PSNR",
    ]
    note = "\n" + "".join(f"\n- {n}" for n in notes) + "\n" if notes else ""
    return (
        table(head, rows)
        + note
        + source(used, "qwenfast bench cache-pareto --threads 1 [--model edit] --results bench/results")
    )


def cache_step(recs: list[Rec]) -> str:
    """A cached step of `fast` inside a real run (`bench/profile_step_in_run.py`): its GPU time with the
    preset's blocks on a cached step and with one first block, beside a full step's and the run's."""
    rows, used = [], []
    for first in (0, 1):
        r = newest(
            recs,
            "profile_forward.jsonl",
            lambda r, first=first: (
                r["bench"] == "profile_step_in_run"
                and r.get("cache") == "fast"
                and r.get("fp8")
                and r.get("steps") == 50
                and r.get("cfg", 1) > 1
                and r.get("first") == first
            ),
        )
        if r is None:
            continue
        used.append(r)
        now = " (the preset)" if first == CACHE_PRESETS["fast"].first else ""
        rows.append(
            [
                f"`fast`, {first} first block{'s' if first != 1 else ''} on a cached step{now}",
                ms(r["gpu_ms_cached_median"]),
                ms(r["gpu_ms_full_median"]),
                f"{r['cached_steps']} / {r['full_steps']}",
                secs(r["total_s"]),
            ]
        )
    if not rows:
        return "*No record yet: `python bench/profile_step_in_run.py --fp8 --cache fast [--first 1] --no-profile`.*"
    head = [
        "1024², 50 steps, true CFG (batch 2), FP8",
        "cached step (GPU)",
        "full step (GPU)",
        "cached / full",
        "run",
    ]
    cmd = "python bench/profile_step_in_run.py --fp8 --cache fast [--first 1] --no-profile --results bench/results"
    return table(head, rows) + source(used, cmd)


TABLES: dict[str, Callable[[list[Rec]], str]] = {
    "fp8": fp8,
    "attention": attention,
    "attention-quality": attention_quality,
    "quality-demo": quality_demo,
    "quality-paths": quality_paths,
    "quality-cache": quality_cache,
    "full-size-check": full_size_check,
    "cache-pareto": cache_pareto,
    "cache-step": cache_step,
}
