"""`qwenfast bench serve`: server throughput and p50/p95 latency vs concurrency, batching on and off.

Runs the real server (uvicorn in a thread, the same app `qwenfast serve` builds) on 127.0.0.1 and
drives it with closed-loop HTTP clients: at concurrency c, c threads each send a request, wait for
the image, and send the next. Levels 1, 2, 4, 8 run with `--max-batch` (default 8); the last level
runs again with max-batch 1, which separates what batching gains from what overlapping CPU work
(PNG encoding, HTTP) with GPU work gains. Throughput = images / wall time of the level; latency is
per request, queue wait included. A warm-up round at each level is not counted.

`--model random-full` builds Qwen-Image's full architecture with random weights on the GPU (60-layer
transformer as `bench transformer` does, the 7B Qwen2.5-VL text model from its config, the VAE from
its config; the embedded tokenizer): no checkpoint needed, same FLOPs as the real model. Without
`--model`, the embedded demo model runs anywhere, CPU included, as a smoke test. Images are the
model's own default size (128x128 for the demo, the size it was trained at) unless `--size` says.

Prints a table and a final JSON line (GPU name, torch and triton versions); with `--results DIR` the
line is also appended to DIR/serve.jsonl (the repo's records: `--results bench/results`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import RESULTS_HELP, emit, results_dir, versions
from .clients import closed_loop, quantile

if TYPE_CHECKING:
    import torch

    from ..pipeline.text_to_image import QwenImagePipeline

TEXT_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
           "max_window_layers": 28, "layer_types": ["full_attention"] * 28}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model folder, or `random-full` for full-size random weights on the GPU (default: embedded "
        "tiny model, for a CPU smoke test)",
    )
    p.add_argument(
        "--size",
        type=int,
        default=None,
        help="image side in pixels (default: the model's own size, 128 for the embedded demo; 1024 for "
        "random-full)",
    )
    p.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    p.add_argument(
        "--cfg", type=float, default=1.0, help="true CFG scale (1 = off, as with Lightning-8 LoRAs)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="client counts, one level each (default 1 2 4 8; mixed: 4 8 16)",
    )
    p.add_argument(
        "--workload",
        choices=("uniform", "mixed", "rows"),
        default="uniform",
        help="uniform: one size and step count; mixed: sizes, step counts, LoRAs, caches, streaming and "
        "hang-ups, against the old batcher and a diffusers loop (benchmarks/serve_mixed.py); rows: only the "
        "per-row LoRA overhead of one forward, eager and graphed (GPU)",
    )
    p.add_argument("--loras", type=int, default=10, help="mixed: random LoRAs in the workload")
    p.add_argument(
        "--lora-slots", type=int, default=None, help="mixed: the server's --row-loras (default --loras)"
    )
    p.add_argument(
        "--old-concurrency",
        type=int,
        nargs="*",
        default=[8],
        help="mixed: levels for the old batcher (LoRA set in the batch key, no interleaving)",
    )
    p.add_argument(
        "--diffusers-s", type=float, default=0.0, help="mixed: seconds of the plain diffusers loop (0: none)"
    )
    p.add_argument(
        "--duration", type=float, default=None, help="mixed: soak for this many seconds instead of the levels"
    )
    p.add_argument(
        "--lora-folder",
        default=None,
        help="mixed: where the random LoRAs go (reused when it holds them; default: a temp folder)",
    )
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8", "int8"),
        default=None,
        help="mixed and rows: the transformer's weights (default fp8 on a GPU, bf16 otherwise; rows: fp8)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="measured requests per level (default max(8, 3*c); mixed: max(40, 3*c))",
    )
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    p.add_argument(
        "--warm-shapes",
        action="store_true",
        help="mixed: each server first runs every shape the load can make (sizes x power-of-two batch sizes x "
        "CFG/cache kinds x with and without a LoRA), so its CUDA graphs are captured before the load",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the max-batch 1 run at the top concurrency"
    )
    p.add_argument("--layers", type=int, default=60, help="transformer layers for random-full")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--cuda-graphs", action="store_true", help="replay the transformer as CUDA graphs")
    p.add_argument(
        "--graph-slots",
        type=int,
        default=None,
        help="mixed: graphs kept captured (EngineOptions.graph_slots)",
    )
    p.add_argument(
        "--text-bucket",
        type=int,
        default=0,
        help="mixed: prompts padded to a multiple of N tokens (EngineOptions.text_bucket; 0: off)",
    )
    p.add_argument("--results", default=None, metavar="DIR", help=RESULTS_HELP)


def build_random_full(num_layers: int = 60) -> QwenImagePipeline:
    """QwenImagePipeline with full-size random bf16 weights on the GPU (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ..about import DEMO_MODEL
    from ..config import QWEN_IMAGE_SCHEDULER, QWEN_IMAGE_VAE
    from ..models.text_encoder import TextEncoder
    from ..models.vae import QwenImageVAE
    from ..pipeline.text_to_image import QwenImagePipeline
    from .transformer import build

    dev, dt = torch.device("cuda"), torch.bfloat16
    transformer, _ = build(num_layers, compare=False)
    d = json.loads((Path(DEMO_MODEL) / "text_encoder" / "config.json").read_text())
    d["text_config"].update(TEXT_7B)
    d["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]
    d["vision_config"]["out_hidden_size"] = TEXT_7B["hidden_size"]  # vision tower unused by text-to-image
    d.update({k: v for k, v in TEXT_7B.items() if k in ("hidden_size", "vocab_size")})
    cfg = Qwen2_5_VLConfig.from_dict(d)
    torch.manual_seed(0)
    with torch.device(dev):
        te_model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dt).eval().requires_grad_(False)
        vae = QwenImageVAE(QWEN_IMAGE_VAE).to(dt).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(Path(DEMO_MODEL) / "tokenizer"))
    pipe = QwenImagePipeline(
        transformer,
        vae,
        TextEncoder(te_model, tok),
        QWEN_IMAGE_SCHEDULER,
        model_path="random-full",
        defaults={"num_inference_steps": 8},
    )
    return pipe


