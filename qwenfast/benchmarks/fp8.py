"""`qwenfast bench fp8`: FP8 loading, LoRA on an FP8 base, and FP8 under a memory budget (GPU, full size).

Stages, one JSON record at the end (`--results DIR` appends it to DIR/fp8.jsonl):
- `load`: a full-size random bf16 transformer is written as a ComfyUI FP8 file (`weight_scale` +
  `comfy_quant`, e4m3 per-tensor scales, modulation/embedders bf16) and loaded back with `fp8=True`:
  GPU peak during the load vs the FP8 model's bytes; its forward at 1024² vs the same file
  dequantised to bf16 and quantised after loading (the old path), relative error.
- `lora`: the full pipeline (random weights; the embedded tokenizer), a rank-64 LoRA on every
  block Linear: 1024² 4-step images of bf16, bf16 + fused LoRA, FP8, FP8 + unmerged LoRA; mean |Δ|
  of FP8+LoRA vs bf16+LoRA against FP8 vs bf16; switch times (state dict and file); bitwise unload;
  a CUDA graph captured with LoRA A replayed after a switch to B vs eager B; forward ms with/without.
- `budget`: the FP8 pipeline resident (4-step 1024², fresh prompt), then `offload="blocks"` planned
  under `set_per_process_memory_fraction` = 24 GiB and 16 GiB: time, peak, planner prediction,
  resident block count, image difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import RESULTS_HELP, emit, median_ms, rel_err, results_dir, versions

GiB = 1024**3


def _sync() -> None:
    torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _forward_inputs(size: int = 1024, txt: int = 128):
    g = torch.Generator("cuda").manual_seed(0)
    n = (size // 16) ** 2
    x = torch.randn(1, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    emb = torch.randn(1, txt, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.full((1,), 0.7, device="cuda", dtype=torch.bfloat16)
    return x, emb, None, t, [(1, size // 16, size // 16)]


def write_fp8_file(model: torch.nn.Module, path: Path) -> int:
    """Our bf16 transformer -> a ComfyUI FP8 file (diffusers names, e4m3 + per-tensor `weight_scale` +
    `comfy_quant` for the block Linears; the rest bf16). Returns the file size."""
    from safetensors.torch import save_file

    from ..models.transformer import BLOCK_LINEARS, split_qkv_key

    marker = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        keys = split_qkv_key(k)
        parts = list(zip(keys, v.chunk(3))) if keys else [(k, v)]
        layer = k.rsplit(".", 1)[0]
        fp8 = k.endswith(".weight") and any(layer.endswith("." + n) for n in BLOCK_LINEARS)
        for name, t in parts:
            if not fp8:
                out[name] = t.contiguous().cpu()
                continue
            s = (t.float().abs().amax() / 448.0).clamp_min(1e-12)
            out[name] = (t.float() / s).to(torch.float8_e4m3fn).cpu()
            base = name[: -len(".weight")]
            out[base + ".weight_scale"] = s.reshape(()).cpu()
            out[base + ".comfy_quant"] = marker.clone()
    save_file(out, str(path))
    return path.stat().st_size


def load_stage(tmp: Path) -> dict:
    from ..kernels.fp8_linear import quantize_model
    from ..loading.single_file import load_transformer_file
    from ..runtime.cuda_graphs import CudaGraphRunner
    from .transformer import build

    tr, _ = build(60, compare=False)
    f = tmp / "qwen_image_fp8_comfy.safetensors"
    t0 = time.perf_counter()
    size = write_fp8_file(tr, f)
    write_s = time.perf_counter() - t0
    del tr
    _free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    m8 = load_transformer_file(f, "cuda", torch.bfloat16, fp8=True)
    _sync()
    load_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    model_bytes = sum(t.numel() * t.element_size() for t in (*m8.parameters(), *m8.buffers()))
    inp = _forward_inputs()
    graphs = CudaGraphRunner(m8)
    with torch.no_grad():
        y8 = m8(*inp).float()
        fwd_ms = median_ms(lambda: graphs(*inp), 1, 5)
    graphs.clear()
    m8 = None
    _free()
    old = load_transformer_file(f, "cuda", torch.bfloat16)  # dequantised to bf16, then quantised per row
    quantize_model(old)
    with torch.no_grad():
        y_old = old(*inp).float()
    old = None
    _free()
    f.unlink()
    row = {
        "file_gib": round(size / GiB, 2),
        "write_s": round(write_s, 1),
        "load_s": round(load_s, 1),
        "load_peak_gib": round(peak / GiB, 2),
        "fp8_model_gib": round(model_bytes / GiB, 2),
        "peak_minus_model_gib": round((peak - model_bytes) / GiB, 2),
        "forward_rel_err_vs_dequant_path": round(rel_err(y8, y_old), 5),
        "forward_ms_graph": round(fwd_ms, 1),
    }
    print(f"  load: {json.dumps(row)}", flush=True)
    return row


def _lora_sd(model: torch.nn.Module, rank: int, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """A random rank-`rank` LoRA on every block Linear (diffusers names, Q/K/V separate), on the CPU."""
    from ..models.transformer import BLOCK_LINEARS, split_qkv_key

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, m in model.named_modules():
        if not (n.startswith("transformer_blocks.") and any(n.endswith("." + b) for b in BLOCK_LINEARS)):
            continue
        keys = split_qkv_key(n + ".weight")
        N = m.out_features // (3 if keys else 1)
        for k in [x.removesuffix(".weight") for x in keys] if keys else [n]:
            sd[f"transformer.{k}.lora_A.weight"] = (
                torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            ).bfloat16()
            sd[f"transformer.{k}.lora_B.weight"] = (torch.randn(N, rank, generator=g) * scale).bfloat16()
    return sd


def _image(pipe, prompt: str) -> np.ndarray:
    return pipe(
        prompt,
        height=1024,
        width=1024,
        num_inference_steps=4,
        true_cfg_scale=1.0,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(0),
    ).images


def _timed(pipe, prompt: str) -> tuple[float, np.ndarray]:
    """A warm-up with the same prompt (same shapes: graphs captured), then a timed call that encodes again."""
    _image(pipe, prompt)
    pipe.text_encoder.clear_cache()
    _sync()
    t0 = time.perf_counter()
    img = _image(pipe, prompt)
    _sync()
    return time.perf_counter() - t0, img


def lora_stage(pipe, tmp: Path, rank: int = 64, fmt: str = "fp8") -> dict:
    """LoRA on an 8-bit base (`fmt` "fp8" or "int8", one-way for `pipe`): the image difference it adds
    over the base's own (ratio), unload bitwise, switch times, graphs kept across switches, speed."""
    from safetensors.torch import save_file

    from ..kernels.lowbit import LowBitLinear

    def codes(m) -> torch.Tensor:
        return m.weight_fp8.view(torch.uint8) if fmt == "fp8" else m.weight_int8

    a, b = _lora_sd(pipe.transformer, rank, 1, 0.02), _lora_sd(pipe.transformer, rank, 2, 0.02)
    fb = tmp / "lora_b.safetensors"
    save_file(b, str(fb))
    p = "a lighthouse on a cliff at dusk"
    pipe.configure(cuda_graphs=False)
    bf16 = _image(pipe, p)
    pipe.load_lora(a, 1.0, name="a")
    bf16_a = _image(pipe, p)
    pipe.configure(**{fmt: True})  # the LoRA moves beside the 8-bit GEMMs
    fp8_a = _image(pipe, p)
    inp = _forward_inputs()
    pipe.configure(cuda_graphs=True)
    with torch.no_grad():
        ms_lora = median_ms(lambda: pipe._forward(*inp), 1, 5)
        e2e_lora = _timed(pipe, p + " timed")[0]
    pipe.configure(cuda_graphs=False)
    layers = [m for m in pipe.transformer.modules() if isinstance(m, LowBitLinear)]
    digest = [int(codes(m).float().sum()) for m in layers[:8]]
    pipe.unload_lora()
    fp8 = _image(pipe, p)
    pipe.configure(cuda_graphs=True)
    with torch.no_grad():
        ms_plain = median_ms(lambda: pipe._forward(*inp), 1, 5)
        e2e_plain = _timed(pipe, p + " timed")[0]
    unload_bitwise = digest == [int(codes(m).float().sum()) for m in layers[:8]]
    # switches (graphs on: captured with A, replayed after switching to B)
    pipe.load_lora(a, 1.0, name="a")
    _image(pipe, p)
    captured = [id(v) for v in pipe._graphs.graphs.values()]
    switches = {}
    for what, src in (("state_dict", b), ("file", str(fb)), ("back_to_a", a)):
        _sync()
        t0 = time.perf_counter()
        pipe.set_loras([(src, 1.0, "b" if what != "back_to_a" else "a")])
        _sync()
        switches[what] = round(time.perf_counter() - t0, 3)
    pipe.set_loras([(b, 1.0, "b")])
    graph_b = _image(pipe, p)
    kept = bool(captured) and [id(v) for v in pipe._graphs.graphs.values()] == captured  # no re-capture
    pipe.configure(cuda_graphs=False)
    eager_b = _image(pipe, p)
    pipe.unload_lora()
    fb.unlink()
    e_lora, e_fp8 = float(np.abs(fp8_a - bf16_a).mean()), float(np.abs(fp8 - bf16).mean())
    row = {
        "rank": rank,
        "format": fmt,
        "lora_effect_mean_abs": round(float(np.abs(bf16_a - bf16).mean()), 4),
        f"{fmt}_lora_vs_bf16_lora": round(e_lora, 5),
        f"{fmt}_vs_bf16": round(e_fp8, 5),
        "ratio": round(e_lora / max(e_fp8, 1e-12), 3),
        "switch_s": switches,
        "unload_bitwise": unload_bitwise,
        "graph_after_switch_vs_eager_max_abs": float(np.abs(graph_b - eager_b).max()),
        "graphs_kept_across_switches": kept,
        f"forward_ms_{fmt}": round(ms_plain, 1),
        f"forward_ms_{fmt}_lora": round(ms_lora, 1),
        f"e2e_4step_s_{fmt}": round(e2e_plain, 3),
        f"e2e_4step_s_{fmt}_lora": round(e2e_lora, 3),
        "graphs_enabled": pipe._graphs.enabled,
    }
    print(f"  lora: {json.dumps(row)}", flush=True)
    return row


