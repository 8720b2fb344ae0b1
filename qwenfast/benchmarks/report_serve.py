"""The mixed-load serving tables of `qwenfast bench report`: `serve-mixed` (the newest levels record of
`qwenfast bench serve --workload mixed` with its baselines: per-row LoRAs against the old batcher and a
diffusers loop in the same run; then the per-row server of each later run without them) and `serve-soak`
(the newest soak record)."""

from __future__ import annotations

from .records import Rec
from .report_tables import newest, ratio, secs, source, table

COMMAND = "STAGE=mixed bash bench/serve.sh"


def _p(cls: dict | None) -> str:
    return "—" if not cls else f"{secs(cls['p50_s'])} / {secs(cls['p95_s'])}"


def serve_mixed(recs: list[Rec]) -> str:
    """The newest levels record with its baselines (the old batcher), then the per-row server alone in every
    levels record after it (`--old-concurrency` with no levels: a scheduler change timed on its own), each
    against its own run's idle latencies."""
    full = lambda r: r.get("mode") == "levels" and r.get("model") == "random-full"  # noqa: E731
    r = newest(recs, "serve_mixed.jsonl", lambda r: full(r) and bool(r.get("old_batcher")))
    r = r or newest(recs, "serve_mixed.jsonl", full)
    if r is None:
        return f"*No mixed-load record yet: `{COMMAND}`.*"
    when = lambda x: (str(x.get("date", "")), x.line)  # noqa: E731 - `newest`'s order
    later = sorted(
        (x for x in recs if x.file == r.file and full(x) and not x.get("old_batcher") and when(x) > when(r)),
        key=when,
    )
    rows = []
    for name, key, rec in (
        ("old batcher (LoRA set in the batch key)", "old_batcher", r),
        ("per-row LoRAs", "per_row", r),
        *((f"per-row LoRAs at `{x.get('commit')}` (no baselines)", "per_row", x) for x in later),
    ):
        idle = rec.get("idle_s", {}).get("4-step")
        for x in rec.get(key, []):
            name_n = f"{name}, {x['sent']} requests" if rec is not r else name
            p95 = x["classes"].get("4-step", {}).get("p95_s")
            rows.append(
                [
                    name_n,
                    str(x["concurrency"]),
                    f"{x['images_per_min']:.1f}",
                    ratio(x.get("x_old_batcher")),
                    f"{x['mean_batch']:.2f}",
                    _p(x["classes"].get("4-step")),
                    ratio(p95 / idle) if p95 and idle else "—",
                    ratio(x.get("p95_4step_x_idle_same_sizes")),
                    _p(x["classes"].get("8-step")),
                    str(x["server_errors"]),
                ]
            )
    d = r.get("diffusers_loop")
    if d:
        rows.append(["diffusers loop, one request at a time", "1", f"{d['images_per_min']:.1f}"] + ["—"] * 7)
    head = ["server", "clients", "images/min", "× old batcher", "mean batch", "4-step p50 / p95",
            "4-step p95 / idle 1024²", "/ idle, same sizes", "8-step p50 / p95", "5xx"]  # fmt: skip
    flags = [
        ("CUDA graphs", r.get("cuda_graphs")),
        (f"{r.get('graph_slots')} graph slots", r.get("graph_slots")),
        (f"prompts padded to multiples of {r.get('text_bucket')} tokens", r.get("text_bucket")),
    ]
    flags = [f for f, on in flags if on]
    notes = [
        f"Both servers: {r.get('weights', 'fp8').upper()} weights, {', '.join(flags) or 'eager'}.",
        f"Idle (one request alone): 4-step {secs(r.get('idle_s', {}).get('4-step'))}; its bare pipeline call "
        f"{secs(r.get('idle_pipeline_s', {}).get('4-step with LoRA'))} with its LoRA, "
        f"{secs(r.get('idle_pipeline_s', {}).get('4-step no LoRA'))} without."
        + (
            " 4-step alone by size: "
            + ", ".join(f"{k} {secs(v)}" for k, v in r["idle_4step_by_size_s"].items())
            + " (the last column sets each level's 4-step p95 against the p95 of its requests' sizes alone)."
            if r.get("idle_4step_by_size_s")
            else ""
        ),
    ]
    notes += [
        f"`{x.get('commit')}`: the per-row server alone, {x['per_row'][0]['sent'] if x.get('per_row') else 0} "
        f"requests; idle 4-step {secs(x.get('idle_s', {}).get('4-step'))}, by size "
        + ", ".join(f"{k} {secs(v)}" for k, v in x.get("idle_4step_by_size_s", {}).items())
        + f" (`{x.get('command')}`)."
        for x in later
    ]
    used = [r, *later]
    overheads = [(r.get("weights", "fp8"), r)] if r.get("row_overhead") else []
    for w in ("fp8", "int8", "bf16"):  # the overhead measured on its own (`--workload rows`, a fresh
        # process): preferred to one measured after the serving levels (the server's graphs, caches and
        # allocator state left behind moved it, e.g. 465 ms without adapters against 334 alone)
        alone = newest(
            recs,
            "serve_mixed.jsonl",
            lambda x, w=w: x.get("mode") == "row_overhead" and x.get("weights", "fp8") == w,
        )
        if alone is not None:
            used.append(alone)
            overheads = [(k, x) for k, x in overheads if k != w] + [(w, alone)]
    for w, x in overheads:
        o = x["row_overhead"]
        notes.append(
            f"One forward beside {w.upper()} GEMMs, batch {o['batch']} at {o['size']}², eager: no adapters "
            f"{o['none_installed_ms']:.0f} ms; "
            f"each row its own rank-64 LoRA {o['each_row_its_lora_ms']:.0f} ms ({o['overhead_pct']:+.0f}%); "
            f"adapters installed, no row using one {o['rows_without_lora_ms']:.0f} ms ({o['no_lora_rows_overhead_pct']:+.0f}%)"
            + (
                f"; CUDA-graphed {o['none_installed_graph_ms']:.0f} / {o['each_row_its_lora_graph_ms']:.0f} "
                f"({o['overhead_graph_pct']:+.0f}%) / {o['rows_without_lora_graph_ms']:.0f} ms "
                f"({o['no_lora_rows_overhead_graph_pct']:+.0f}%)"
                if "overhead_graph_pct" in o
                else ""
            )
            + (
                f"; with each row's update in the FP8 GEMM's epilogue (`kernels/fp8_lora_gemm.py`) "
                f"{o['each_row_its_lora_fused_gemm_ms']:.0f} ms eager ({o['overhead_fused_gemm_pct']:+.0f}%), "
                f"{o['each_row_its_lora_fused_gemm_graph_ms']:.0f} ms CUDA-graphed "
                f"({o['overhead_fused_gemm_graph_pct']:+.0f}%)"
                if "overhead_fused_gemm_graph_pct" in o
                else ""
            )
            + (f" (`{x['command']}`)." if x is not r else ".")
        )
    return (
        table(head, rows)
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + "\n"
        + source(used, r.get("command") or COMMAND)
    )


