"""The peers table of `qwenfast bench report`: qwenfast beside diffusers (eager, compile, torchao FP8) and
cache-dit, from the newest `bench peers` record (one GPU, one run, same weights)."""

from __future__ import annotations

from .records import Rec
from .report_tables import gpu_name, ms, newest, ratio, secs, source, table

COLUMNS = {"fwd:1024": "forward 1024²", "fwd:1328": "forward 1328²", "fwd:2048": "forward 2048²",
           "e2e:1024:50:cfg": "1024², 50 steps, true CFG", "e2e:1024:4:nocfg": "1024², 4 steps",
           "e2e:2048:4:nocfg": "2048², 4 steps", "e2e:2512:2:nocfg": "2512², 2 steps"}  # fmt: skip


def _cell(r: dict | None) -> str:
    """Time (× diffusers eager in the same run), and the computed fraction of a cached row."""
    if r is None:
        return "—"
    t = ms(r["ms"]) if "ms" in r else secs(r["s"])
    x = r.get("speedup_vs_diffusers")
    cell = f"{t} ({ratio(x)})" if x is not None and r["row"] != "diffusers eager" else t
    if "computed_fraction" in r:
        cell += f", {r['computed_fraction']:.0%} computed"
    return cell


def peers(recs: list[Rec]) -> str:
    r = newest(recs, "peers.jsonl", lambda r: not r.get("smoke") and r.get("suite", "main") == "main")
    if r is None:
        return "*No peers record yet: `bash bench/peers.sh`.*"
    rows = [x for x in r["rows"] if "row" in x]
    cases = [c for c in COLUMNS if any(x["case"] == c for x in rows)]
    names = list(dict.fromkeys(x["row"] for x in rows))
    by = {(x["row"], x["case"]): x for x in rows}
    body = []
    for name in names:
        diffs = [by[(name, c)] for c in cases if (name, c) in by]
        errs = [x["rel_err_vs_diffusers"] for x in diffs if "rel_err_vs_diffusers" in x]
        imgs = [x["mean_abs_diff_vs_diffusers"] for x in diffs if "mean_abs_diff_vs_diffusers" in x]
        diff = " / ".join(f"{max(v):.1e}" if v else "—" for v in (errs, imgs))
        diff = "—" if name == "diffusers eager" or diff == "— / —" else diff
        body.append([name, *(_cell(by.get((name, c))) for c in cases), diff])
    out = table(
        ["engine", *(COLUMNS[c] for c in cases), "vs diffusers: forward rel. err / image mean |Δ|"], body
    )
    failed = [x for x in r["rows"] if "error" in x]
    notes = [f"- **{x['engine']}**: {x.get('why') or x['error'][:200]}." for x in failed]
    if any("not_compared" in x for x in rows):
        notes.insert(0, "- **ComfyUI native workflow / qwenfast nodes in ComfyUI**: whole workflows (prompt in, image "
                     "out) in one ComfyUI over the same three files (transformer as a scaled fp8 file, as ComfyUI "
                     "ships it); ComfyUI samples with euler on its own schedule (shift 3.1), so these images are "
                     "not compared with diffusers'.")  # fmt: skip
    notes += [f"- **{n['row']}**: {n['why']}. Its own figure: {n['published']}." for n in r["not_run"]]
    head = (
        f"One {gpu_name(r)}, one run: every engine in its own process over the same random full-size "
        f"weights (fingerprints {'equal' if r['same_weights'] else 'NOT equal'}); (×) is the speed-up over "
        "diffusers eager in that run."
    )
    return head + "\n\n" + out + "\n\n" + "\n".join(notes) + "\n" + source([r], "bash bench/peers.sh")


