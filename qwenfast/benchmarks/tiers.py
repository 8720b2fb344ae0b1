"""`qwenfast bench tiers`: full-size Qwen-Image under GPU memory caps, one fresh process per cap (GPU only).

What a user with a 24 / 16 / 12 / 8 GiB card gets from `--vram N`: each cap runs in its own process
(nothing left in the allocator from another cap), which builds the full-size pipeline with random
weights, plans it with `configure(weights=..., vram_gib=cap)` (runtime/tiers.py), then caps the process
with `torch.cuda.set_per_process_memory_fraction` before the first image. Per cap and workload:
time (fresh prompt, and the same prompt again), peak allocated vs the planner's prediction for that
call, host->GPU bytes per image (counted by the offloaders) vs the plan's, the plan itself. The
`resident` row (no cap, CUDA graphs) is the base of the "x resident" column.

Workloads: `4`: 1024² 4 steps without CFG (a Lightning-style LoRA's recipe); `50`: 1024² 50 steps with
true CFG 4.0. One JSON record (`--results DIR` appends it to DIR/tiers.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import torch

from . import RESULTS_HELP, emit, results_dir, versions

GiB = 1024**3
WORKLOADS = {"4": dict(steps=4, cfg=1.0), "50": dict(steps=50, cfg=4.0)}


def _call(pipe, prompt: str, steps: int, cfg: float):
    return pipe(
        prompt,
        height=1024,
        width=1024,
        num_inference_steps=steps,
        true_cfg_scale=cfg,
        negative_prompt=" " if cfg > 1 else None,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(0),
    ).images


def _bytes(pipe) -> tuple[int, int]:
    """(transformer block bytes, text-encoder bytes) copied host -> GPU so far."""
    st = pipe._block_streamer
    blocks = st.bytes_in if st is not None else 0
    return blocks, pipe.streamed_bytes() - blocks


def _timed(pipe, prompt: str, steps: int, cfg: float) -> dict:
    """A warm-up with `prompt` (same shapes: graphs captured, the schedule's modulation entries made; a
    first decode's out-of-memory retry), then
    a timed call that encodes the prompt again (`s`: a new prompt of the same length), then the same
    prompt once more (`same_prompt_s`: its embedding cached). Bytes host -> GPU of the timed calls, and
    the transformer forwards they ran, eager or replayed (CFG with prompts of unequal length runs two per step)."""
    forwards = [0]
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        _call(pipe, prompt, steps, cfg)
        pipe.text_encoder.clear_cache()
        torch.cuda.reset_peak_memory_stats()  # the peak of the timed calls (a warm-up's OOM retry is not one)
        out = {}
        for key in ("s", "same_prompt_s"):
            torch.cuda.synchronize()
            (b0, e0), f0, t0 = _bytes(pipe), forwards[0] + pipe.graph_stats()["replays"], time.perf_counter()
            _call(pipe, prompt, steps, cfg)
            torch.cuda.synchronize()
            out[key] = round(time.perf_counter() - t0, 3)
            (b1, e1) = _bytes(pipe)
            out["forwards"] = forwards[0] + pipe.graph_stats()["replays"] - f0
            out[f"{'' if key == 's' else 'same_prompt_'}block_gb"] = round((b1 - b0) / 1e9, 2)
            out[f"{'' if key == 's' else 'same_prompt_'}text_encoder_gb"] = round((e1 - e0) / 1e9, 2)
        return out
    finally:
        hook.remove()


def _h2d_gbps() -> float:
    """Pinned host -> GPU copy rate of this machine (GB/s, 1 GiB copies): what streaming is bound by."""
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return round(5 * GiB / (time.perf_counter() - t0) / 1e9, 1)


def one(cap: float | None, weights: str, workloads: tuple[str, ...]) -> dict:
    """One process's row: `cap` GiB (None: resident, no cap)."""
    from ..runtime.memory import MemoryPlanner, graph_pools
    from .pipeline import build

    t0 = time.perf_counter()
    pipe, _ = build(False, diffusers_transformer=False)
    pipe.set_progress_bar_config(disable=True)
    row: dict[str, Any] = {
        "cap_gib": cap,
        "build_s": round(time.perf_counter() - t0, 1),
        "h2d_gbps": _h2d_gbps(),
    }
    t0 = time.perf_counter()
    pipe.configure(weights=weights, **({"vram_gib": cap} if cap else {}))
    row["configure_s"] = round(time.perf_counter() - t0, 1)
    row["options"] = {
        k: getattr(pipe.options, k) for k in ("weights", "offload", "offload_budget", "cuda_graphs")
    }
    plan = pipe.memory_plan
    if plan is not None:
        row["plan"] = {k: v for k, v in vars(plan).items() if k != "notes"}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    row["allocated_after_setup_gib"] = round(torch.cuda.memory_allocated() / GiB, 2)
    if cap:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total))
    st, te = pipe._block_streamer, pipe.text_encoder.layer_streamer
    for name in workloads:
        w = WORKLOADS[name]
        p = f"a lighthouse on a cliff at dusk, {name} steps"
        try:
            torch.cuda.reset_peak_memory_stats()
            ooms = torch.cuda.memory_stats().get("num_ooms", 0)
            r = _timed(pipe, p, **w)
            peak = torch.cuda.max_memory_allocated()
            pool, _ = graph_pools(torch.device("cuda"))
            tr = pipe.transformer
            table = tr.modulation_table
            entry = len(tr.blocks) * 2 * 6 * tr.cfg.inner_dim * tr.dtype.itemsize  # one timestep's vectors
            # the decode that ran: tiled when the plan said so or an untiled one ran out of memory (the
            # VAE then tiles that size from the first OOM on: runtime/oom.py)
            oom_px = pipe.vae.untiled_oom
            tiled = bool(plan is not None and plan.vae_tiled) or (
                oom_px is not None and oom_px <= 1024 * 1024
            )
            planner = MemoryPlanner.from_pipeline(pipe)
            kw = dict(
                tile=256 if tiled else None,
                cfg=w["cfg"] > 1,
                offload=pipe.options.offload,
                resident_blocks=len(st.resident) if st is not None else 0,
                modulation_on_host=bool(st is not None and st.held),
                te_resident_layers=len(te.resident) if te is not None else 0,
            )
            pred = planner.predict(1024, 1024, 1, **kw)
            pred_peak = pred.peak + (len(table) * entry if table is not None else 0)
            # graphs hold the denoise activations in their pool from the capture on: replays allocate
            # nothing, so the timed calls' peak leaves them out; "held" counts the pool on both sides
            streamed_graphs = bool(pipe.graph_stats()["resident"]) and st is not None
            held = planner.predict(1024, 1024, 1, graph_pool=streamed_graphs, **kw)
            held_pred = held.peak + pred_peak - pred.peak
            row[name] = {
                **r,
                "peak_gib": round(peak / GiB, 2),
                "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / GiB, 2),
                "predicted_gib": round(pred_peak / GiB, 2),
                "prediction_err": round(pred_peak / peak - 1, 3),
                "planned_block_gb": None if plan is None else round(r["forwards"] * plan.step_bytes / 1e9, 2),
                "planned_prompt_gb": None if plan is None else round(plan.prompt_bytes / 1e9, 2),
                "graphs_replayed": bool(pipe.graph_stats()["resident"]),
                "graph_pool_gib": round(pool / GiB, 2),
                "held_peak_gib": round((peak + pool) / GiB, 2),
                "predicted_held_gib": round(held_pred / GiB, 2),
                "held_prediction_err": round(held_pred / (peak + pool) - 1, 3),
                "planned_graph_pool_gib": round((pred.phases["denoise"] - pred.resident) / GiB, 2),
                "vae_tiled": tiled,
                "ooms": torch.cuda.memory_stats().get("num_ooms", 0) - ooms,  # caught: VAE tiled after
                "vae_untiled_oom": pipe.vae.untiled_oom,
            }
        except Exception as e:  # noqa: BLE001 - the record says what happened
            row[name] = {
                "error": f"{type(e).__name__}: {e}"[:400],
                "where": [f.name for f in traceback.extract_tb(e.__traceback__)[-6:]],
            }
        print(f"  {cap or 'resident'} / {name} steps: {json.dumps(row[name])}", flush=True)
    if st is not None:
        row["resident_blocks"], row["streamed_blocks"] = len(st.resident), len(st.order)
    if te is not None:
        row["te_resident_layers"] = len(te.resident)
    return row


