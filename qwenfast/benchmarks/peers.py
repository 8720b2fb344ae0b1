"""`qwenfast bench peers`: qwenfast beside what users would run instead, on one GPU, same weights, one run.

Rows (each engine in its own process, `peers_worker.py`, so no engine's globals reach another's row):
- diffusers 0.42.1 eager; + regional `torch.compile` (`compile_repeated_blocks(fullgraph=True)`);
  + torchao float8 dynamic quantisation (rowwise scales) + regional compile (diffusers' documented
  recipe, applied with `quantize_` since the weights are built, not loaded);
- diffusers + cache-dit (PyPI `cache-dit`): its documented DBCache settings, + TaylorSeer, + its static
  "fast" step mask; computed fraction = calls of the last block / calls of the transformer;
- qwenfast bf16, FP8, FP8 + 8-bit attention, each step-cache preset (computed fraction from its runner);
- ComfyUI's own Qwen-Image model (`peers_comfyui`: its model, attention and ops from the work tree named
  by `QWENFAST_COMFYUI`), bf16 and its fp8 scaled weights path, forward cases; and end to end
  (`comfyui-workflow`, `peers_comfyui_e2e`): ComfyUI's own Qwen-Image workflow beside the qwenfast nodes
  in the same ComfyUI over the same files; without `QWENFAST_COMFYUI` both are listed as not run;
- peers that cannot be brought to the GPU machine: a row that says why, with their own published figure.

Cases: one transformer forward at 1024², 1328², 2048² (median of 10, CUDA events; the host's
time to return from a call beside it: near the GPU time when the host is the limit, or when the engine
waits on the GPU inside its forward), and end to end (text encoder + denoise + VAE)
1024² 50 steps true CFG and 1024² 4 steps; `--highres`: the forward at 2048² and end to end 2048² 4 steps and
2512² 2 steps, each with its peak memory (the VAE tiles as each engine decides), a table of their own.
Each full-compute row's output is compared with diffusers
eager's (forward: relative error; images: mean |difference|); cached rows give their computed fraction.
Same weights: every worker draws them from one seed in one order and reports a fingerprint; the run
fails if two differ. `--smoke`: the demo model on the CPU (the harness only; times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import RESULTS_HELP, emit, results_dir, versions
from .peers_comfyui import ENV as COMFYUI_ENV
from .peers_comfyui import NOT_RUN_E2E as COMFYUI_NOT_E2E
from .peers_worker import CASES, ENGINES, HIGHRES_CASES, MAIN_CASES

CACHE_PRESETS = ("balanced", "fast")
# Peers we could not run on the GPU machine: why, and the figure they publish (their GPU, their setup).
NOT_RUN = {
    "SGLang-diffusion": (
        "not run: its CUDA kernels (sgl-kernel 0.3.21, a 536 MB wheel) cannot be carried to the GPU machine, "
        "which has no network and takes 64 MiB a call",
        "13.1 s, 1024² 50 steps true CFG, one H100 (its CI baselines, 2026-04); 4.53 s with cache-dit",
    ),
    "nunchaku (SVDQuant 4-bit)": (
        "not run: PyPI holds only a 17 kB placeholder; its wheels come per torch and CUDA version from its "
        "GitHub releases, which the GPU machine cannot reach",
        "users report no speed-up on A100 (its issues #701, #899); ~3 GB VRAM with offload",
    ),
    "LightX2V": (
        "not run: not on PyPI; a source install needs its own kernel builds and network on the GPU machine",
        "Edit-2511 50 steps CFG DiT 31.9 s vs diffusers 46.8 s, one H100 (its docs)",
    ),
}
BASE = "diffusers eager"
COMFYUI = "ComfyUI native (comfy/ldm/qwen_image)"
COMFYUI_E2E = "ComfyUI native workflow, end to end"


def not_run(engines: list[str], cases: list[str]) -> dict[str, tuple[str, str]]:
    """NOT_RUN, plus ComfyUI's engines that cannot run: without a work tree to import, each asked ComfyUI
    engine is listed (`COMFYUI` / `COMFYUI_E2E` then name the engine as skipped), and its end-to-end
    rows are listed when end-to-end cases are asked without the `comfyui-workflow` engine."""
    out = dict(NOT_RUN)
    tree = bool(os.environ.get(COMFYUI_ENV))
    missing = (f"not run: ${COMFYUI_ENV} names no ComfyUI work tree", "no published timing")
    if "comfyui" in engines and (not tree or not any(CASES[c][0] == "fwd" for c in cases)):
        out[COMFYUI] = missing if not tree else ("forward cases only: none asked", "no published timing")
    if any(CASES[c][0] == "e2e" for c in cases) and {"comfyui", "comfyui-workflow"} & set(engines):
        if "comfyui-workflow" not in engines:
            out[COMFYUI_E2E] = (COMFYUI_NOT_E2E, "no published timing")
        elif not tree:
            out[COMFYUI_E2E] = missing
    return out


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _worker(
    engine: str, cases: list[str], caches: list[str], out: Path, smoke: bool, timeout_s: float
) -> list[dict]:
    """Run one engine's process; its rows, or one error row naming the engine and its last output lines."""
    cmd = [sys.executable, "-m", "qwenfast.benchmarks.peers_worker", engine, "--out", str(out)]
    cmd += [f"--case={c}" for c in cases] + [f"--cache={c}" for c in caches] + (["--smoke"] if smoke else [])
    rows, tail = [], []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        for line in proc.stdout:  # streamed: a long run is never silent
            if line.startswith("PEERS_ROW "):
                rows.append(json.loads(line[len("PEERS_ROW ") :]))
                r = rows[-1]
                print(f"  {r['case']:18s} {r['row']:52s} {r.get('ms', r.get('s'))}", flush=True)
            else:
                tail = (tail + [line.rstrip()])[-15:]
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                tail.append(f"killed after {timeout_s:.0f} s")
                break
    finally:
        rc = proc.wait()
    if rc != 0:
        rows.append({"engine": engine, "error": f"exit {rc}: " + " | ".join(tail[-6:])})
        print(f"  {engine}: failed (exit {rc})\n    " + "\n    ".join(tail), flush=True)
    return rows