def serve_soak(recs: list[Rec]) -> str:
    r = newest(recs, "serve_mixed.jsonl", lambda r: r.get("mode") == "soak")
    if r is None:
        return "*No soak record yet: `STAGE=soak bash bench/serve.sh`.*"
    s, m = r["soak"], r.get("memory", {})
    out = s["outcomes"]
    # VAE decode graphs captured in the load (and resident at its end), after the warm-up's captures if any
    warm = r.get("warm_captures")
    dec_name = ("graphs captured in the warm-up (its first requests once) / " if warm is not None else "") + (
        "VAE decode graphs captured in the load"
        + (", resident at its end" if "decode_graphs_resident" in s else "")
    )
    dec = (
        ("" if warm is None else f"{warm} / ")
        + f"{s.get('decode_captures', 0)}"
        + (f", {s['decode_graphs_resident']}" if "decode_graphs_resident" in s else "")
    )
    rows = [
        ["wall time, clients", f"{secs(s['wall_s'])}, {s['concurrency']}"],
        ["requests sent / answered 200 (server's count)", f"{s['sent']} / {out.get('200', 0)} ({s['server_200']})"],
        [
            "hung up on purpose / answered invalid_lora (400; 422 before 2026-11-27) for the broken LoRA",
            f"{out.get('hung up', 0)} / {out.get('400', 0) + out.get('422', 0)}",
        ],
        ["5xx / lost / answered twice", f"{s['fivexx']} / {s['lost']} / {s['duplicated']}"],
        ["images/min", f"{s['images_per_min']:.1f}"],
        *([[f"{c} requests, latency p50 / p95", f"{s['classes'][c]['n']}, {secs(s['classes'][c]['p50_s'])} / "
            f"{secs(s['classes'][c]['p95_s'])}"] for c in ("4-step", "8-step") if c in s.get("classes", {})]),
        *([["4-step p95 / the p95 of the same requests' sizes each alone", f"{secs(s['classes']['4-step']['p95_s'])}"
            f" / {secs(s['idle_4step_same_sizes_p95_s'])} = {s['p95_4step_x_idle_same_sizes']:.2f}×"]]
          if "p95_4step_x_idle_same_sizes" in s else []),
        [f"CUDA graphs captured / replays / resident (LRU of {r.get('graph_slots', 8)})",
         f"{s['graph_captures']} / {s['graph_replays']} / {s['graphs_resident']}"],
        *([["graphs dropped as stale in the load (a step cache's buffers grew)", f"{s['graphs_dropped_stale']}"]]
          if "graphs_dropped_stale" in s else []),
        [dec_name, dec],
        *([["every shape of the load once before it (--warm-shapes): requests / graphs captured / resident after",
            f"{w['requests']} / {w['captures']} / {w['resident']}"]] if (w := r.get("shapes_warm")) else []),
        ["allocated, per-minute floor (GiB)", " ".join(f"{v:.2f}" for v in m.get("floor_gib", []))],
        ["allocated, per-minute peak (GiB)", " ".join(f"{v:.2f}" for v in m.get("peak_gib", []))],
    ]  # fmt: skip
    floors, peaks = m.get("floor_gib", []), m.get("peak_gib", [])
    if len(floors) > 2:  # the first minute holds the warm-up's tail; the last, the drain
        rest = floors[1:]
        ranges = f"{max(rest) - min(rest):.2f} / {max(peaks[1:-1]) - min(peaks[1:-1]):.2f}"
        rows.append(["allocated after the first minute: floor range / peak range (GiB)", ranges])
    if "allocated_spread_gib" in m:
        rows.append(["allocated, max − min over the load (GiB)", f"{m['allocated_spread_gib']:.2f}"])
    return (
        table(["soak", "figure"], rows)
        + "\n"
        + source([r], r.get("command") or "STAGE=soak bash bench/serve.sh")
    )