def run(
    caps: tuple[float, ...], weights: str, workloads: tuple[str, ...], out_dir=None, resident: bool = True
) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit(
            "error: `qwenfast bench tiers` measures full-size models on a GPU; none is available"
        )
    rec: dict[str, Any] = {
        "bench": "tiers",
        **versions(),
        "weights": weights,
        "workloads": list(workloads),
        "rows": [],
    }
    env = dict(
        os.environ,
        PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    )
    for cap in ((None,) if resident else ()) + tuple(caps):
        cmd = [
            sys.executable,
            "-m",
            "qwenfast.benchmarks.tiers",
            "--one",
            str(cap or 0),
            "--weights",
            weights,
            "--workloads",
            ",".join(workloads),
        ]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            row = {"cap_gib": cap, "error": f"exit {r.returncode}: {r.stderr[-600:]}"}
        else:
            row = json.loads(lines[-1])
        row["process_s"] = round(time.perf_counter() - t0, 1)
        rec["rows"].append(row)
    base = next((r for r in rec["rows"] if r.get("cap_gib") is None), None)
    for r in rec["rows"]:
        for name in workloads:
            if base and "s" in r.get(name, {}) and "s" in base.get(name, {}):
                r[name]["x_resident"] = round(r[name]["s"] / base[name]["s"], 2)
                r[name]["same_prompt_x_resident"] = round(
                    r[name]["same_prompt_s"] / base[name]["same_prompt_s"], 2
                )
    print(
        f"{'cap':>9} {'steps':>5} {'s':>7} {'x res':>6} {'same':>7} {'x res':>6} {'peak':>6} {'pred':>6} {'H2D GB':>7}"
    )
    for r in rec["rows"]:
        for name in workloads:
            c = r.get(name, {})
            if "s" in c:
                cap = f"{r['cap_gib']:g} GiB" if r["cap_gib"] else "resident"
                print(
                    f"{cap:>9} {name:>5} {c['s']:7.3f} {c.get('x_resident', 1):6.2f} {c['same_prompt_s']:7.3f} "
                    f"{c.get('same_prompt_x_resident', 1):6.2f} {c['peak_gib']:6.2f} {c['predicted_gib']:6.2f} {c['block_gb']:9.1f}"
                )
    emit(rec, "tiers.jsonl", out_dir)
    return rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--caps", default="24,16,12,8", help="GiB caps, one fresh process each (default 24,16,12,8)"
    )
    p.add_argument(
        "--weights",
        default="fp8",
        choices=("bf16", "fp8", "int8", "auto"),
        help="weight format (default fp8)",
    )
    p.add_argument(
        "--workloads", default="4,50", help="4 (1024² 4 steps, no CFG) and/or 50 (50 steps, CFG 4)"
    )
    p.add_argument("--no-resident", action="store_true", help="skip the uncapped base row")
    p.add_argument("--results", default=None, metavar="DIR", help=RESULTS_HELP)


def run_from_args(a: argparse.Namespace) -> int:
    run(
        tuple(float(c) for c in a.caps.split(",") if c),
        a.weights,
        tuple(w for w in a.workloads.split(",") if w),
        results_dir(a.results),
        resident=not a.no_resident,
    )
    return 0


if __name__ == "__main__":  # one cap's process: `python -m qwenfast.benchmarks.tiers --one CAP`
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", type=float, required=True)
    ap.add_argument("--weights", default="fp8")
    ap.add_argument("--workloads", default="4,50")
    a = ap.parse_args()
    print(
        json.dumps(one(a.one or None, a.weights, tuple(w for w in a.workloads.split(",") if w))), flush=True
    )
