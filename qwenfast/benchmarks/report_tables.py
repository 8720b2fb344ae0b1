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
# several GPUs, serving, LoRA, export


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


TABLES: dict[str, Callable[[list[Rec]], str]] = {
    "performance": performance, "end-to-end": end_to_end, "transformer": transformer, "vae": vae,
    "offload": offload, "tasks": tasks, "qwenimage21": qwenimage21, "parallel": parallel, "serve": serve,
    "lora-fuse": lora_fuse, "onnx-export": onnx_export,
}  # fmt: skip