def _post(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_level(base: str, c: int, n_requests: int, size: int, steps: int, cfg: float, seed0: int) -> dict:
    """Closed loop: c clients, n_requests in total. -> throughput and latencies."""

    def one(k: int) -> tuple[float | None, str | None]:
        body = {
            "prompt": f"a watercolor painting of a lighthouse, variation {k % 10}",
            "size": f"{size}x{size}",
            "steps": steps,
            "true_cfg_scale": cfg,
            "seed": seed0 + k,
        }
        t = time.perf_counter()
        try:
            out = _post(base + "/v1/images/generations", body)
            assert len(out["data"]) == 1
        except (urllib.error.URLError, AssertionError, KeyError, OSError) as e:
            return None, f"{type(e).__name__}: {e}"
        return time.perf_counter() - t, None

    t0 = time.perf_counter()
    rows = closed_loop(range(n_requests), c, one)
    wall = time.perf_counter() - t0
    lat = sorted(s for s, _ in rows if s is not None)
    errors = [e for _, e in rows if e is not None]
    return {
        "images": len(lat),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3),
        "images_per_s": round(len(lat) / wall, 4),
        "p50_s": round(quantile(lat, 0.5), 4),
        "p95_s": round(quantile(lat, 0.95), 4),
        "mean_s": round(statistics.fmean(lat), 4) if lat else None,
    }