def budget_stage(pipe, caps: tuple[float, ...] = (24, 16), graphs: bool = True) -> dict:
    """FP8 1024² 4 steps resident (graphs, with and without the modulation table), then under
    offload="blocks" planned for and capped at each of `caps` GiB; `graphs`: CUDA graphs left on under
    offload (as a user gets them: they replay while every block is resident) or turned off (eager)."""
    from ..runtime.memory import MemoryPlanner

    p = "a red bicycle leaning on a brick wall"
    pipe.configure(cuda_graphs=True)
    resident_s, want = _timed(pipe, p)
    t0 = time.perf_counter()
    _image(pipe, p)  # the prompt's embedding is cached now: denoise + decode only
    _sync()
    cached_s = time.perf_counter() - t0
    table = pipe.transformer.modulation_table
    res = {
        "resident_s": round(resident_s, 3),
        "resident_cached_prompt_s": round(cached_s, 3),
        "graphs_enabled": pipe._graphs.enabled,
        "modulation_cache": pipe.options.modulation_cache,
        "modulation_table_entries": 0 if table is None else len(table),
    }
    n = pipe.options.modulation_cache
    pipe.configure(modulation_cache=0)  # the same without the modulation table: 120 GEMVs per forward
    res["resident_s_no_modulation_table"] = round(_timed(pipe, p + " no table")[0], 3)
    pipe.configure(modulation_cache=n)
    pipe.release_graphs()
    pipe.configure(cuda_graphs=graphs)
    total = torch.cuda.get_device_properties(0).total_memory
    for cap in caps:
        _free()
        try:
            t0 = (
                time.perf_counter()
            )  # planned for `cap` GiB, then capped there (the limit a 24 GiB card sets)
            pipe.configure(offload="blocks", offload_budget=cap)
            setup = time.perf_counter() - t0
            _free()
            st, te = pipe._block_streamer, pipe.text_encoder.layer_streamer
            plan = MemoryPlanner.from_pipeline(pipe).predict(
                1024,
                1024,
                1,
                cfg=False,
                offload="blocks",
                resident_blocks=len(st.resident),
                modulation_on_host=bool(st.held),
                te_resident_layers=len(te.resident),
            )
            diag = {
                "resident_blocks": len(st.resident),
                "te_resident_layers": len(te.resident),
                "allocated_after_setup_gib": round(torch.cuda.memory_allocated() / GiB, 2),
                "planned_resident_gib": round(plan.resident / GiB, 2),
                "planned_phases_gib": plan.gib(),
            }
            print(f"  budget {cap:g} GiB setup: {json.dumps(diag)}", flush=True)
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total))
            torch.cuda.reset_peak_memory_stats()
            s, img = _timed(pipe, p + f" {cap}")
            t0 = time.perf_counter()
            _image(pipe, p + f" {cap}")
            _sync()
            cached = time.perf_counter() - t0
            on_host = bool(st.held)  # the modulation Linears, served by the modulation table
            pred = plan.peak
            peak = torch.cuda.max_memory_allocated()
            res[f"{cap:g}gib"] = {
                "graphs_on": graphs,
                "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / GiB, 2),
                "s": round(s, 3),
                "x_resident": round(s / resident_s, 2),
                "setup_s": round(setup, 1),
                "cached_prompt_s": round(cached, 3),
                "graphs_replayed": bool(pipe._graphs.graphs),
                "cached_x_resident": round(cached / res["resident_cached_prompt_s"], 2),
                "resident_blocks": len(st.resident),
                "streamed_blocks": len(st.order),
                "modulation_on_host": on_host,
                "te_resident_layers": len(te.resident),
                "te_layers": len(te.blocks),
                "peak_gib": round(peak / GiB, 2),
                "predicted_gib": round(pred / GiB, 2),
                "prediction_err": round(pred / peak - 1, 3),
                "max_abs_diff_vs_resident": float(np.abs(img - want).max()),
            }
        except Exception as e:  # noqa: BLE001 - the record says what happened
            res[f"{cap:g}gib"] = {
                "error": f"{type(e).__name__}: {e}"[:400],
                **locals().get("diag", {}),
                "allocated_at_error_gib": round(torch.cuda.memory_allocated() / GiB, 2),
                "where": [f.name for f in traceback.extract_tb(e.__traceback__)[-8:]],
            }
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        print(f"  budget {cap:g} GiB: {json.dumps(res[f'{cap:g}gib'])}", flush=True)
    return res