def attention_share(size: int, txt: int = 128) -> float:
    """Attention's share of a Qwen-Image forward's FLOPs at size² (the config's count)."""
    from ..config import TransformerConfig

    cfg, n = TransformerConfig(), (size // 16) ** 2
    return cfg.attention_flops(n, txt) / cfg.flops_per_forward(n, txt)


def peers_highres(recs: list[Rec]) -> str:
    """The newest `bench peers --highres` record: time (× diffusers eager) and peak memory per engine."""
    r = newest(recs, "peers.jsonl", lambda r: not r.get("smoke") and r.get("suite") == "highres")
    if r is None:
        return "*No high-resolution record yet: `STAGE=highres bash bench/peers.sh`.*"
    rows = [x for x in r["rows"] if "row" in x]
    cases = [c for c in COLUMNS if any(x["case"] == c for x in rows)]
    by = {(x["row"], x["case"]): x for x in rows}
    body = []
    for name in dict.fromkeys(x["row"] for x in rows):
        cells = []
        for c in cases:
            x = by.get((name, c))
            cell = _cell(x)
            if x is not None and "peak_gib" in x:
                cell += f", peak {x['peak_gib']:.1f} GiB"
            cells.append(cell)
        body.append([name, *cells])
    failed = [f"- **{x['engine']}**: {x.get('why') or x['error'][:200]}." for x in r["rows"] if "error" in x]
    share = ", ".join(f"{s}² {attention_share(s):.0%}" for s in (1024, 2048, 2512))
    head = (
        f"One {gpu_name(r)}, one run, every engine in its own process over the same random full-size weights; "
        f"(×) is the speed-up over diffusers eager. Attention's share of a forward's FLOPs: {share}."
    )
    out = table(["engine", *(COLUMNS[c] for c in cases)], body)
    return (
        head
        + "\n\n"
        + out
        + "\n"
        + "\n".join(failed)
        + ("\n" if failed else "")
        + source([r], "STAGE=highres bash bench/peers.sh")
    )


BASELINE_MODES = {
    "alone": "diffusers alone, fresh process",
    "bench": "after the transformer bench's setup (qwenfast's model over the same weights)",
    "bench+inductor": "the same, compiler imported",
    "transformer-bench": "`qwenfast bench transformer --compare diffusers`, its diffusers row, with the code of commit",
}


def diffusers_baseline(recs: list[Rec]) -> str:
    """diffusers' eager 1024² forward per GPU and process state (GPU time and host enqueue time), beside
    the diffusers row of the newest `bench transformer` run on that GPU: the two must agree."""
    rs = [r for r in recs if r.file == "diffusers_baseline.jsonl"]
    if not rs:
        return "*No record yet: `python bench/diffusers_baseline.py alone`.*"
    body, used = [], list(rs)
    for gpu in dict.fromkeys(gpu_name(r) for r in rs):
        for r in (r for r in rs if gpu_name(r) == gpu):
            busy = r.get("busy_cpu_processes", 0)
            body.append([
                gpu, BASELINE_MODES.get(r["mode"], r["mode"]) + (f" `{r['code_commit']}`" if r.get("code_commit") else "")
                + (f", {busy} CPU cores kept busy" if busy else "")
                + (", its Python slowed by a line tracer" if r.get("slow_host") else "")
                + (f", all but {r['leave_gib']} GiB of GPU memory taken" if r.get("leave_gib") is not None else ""),
                "yes" if r.get("fa3_installed") else "no", f"`{r['alloc_conf']}`" if r.get("alloc_conf") else "—",
                ms(r["ms"]), ms(r["host_ms"]) if r.get("host_ms") else "—",
                f"{ms(r['ms_after_2s_idle'])} / {ms(r['host_ms_after_2s_idle'])}" if r.get("ms_after_2s_idle") else "—",
            ])  # fmt: skip
        t = newest(
            recs, "transformer.jsonl", lambda x, g=gpu: gpu_name(x) == g and "1024" in x.get("sizes", {})
        )
        d = t and t["sizes"]["1024"]["variants"].get("diffusers eager")
        if d:
            alone = [
                r
                for r in rs
                if gpu_name(r) == gpu
                and r["mode"] == "alone"
                and not r.get("busy_cpu_processes")
                and not r.get("slow_host")
                and r.get("leave_gib") is None
            ]
            same = [
                r for r in alone if r.get("commit") == t.get("commit")
            ]  # same machine session, where recorded
            alone = [r["ms"] for r in same or alone]
            agree = f" ({100 * (d['ms'] / alone[-1] - 1):+.1f}% vs alone)" if alone else ""
            body.append([gpu, "`qwenfast bench transformer --compare diffusers`, its diffusers row" + agree,
                         "", "", ms(d["ms"]), "", ""])  # fmt: skip
            used.append(t)
    head = ["GPU", "diffusers' forward, 1024², one process each", "FA3 installed", "allocator", "GPU time",
            "host enqueue", "again after 2 s idle: GPU / host"]  # fmt: skip
    cmd = (
        "python bench/diffusers_baseline.py alone|bench|bench+inductor [--busy N] [--slow-host] [--leave-gib G]; "
        "bash bench/transformer.sh"
    )
    return table(head, body) + source(used, cmd)


SUMMARY_ROWS = ("diffusers eager", "diffusers + regional compile", "diffusers + torchao float8 + regional compile",
                "diffusers + cache-dit fast step mask + TaylorSeer", "ComfyUI native workflow (fp8 scaled file)",
                "qwenfast bf16", "qwenfast FP8", "qwenfast FP8 + fast cache",
                "qwenfast nodes in ComfyUI (FP8, same files)")  # fmt: skip


def peers_summary(recs: list[Rec]) -> str:
    """README: the peers table's headline rows (what a user would run instead, and qwenfast)."""
    r = newest(recs, "peers.jsonl", lambda r: not r.get("smoke") and r.get("suite", "main") == "main")
    if r is None:
        return "*No peers record yet: `bash bench/peers.sh`.*"
    by = {(x["row"], x["case"]): x for x in r["rows"] if "row" in x}
    cases = [c for c in ("fwd:1024", "e2e:1024:50:cfg", "e2e:1024:4:nocfg") if any(k[1] == c for k in by)]
    body = [[name, *(_cell(by.get((name, c))) for c in cases)] for name in SUMMARY_ROWS
            if any((name, c) in by for c in cases)]  # fmt: skip
    return (
        table(
            [f"one {gpu_name(r)}, same weights, one process per engine", *(COLUMNS[c] for c in cases)], body
        )
        + "\n\nLossy rows: FP8, torchao float8 and the step caches. All rows and the peers not run here: "
        "[docs/benchmarks.md](docs/benchmarks.md#beside-the-peers)." + source([r], "bash bench/peers.sh")
    )