def run(
    model: str | None = None,
    size: int | None = None,
    steps: int = 8,
    cfg: float = 1.0,
    concurrency: Sequence[int] = (1, 2, 4, 8),
    requests: int | None = None,
    max_batch: int = 8,
    baseline: bool = True,
    layers: int = 60,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    cuda_graphs: bool = False,
    out_dir: Path | None = None,
) -> dict:
    import torch

    from ..server.app import create_app
    from ..server.options import ServerConfig
    from ..server.run import load_pipeline, start_server, stop_server

    t0 = time.perf_counter()
    if model == "random-full":
        if not torch.cuda.is_available():
            raise RuntimeError("--model random-full builds full-size weights on a CUDA GPU; none is visible")
        pipe = build_random_full(layers)
        pipe.set_progress_bar_config(disable=True)
        pipe.configure(cuda_graphs=cuda_graphs, decode_per_image=True)  # as load_pipeline does
    else:
        from ..options import EngineOptions

        pipe = load_pipeline(model, device, dtype, EngineOptions.from_env(cuda_graphs=cuda_graphs))
    size = size or pipe.defaults.get("width") or 1024  # the model's own size: no "far from trained" warnings
    build_s = time.perf_counter() - t0
    triton_v = versions()["triton"]
    gpu = torch.cuda.get_device_name() if pipe.device.type == "cuda" else None
    res = {
        "bench": "serve",
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_v,
        "device": str(pipe.device),
        "dtype": str(pipe.dtype).replace("torch.", ""),
        "model": model or "demo-t2i",
        "size": size,
        "steps": steps,
        "cfg": cfg,
        "max_batch": max_batch,
        "cuda_graphs": cuda_graphs,
        "build_s": round(build_s, 1),
        "levels": [],
    }
    print(
        f"qwenfast bench serve: {res['model']} on {gpu or pipe.device} ({res['dtype']}), {size}x{size}, "
        f"{steps} steps, cfg {cfg}; torch {res['torch']}, triton {triton_v}; built in {build_s:.1f}s"
    )
    plan = [(c, max_batch) for c in concurrency]
    if baseline and max_batch > 1:
        plan.append((max(concurrency), 1))
    for mb in dict.fromkeys(m for _, m in plan):
        scfg = ServerConfig(max_batch=mb, max_queue=1024, batch_wait_s=0.02, timeout_s=3600)
        app = create_app(pipe, scfg)
        server, th, base = start_server(app)
        try:
            for c, m in plan:
                if m != mb:
                    continue
                n = requests or max(8, 3 * c)
                run_level(base, c, c, size, steps, cfg, seed0=10_000)  # warm-up: shapes, allocator, kernels
                if pipe.device.type == "cuda":
                    torch.cuda.synchronize()
                hist = app.state.metrics.batch_size
                b0, s0 = hist.count, hist.sum
                row = {
                    "concurrency": c,
                    "max_batch": m,
                    "requests": n,
                    **run_level(base, c, n, size, steps, cfg, 0),
                }
                row["mean_batch"] = round((hist.sum - s0) / max(1, hist.count - b0), 2)
                res["levels"].append(row)
                print(
                    f"  c={c:<3} max_batch={m:<3} {row['images_per_s']:8.3f} img/s  p50 {row['p50_s']:7.3f}s  "
                    f"p95 {row['p95_s']:7.3f}s  mean batch {row['mean_batch']:.2f}  errors {row['errors']}"
                )
        finally:
            stop_server(server, th)
    _summarise(res)
    emit(res, "serve.jsonl", out_dir)
    return res


def _summarise(res: dict) -> None:
    rows = res["levels"]
    seq = next((r for r in rows if r["concurrency"] == 1 and r["max_batch"] == res["max_batch"]), None)
    print(
        f"\n{'concurrency':>11} {'max batch':>9} {'img/s':>8} {'x seq':>6} {'p50 s':>8} {'p95 s':>8} "
        f"{'mean batch':>10} {'errors':>6}"
    )
    for r in rows:
        x = r["images_per_s"] / seq["images_per_s"] if seq and seq["images_per_s"] else float("nan")
        r["speedup_vs_sequential"] = round(x, 2)
        print(
            f"{r['concurrency']:>11} {r['max_batch']:>9} {r['images_per_s']:>8.3f} {x:>6.2f} {r['p50_s']:>8.3f} "
            f"{r['p95_s']:>8.3f} {r['mean_batch']:>10.2f} {r['errors']:>6}"
        )
    top = max(
        (r for r in rows if r["max_batch"] == res["max_batch"]), key=lambda r: r["concurrency"], default=None
    )
    if top is not None:
        res["speedup_at_top_concurrency"] = top["speedup_vs_sequential"]


def run_from_args(a: argparse.Namespace) -> int:
    if a.workload == "rows":
        from .serve_baselines import run_rows

        run_rows(a.lora_folder, a.loras, results_dir(a.results), weights=a.weights or "fp8")
        return 0
    if a.workload == "mixed":
        import torch

        from .serve_mixed import run as run_mixed

        run_mixed(
            model=a.model,
            concurrency=tuple(a.concurrency or (4, 8, 16)),
            requests=a.requests,
            n_loras=a.loras,
            slots=a.lora_slots,
            old_concurrency=tuple(a.old_concurrency),
            diffusers_s=a.diffusers_s,
            duration=a.duration,
            weights=a.weights or ("fp8" if torch.cuda.is_available() else "bf16"),
            cuda_graphs=a.cuda_graphs,
            graph_slots=a.graph_slots,
            text_bucket=a.text_bucket,
            max_batch=a.max_batch,
            device=a.device,
            dtype=a.dtype,
            lora_folder=a.lora_folder,
            out_dir=results_dir(a.results),
            warm_shapes=a.warm_shapes,
        )
        return 0
    run(
        model=a.model,
        size=a.size,
        steps=a.steps,
        cfg=a.cfg,
        concurrency=tuple(a.concurrency or (1, 2, 4, 8)),
        requests=a.requests,
        max_batch=a.max_batch,
        baseline=not a.no_baseline,
        layers=a.layers,
        device=a.device,
        dtype=a.dtype,
        cuda_graphs=a.cuda_graphs,
        out_dir=results_dir(a.results),
    )
    return 0
