"""The tables `qwenfast bench report` publishes, one function each: records in, Markdown out.

Each table takes the newest records that answer it (by date, then file order), never an average of
runs, and ends with a source line: GPU, date, commit and record file of every run it shows, and the
command that measures it again. Records made with engine switches in the environment (an 8-bit
attention run, say) are left out of the default tables unless a table is about that switch.
"""

from __future__ import annotations

from collections.abc import Callable

from .records import Rec

CASES = {"1024:50:cfg": "1024², 50 steps, true CFG", "1328:50:cfg": "1328², 50 steps, true CFG",
         "1024:4:nocfg": "1024², 4 steps, no CFG"}  # fmt: skip
NEUTRAL_ENV = {"PYTORCH_CUDA_ALLOC_CONF"}


# ---------------------------------------------------------------------------------------------
# selection and formatting


def is_default(r: Rec) -> bool:
    """Made with the default engine switches (nothing but the allocator set in the environment)."""
    return not set(r.get("env") or {}) - NEUTRAL_ENV


def newest(recs: list[Rec], file: str, pred: Callable[[Rec], bool] = lambda r: True) -> Rec | None:
    cands = [r for r in recs if r.file == file and pred(r)]
    return max(cands, key=lambda r: (str(r.get("date", "")), r.line)) if cands else None


def run_of(recs: list[Rec], r: Rec) -> list[Rec]:
    """The records of `r`'s run (same file and run id), in file order."""
    return [x for x in recs if x.file == r.file and x.get("run") == r.get("run")]


def merged(run: list[Rec]) -> dict:
    out: dict = {}
    for r in run:
        out.update(r.data)
    return out


def gpu_name(r: Rec) -> str:
    g = r.get("gpu") or r.get("device") or "?"
    return g.replace("NVIDIA ", "")


def source(used: list[Rec], command: str) -> str:
    """The line under a table: each run shown (GPU, date, commit, record lines) and the command."""
    seen: dict = {}
    for r in used:
        if r is None:
            continue
        key = (gpu_name(r), str(r.get("date", ""))[:10], r.get("commit", "?"), r.file)
        seen.setdefault(key, []).append(r.line)
    parts = [
        f"{g}, {d}, commit `{c}` (`bench/results/{f}` line{'s' if len(set(ls)) > 1 else ''} "
        f"{', '.join(map(str, sorted(set(ls))))})"
        for (g, d, c, f), ls in seen.items()
    ]
    return f"\n*Recorded on {'; '.join(parts)}. Measure again: `{command}`.*"


def secs(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.3f} s" if v < 1 else f"{v:.2f} s"


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} ms" if v >= 10 else f"{v:.2f} ms"


def ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def gib(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} GiB"