def run(
    stages: tuple[str, ...] = ("load", "lora", "budget"),
    tmp: str = "/tmp",
    out_dir: Path | None = None,
    caps: tuple[float, ...] = (24, 16),
    graphs: bool = True,
) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("error: `qwenfast bench fp8` measures full-size models on a GPU; none is available")
    from .pipeline import build

    rec: dict[str, Any] = {"bench": "fp8", **versions()}
    t = Path(tmp)
    if "load" in stages:
        rec["load"] = load_stage(t)
        _free()
    if "lora-int8" in stages:  # its own pipeline: 8-bit formats are one-way
        pipe, _ = build(False, diffusers_transformer=False)
        pipe.set_progress_bar_config(disable=True)
        rec["lora_int8"] = lora_stage(pipe, t, fmt="int8")
        del pipe
        _free()
    if "lora" in stages or "budget" in stages:
        pipe, _ = build(False, diffusers_transformer=False)
        pipe.set_progress_bar_config(disable=True)
        if "lora" in stages:
            rec["lora"] = lora_stage(pipe, t)
        if "budget" in stages:
            if not pipe.options.fp8:
                pipe.configure(fp8=True)
            rec["budget"] = budget_stage(pipe, caps, graphs)
    emit(rec, "fp8.jsonl", out_dir)
    return rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stages",
        default="load,lora,budget",
        help="comma list of load, lora, lora-int8, budget (budget: run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as a small card should)",
    )
    p.add_argument(
        "--caps", default="24,16", help="budget stage: the GiB caps to plan for and run under, in order"
    )
    p.add_argument(
        "--budget-graphs",
        choices=("on", "off"),
        default="on",
        help="budget stage: CUDA graphs under offload (default on, as a user gets them) or off",
    )
    p.add_argument("--tmp", default="/tmp", help="folder for the temporary FP8 and LoRA files (~20 GB)")
    p.add_argument("--results", default=None, metavar="DIR", help=RESULTS_HELP)


def run_from_args(a: argparse.Namespace) -> int:
    caps = tuple(float(c) for c in a.caps.split(",") if c)
    run(
        tuple(s for s in a.stages.split(",") if s),
        a.tmp,
        results_dir(a.results),
        caps,
        a.budget_graphs == "on",
    )
    return 0