def compare(rows: list[dict], out: Path) -> None:
    """Add each row's difference from diffusers eager (same case) and its speed-up over it, in place."""
    base = {r["case"]: r for r in rows if r.get("row") == BASE}
    for r in rows:
        b = base.get(r.get("case"))
        if "error" in r or b is None:
            continue
        key = "ms" if "ms" in r else "s"
        r["speedup_vs_diffusers"] = round(b[key] / r[key], 2)
        if "computed_fraction" in r or "not_compared" in r:
            continue  # a cached row's difference is a quality question (docs/quality.md), not a tolerance;
            # ComfyUI's workflow samples on its own schedule (peers_comfyui_e2e)
        a, ref = np.load(out / r["output"]), np.load(out / b["output"])
        if CASES[r["case"]][0] == "fwd":
            r["rel_err_vs_diffusers"] = float(f"{_rel_err(a, ref):.3e}")
        else:
            r["mean_abs_diff_vs_diffusers"] = float(f"{np.abs(a.astype(np.float64) - ref).mean():.3e}")


def check_same_weights(rows: list[dict]) -> bool:
    """Every worker's fingerprint is the same: the engines ran the same weights."""
    prints = {json.dumps(r["fingerprint"]) for r in rows if "fingerprint" in r}
    return len(prints) <= 1


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table per case (what the run prints)."""
    lines = []
    for case in CASES:
        rs = [r for r in rows if r.get("case") == case]
        if not rs:
            continue
        unit = "ms" if CASES[case][0] == "fwd" else "s"
        lines.append(f"\n{case}  ({unit}; x = speed-up over diffusers eager, same run)")
        for r in rs:
            diff = r.get("rel_err_vs_diffusers", r.get("mean_abs_diff_vs_diffusers", ""))
            frac = f"computed {r['computed_fraction']:.0%}" if "computed_fraction" in r else f"diff {diff}"
            frac = "not compared" if "not_compared" in r else frac
            host = f"host {r['host_ms']} ms" if "host_ms" in r else f"peak {r.get('peak_gib', '')} GiB"
            x = r.get("speedup_vs_diffusers", "")
            lines.append(f"  {r['row']:52s} {r.get(unit, ''):>9} {x!s:>6}x  {frac:22s} {host}")
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['engine']}: {r['error']}")
    return "\n".join(lines)


def run(
    cases: list[str],
    engines: list[str],
    caches: list[str],
    out_dir: Path | None,
    smoke: bool = False,
    timeout_s: float = 900.0,
    keep: str | None = None,
) -> dict:
    t0 = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qwenfast-peers-") as tmp:
        out = Path(keep) if keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        if keep and (out / "rows.jsonl").is_file():  # engines of an earlier invocation, same weights
            earlier = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
            rows += [r for r in earlier if r["engine"] not in engines]
        skipped = not_run(engines, cases)
        for engine in engines:
            if engine == "comfyui" and COMFYUI in skipped:
                continue
            if engine == "comfyui-workflow" and not os.environ.get(COMFYUI_ENV):
                continue
            print(f"{engine}: own process", flush=True)
            new = _worker(engine, cases, caches, out, smoke, timeout_s)
            rows += new
            if keep:
                with open(out / "rows.jsonl", "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in new if "error" not in r)
        compare(rows, out)
    record = {
        "bench": "peers",
        **versions(),
        "smoke": smoke,
        "suite": "highres" if set(cases) <= set(HIGHRES_CASES) else "main",  # (two tables: report_peers)
        "cases": cases,
        "same_weights": check_same_weights(rows),
        "rows": [{k: v for k, v in r.items() if k not in ("output", "fingerprint")} for r in rows],
        "not_run": [{"row": k, "why": why, "published": pub} for k, (why, pub) in skipped.items()],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(table(rows))
    for n in record["not_run"]:
        print(f"  not run: {n['row']}: {n['why']} (published: {n['published']})")
    if not record["same_weights"]:
        print("WARNING: the engines' weight fingerprints differ: the rows are not comparable", flush=True)
    emit(record, "peers.jsonl", out_dir)
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case", action="append", choices=list(CASES), help=f"cases (default: {', '.join(MAIN_CASES)})"
    )
    p.add_argument(
        "--highres",
        action="store_true",
        help=f"the high-resolution cases instead ({', '.join(HIGHRES_CASES)}): their own table, with peak memory",
    )
    p.add_argument("--engine", action="append", choices=list(ENGINES), help="engines (default: all)")
    p.add_argument(
        "--cache",
        action="append",
        choices=[*CACHE_PRESETS, "none"],
        help="qwenfast step-cache presets (default: both; none: no cached rows)",
    )
    p.add_argument("--smoke", action="store_true", help="the demo model on the CPU (checks the harness)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine process (default 900)")
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="keep rows and outputs in DIR; a later run with the same DIR adds its engines to them "
        "(one GPU machine, engines over several invocations)",
    )
    p.add_argument("--results", metavar="DIR", help=RESULTS_HELP)


def run_from_args(a: argparse.Namespace) -> int:
    rec = run(
        a.case or list(HIGHRES_CASES if a.highres else MAIN_CASES),
        a.engine or list(ENGINES),
        [c for c in a.cache or CACHE_PRESETS if c != "none"],
        results_dir(a.results),
        smoke=a.smoke,
        timeout_s=a.timeout,
        keep=a.keep,
    )
    return 0 if rec["same_weights"] and not any("error" in r for r in rec["rows"]) else 1