def sci(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Qwen-Image end to end, transformer forward


def _e2e_run(recs: list[Rec], case: str, want_cache: bool = False) -> tuple[dict, list[Rec]] | None:
    """The newest default-switch pipeline run that measured `case` end to end (with the step cache
    when `want_cache`): its merged record and its records."""

    def ok(r: Rec) -> bool:
        if not is_default(r) or case not in (r.get("end_to_end") or {}):
            return False
        return not want_cache or any(k.startswith("end_to_end_fp8_cache") for k in merged(run_of(recs, r)))

    r = newest(recs, "pipeline.jsonl", ok)
    if r is None:
        return None
    run = run_of(recs, r)
    return merged(run), run


def _cache_key(m: dict, fp8: bool) -> str | None:
    pre = "end_to_end_fp8_cache_" if fp8 else "end_to_end_cache_"
    keys = [k for k in m if k.startswith(pre)]
    return keys[0] if keys else None


def performance(recs: list[Rec]) -> str:
    """README: end to end against diffusers, the newest run with every column."""
    got = _e2e_run(recs, "1024:50:cfg", want_cache=True)
    if got is None:
        return "*No end-to-end record yet: `bash bench/pipeline.sh`.*"
    m, run = got
    kfc = _cache_key(m, True)
    preset = (kfc or "").rsplit("_", 1)[-1]
    rows = []
    for case, label in CASES.items():
        e = (m.get("end_to_end") or {}).get(case)
        if e is None:
            continue
        f = (m.get("end_to_end_fp8") or {}).get(case, {})
        fc = (m.get(kfc) or {}).get(case, {}) if kfc else {}
        d_s = e["diffusers"]["total_s"]

        def cell(s):
            return "—" if s is None else f"**{secs(s)}** ({ratio(d_s / s)})"

        rows.append(
            [
                label,
                secs(d_s),
                cell(e["qwenfast"]["total_s"]),
                cell((f.get("qwenfast") or {}).get("total_s")),
                cell(fc.get("total_s")),
            ]
        )
    head = ["one image", "diffusers 0.42.1", "qwenfast bf16", "qwenfast FP8", f"FP8 + `{preset}` step cache"]
    note = (
        "\nSame GPU, same run, same random full-size weights (60-layer transformer, 7B text encoder) for every "
        "column; text encode + denoise + VAE decode; speed-up over diffusers in brackets. FP8 and the step "
        "cache are lossy and off by default ([speed options](docs/speed.md))."
    )
    return table(head, rows) + "\n" + note + source(run, "bash bench/pipeline.sh")


def end_to_end(recs: list[Rec]) -> str:
    """docs/benchmarks.md: every end-to-end case from its newest run, memory and image difference."""
    rows, used = [], []
    for case, label in CASES.items():
        got = _e2e_run(recs, case)
        if got is None:
            continue
        m, run = got
        used += [
            r
            for r in run
            if "end_to_end" in r.data
            or "end_to_end_fp8" in r.data
            or any(k.startswith("end_to_end_") for k in r.data)
        ]
        e = m["end_to_end"][case]
        f = (m.get("end_to_end_fp8") or {}).get(case)
        kc, kfc = _cache_key(m, False), _cache_key(m, True)
        c = (m.get(kc) or {}).get(case) if kc else None
        fc = (m.get(kfc) or {}).get(case) if kfc else None
        d_s = e["diffusers"]["total_s"]
        rows.append(
            [
                label,
                secs(d_s),
                f"{secs(e['qwenfast']['total_s'])} ({ratio(d_s / e['qwenfast']['total_s'])})",
                f"{secs(f['qwenfast']['total_s'])} ({ratio(d_s / f['qwenfast']['total_s'])})" if f else "—",
                f"{secs(c['total_s'])} ({c['computed_fraction']:.0%} computed)" if c else "—",
                f"{secs(fc['total_s'])} ({ratio(d_s / fc['total_s'])})" if fc else "—",
                f"{gib(e['diffusers']['peak_gib'])} / {gib(e['qwenfast']['peak_gib'])}"
                + (f" / {gib(f['qwenfast']['peak_gib'])}" if f else ""),
                f"{e['mean_abs_diff_images']:.4f}" + (f" / {f['mean_abs_diff_images']:.4f}" if f else ""),
            ]
        )
    head = [
        "case",
        "diffusers",
        "qwenfast bf16",
        "FP8",
        "bf16 + step cache",
        "FP8 + step cache",
        "peak: diffusers / bf16 / FP8",
        "mean \\|Δ\\| vs diffusers: bf16 / FP8",
    ]
    return table(head, rows) + source(used, "bash bench/pipeline.sh")


def transformer(recs: list[Rec]) -> str:
    """docs/benchmarks.md: the 60-layer transformer forward, every variant of the newest default run of
    both sizes (1024² and 1328², what bench/transformer.sh runs; a 1024²-only run checks the baseline)."""
    r = newest(
        recs,
        "transformer.jsonl",
        lambda r: (
            is_default(r)
            and {"1024", "1328"} <= set(r["sizes"])
            and "diffusers eager" in next(iter(r["sizes"].values()))["variants"]
        ),
    )
    if r is None:
        return "*No transformer record yet: `bash bench/transformer.sh`.*"
    rows = []
    for size, s in r["sizes"].items():
        rows.append(
            [
                f"{size}²",
                "FLOP floor (bf16 dense peak rate)",
                ms(s["floor_ms"]),
                f"{s['tflop']:.1f} TFLOP",
                "",
                "",
            ]
        )
        for name, v in s["variants"].items():
            rows.append(
                [
                    f"{size}²",
                    name,
                    ms(v["ms"]),
                    f"{v['tflops']:.0f} TFLOP/s",
                    ratio(v.get("speedup_vs_diffusers_eager")),
                    sci(v.get("rel_err_vs_diffusers")),
                ]
            )
    head = ["size", "variant", "forward", "rate", "vs diffusers eager", "rel. err vs diffusers"]
    note = (
        "\nOne forward of the full-size transformer (random bf16 weights, a 128-token prompt), median of "
        "CUDA-event timings. The FLOP floor is the forward's FLOPs at the GPU's dense bf16 peak."
    )
    return table(head, rows) + "\n" + note + source([r], "bash bench/transformer.sh")


def vae(recs: list[Rec]) -> str:
    r = newest(recs, "pipeline.jsonl", lambda r: "vae" in r.data and is_default(r))
    if r is None:
        return "*No VAE record yet.*"
    rows = []
    for size in ("1024", "1328"):
        v = r["vae"].get(size)
        if v:
            rows.append(
                [
                    f"{size}²",
                    ms(v["diffusers_decode_ms"]),
                    f"{ms(v['ours_fast_decode_ms'])} ({ratio(v['decode_speedup'])})",
                    ms(v["diffusers_encode_ms"]),
                    f"{ms(v['ours_fast_encode_ms'])} ({ratio(v['encode_speedup'])})",
                    f"{v.get('diffusers_bf16_vs_fp32_decode_rel_err', float('nan')):.1e} / "
                    f"{v.get('ours_fast_vs_fp32_decode_rel_err', float('nan')):.1e}",
                ]
            )
    for key, what in (
        ("decode_2512_auto", "2512² decode, untiled"),
        ("decode_2512_tiled", "2512² decode, tiled"),
    ):
        v = r["vae"].get(key)
        if v:
            rows.append([what, "", secs(v["s"]), "", "", f"activations {gib(v['activation_peak_gib'])}"])
    head = [
        "size",
        "diffusers decode",
        "qwenfast decode",
        "diffusers encode",
        "qwenfast encode",
        "decode rel. err vs fp32: diffusers bf16 / ours",
    ]
    return table(head, rows) + source([r], "bash bench/pipeline.sh")


def offload(recs: list[Rec]) -> str:
    r = newest(recs, "pipeline.jsonl", lambda r: "offload" in r.data and "none" in r["offload"])
    mem = newest(recs, "pipeline.jsonl", lambda r: "memory" in r.data)
    if r is None:
        return "*No offload record yet.*"
    o = r["offload"]
    rows = []
    for key, what in (
        ("none", "`none`"),
        ("model", "`model`: text encoder streamed"),
        ("blocks", "`blocks`: text encoder and transformer blocks streamed"),
        ("blocks_24gib", "`blocks` under a 24 GiB cap"),
        ("blocks_8gib", "`blocks` under an 8 GiB cap"),
    ):
        v = o.get(key)
        if v:
            rows.append([what, secs(v["s"]), gib(v["peak_gib"]), gib(v.get("predicted_gib"))])
    out = table(["offload", "1024², 4 steps", "peak GPU memory", "planner"], rows)
    if mem is not None:
        out += (
            f"\n\nPlanner against measured peaks over {len(mem['memory']['grid'])} sizes and batches: largest "
            f"error {mem['memory']['max_abs_rel_err']:.2%}."
        )
    return out + source([r, mem], "bash bench/pipeline.sh")


# ---------------------------------------------------------------------------------------------
# tasks, Qwen-Image-2.1


def tasks(recs: list[Rec]) -> str:
    rows, used = [], []
    inp = newest(
        recs,
        "tasks.jsonl",
        lambda r: (
            r["bench"] == "tasks_inpaint" and r.get("size", 1024) == 1024 and "edit-2511" not in r["rows"]
        ),
    )
    big = newest(recs, "tasks.jsonl", lambda r: r["bench"] == "tasks_inpaint" and "edit-2511" in r["rows"])
    for rec in (inp, big):
        if rec is None:
            continue
        used.append(rec)
        for task, v in rec["rows"].items():
            fp8 = v.get("qwenfast_fp8")
            name = (
                f"Edit-2511, {rec['size']}² input and output"
                if task == "edit-2511"
                else f"{task}, strength {v['strength']}"
            )
            rows.append(
                [
                    f"{name}, {rec['steps']} steps",
                    secs(v["diffusers"]["total_s"])
                    + (f" (peak {v['diffusers']['peak_gib']:.0f} GiB)" if rec is big else ""),
                    secs(v["qwenfast"]["total_s"])
                    + (f" (peak {v['qwenfast']['peak_gib']:.0f} GiB)" if rec is big else "")
                    + (f" (FP8 {secs(fp8['total_s'])})" if fp8 else ""),
                    ratio(v["speedup"]),
                    f"{v['mean_abs_diff_images']:.4f}",
                ]
            )
    ctl = newest(recs, "tasks.jsonl", lambda r: r["bench"] == "tasks_control")
    names = {
        "controlnet-60": "ControlNet (60 blocks)",
        "union-2cond": "ControlNet-Union, 2 conditions",
        "inpaint": "ControlNet-Inpainting",
        "layered": "Layered, 4 layers at 640",
    }
    if ctl is not None:
        used.append(ctl)
        for v in ctl["rows"]:
            fp8 = v.get("qwenfast_fp8")
            rows.append(
                [
                    f"{names.get(v['case'], v['case'])}, {ctl['steps']} steps",
                    secs(v["diffusers"]["total_s"]),
                    secs(v["qwenfast"]["total_s"]) + (f" (FP8 {secs(fp8['total_s'])})" if fp8 else ""),
                    ratio(v["speedup"]),
                    f"{v['mean_abs_diff_images']:.4f}",
                ]
            )
    head = ["task (true CFG; 1024² unless said)", "diffusers", "qwenfast", "speed-up", "mean \\|Δ\\|"]
    return table(head, rows) + source(used, "bash bench/tasks.sh")


def qwenimage21(recs: list[Rec]) -> str:
    f = "qwenimage21.jsonl"
    tr = newest(recs, f, lambda r: r.get("what") == "qwen-image-2.1 transformer" and is_default(r))
    rows, used = [], []
    if tr is not None:
        run = [r for r in run_of(recs, tr) if r.get("what") == "qwen-image-2.1 transformer"]
        used += run
        for r in run:
            if r["steps"] != 40:
                continue
            rows.append(
                [
                    f"cached step, {r['dtype']}",
                    ms(r["diffusers_cached_ms"]),
                    ms(r["ours_cached_graph_ms"]),
                    ratio(r["diffusers_cached_ms"] / r["ours_cached_graph_ms"]),
                    sci(r["rel_err_cached"]),
                ]
            )
            rows.append(
                [
                    f"40-step denoise loop, {r['dtype']}",
                    secs(r["diffusers_loop_s"]),
                    secs(r["ours_loop_s"]),
                    ratio(r["speedup_loop"]),
                    "",
                ]
            )
    for size in (1024, 2048):  # records before sizes were recorded are 1024²
        e2e = newest(
            recs,
            f,
            lambda r: (
                r.get("what") == "qwen-image-2.1 e2e diffusers"
                and is_default(r)
                and r.get("size", 1024) == size
            ),
        )
        if e2e is None:
            continue
        run = run_of(recs, e2e)
        used += run
        at = f"end to end {size}² ({gpu_name(e2e)})"

        def add(what: str, diffusers_s: float, ours_s: float, diff: str) -> None:
            rows.append([f"{at}, {what}", secs(diffusers_s), secs(ours_s), ratio(diffusers_s / ours_s), diff])

        add(
            "40 steps, bf16",
            e2e["diffusers_s"],
            e2e["ours_s_cache_off"],
            f"{e2e['mean_abs_diff_vs_diffusers']:.4f}",
        )
        for r in run:
            what = r.get("what")
            if what == "qwen-image-2.1 e2e turbo-4":
                add(
                    "turbo-4 schedule, bf16",
                    r["diffusers_s"],
                    r["ours_s"],
                    f"{r['mean_abs_diff_vs_diffusers']:.4f}",
                )
            elif what == "qwen-image-2.1 e2e fp8":
                add(
                    f"{r['schedule']} schedule ({r['steps']} steps), FP8",
                    r["diffusers_s"],
                    r["ours_s"],
                    f"{r['mean_abs_diff_vs_diffusers_bf16']:.4f}",
                )
            elif what == "qwen-image-2.1 e2e step cache" and r["cache"] != "off":
                full = r["runner_steps_per_call"].get("full")
                add(
                    f"40 steps, step cache `{r['cache']}` ({full} full steps), bf16",
                    e2e["diffusers_s"],
                    r["ours_s"],
                    f"{r['mean_abs_diff_vs_off']:.4f} vs cache off",
                )
    head = [
        "Qwen-Image-2.1 (transformer rows: 1024²)",
        "diffusers (eager)",
        "qwenfast",
        "speed-up",
        "rel. err / mean \\|Δ\\|",
    ]
    return table(head, rows) + source(used, "bash bench/qwenimage21.sh")


# ---------------------------------------------------------------------------------------------
# FP8, memory tiers, attention, several GPUs, serving, LoRA, export


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


def parallel(recs: list[Rec]) -> str:
    r = newest(
        recs,
        "parallel.jsonl",
        lambda r: is_default(r) and "diffusers_1gpu_ms" in (r.get("forward") or {}).get("1024", {}),
    )
    if r is None:
        return "*No multi-GPU record yet: `bash bench/parallel.sh`.*"
    rows = []
    g = r["gpus"]
    for size, v in r["forward"].items():
        rows.append(
            [
                f"transformer forward {size}², `ulysses={g}`, bf16",
                ms(v["qwenfast_1gpu_ms"]),
                ms(v[f"qwenfast_ulysses{g}_ms"]),
                ratio(v[f"qwenfast_ulysses{g}_speedup"]),
                sci(v[f"qwenfast_ulysses{g}_rel_err_vs_1gpu"]),
            ]
        )
        if f"qwenfast_ulysses{g}_fp8_ms" in v:
            rows.append(
                [
                    f"transformer forward {size}², `ulysses={g}`, FP8",
                    ms(v["qwenfast_1gpu_fp8_ms"]),
                    ms(v[f"qwenfast_ulysses{g}_fp8_ms"]),
                    ratio(v[f"qwenfast_ulysses{g}_fp8_speedup"]),
                    sci(v[f"qwenfast_ulysses{g}_fp8_rel_err_vs_1gpu"]),
                ]
            )
        if "diffusers_1gpu_ms" in v:
            rows.append(
                [
                    f"diffusers' own Ulysses-{g}, forward {size}²",
                    ms(v["diffusers_1gpu_ms"]),
                    ms(v[f"diffusers_ulysses{g}_ms"]),
                    ratio(v["diffusers_speedup"]),
                    "",
                ]
            )
    for case, v in r["end_to_end"].items():
        lay = v["layout"]
        rows.append(
            [
                f"{CASES.get(case, case)}, `{lay}`",
                secs(v["one_gpu_s"]),
                secs(v[f"{lay}_s"]),
                ratio(v["speedup"]),
                f"mean \\|Δ\\| {v['mean_abs_diff_images']:.4f}",
            ]
        )
    head = ["case", "one GPU", f"{g} GPUs", "speed-up", "vs one GPU (rel. err)"]
    return table(head, rows) + source([r], f"bash bench/parallel.sh (on {g} GPUs)")


def serve(recs: list[Rec]) -> str:
    rows, used = [], []
    for r in recs:
        if r.file != "serve.jsonl" or r.get("model") != "random-full":
            continue
        used.append(r)
        lv = r["levels"]
        one = next(x for x in lv if x["concurrency"] == 1)
        top = max((x for x in lv if x["max_batch"] > 1), key=lambda x: x["concurrency"])
        rows.append(
            [
                f"{r['size']}², {r['steps']} steps",
                f"{one['images_per_s']:.2f} img/s",
                f"{top['images_per_s']:.2f} img/s (concurrency {top['concurrency']})",
                ratio(top["speedup_vs_sequential"]),
                f"{top['p50_s']:.2f} / {top['p95_s']:.2f}",
            ]
        )
    head = ["requests", "one at a time", "batched", "throughput gain", "p50 / p95 latency, s"]
    return table(head, rows) + source(used, "bash bench/serve.sh")


def lora_fuse(recs: list[Rec]) -> str:
    r = newest(recs, "lora.jsonl", lambda r: r.get("pinned") is True)
    if r is None:
        return "*No LoRA record yet.*"
    rows = [
        ["first load (fuse into the weights)", secs(r["first_load_s"])],
        ["switch LoRA", secs(r["switch_s"])],
        ["unload (bitwise restore)", secs(r["unload_s"])],
        ["host memory for the originals", gib(r["host_originals_GiB"])],
    ]
    head = [f"rank-{r['rank']} LoRA on every block Linear, {r['layers']} layers", "time / size"]
    return table(head, rows) + source([r], "python tools/lora_gpu_check.py")


def onnx_export(recs: list[Rec]) -> str:
    rows, used = [], []
    for r in recs:
        if r.file == "onnx_export.jsonl":
            used.append(r)
            x = r["record"]
            side = x["inputs"]["latents"][-1] * 8
            diff = x.get("max_abs_diff_vs_torch")
            rows.append(
                [
                    f"full-size VAE decoder, {x['dtype']}, {side}²",
                    f"{x['onnx_bytes'] / 2**20:.0f} MiB",
                    secs(x["seconds"]),
                    "—" if diff is None else f"{diff:.1e}",
                ]
            )
    head = ["export", "file", "export time", "onnxruntime vs torch, max \\|Δ\\|"]
    return table(head, rows) + source(used, "bash bench/export.sh")


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


TABLES: dict[str, Callable[[list[Rec]], str]] = {
    "performance": performance, "end-to-end": end_to_end, "transformer": transformer, "vae": vae,
    "offload": offload, "tasks": tasks, "qwenimage21": qwenimage21, "fp8": fp8, "attention": attention,
    "attention-quality": attention_quality, "parallel": parallel, "serve": serve, "lora-fuse": lora_fuse,
    "onnx-export": onnx_export, "quality-demo": quality_demo, "quality-paths": quality_paths,
    "quality-cache": quality_cache, "full-size-check": full_size_check, "cache-pareto": cache_pareto,
}  # fmt: skip
