"""`qwenfast bench parallel`: one image over several GPUs vs one GPU, same weights, same run.

One process per GPU (NCCL). Every rank builds the same full-size random weights (same seed).
- transformer forward (1024², 1328², 128 text tokens): qwenfast on one GPU (fused + CUDA graph, our
  best single-GPU path) vs qwenfast Ulysses over all GPUs, and diffusers' own `enable_parallelism`
  Ulysses (ulysses_anything, for token counts the GPUs do not divide) vs diffusers on one GPU;
- end to end (random 7B text encoder + transformer + VAE): 1024² 50 steps true CFG with cfg=2, and
  1024² 4 steps no CFG with ulysses=N, vs the same pipeline on one GPU; image difference.
Rank 0 prints the table and the JSON record (`--results DIR`: appended to DIR/parallel.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _ms(fn, warmup: int = 3, iters: int = 10) -> float:
    from . import median_ms

    dist.barrier()
    return round(median_ms(fn, warmup, iters), 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def init_worker(rank: int, world: int, port: int) -> None:
    """This process's GPU and its NCCL group (one process per GPU, spawned on one machine)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
        device_id=torch.device("cuda", rank),
    )


def forward_inputs(model, size: int) -> tuple:
    """(x, txt, t, img_shapes, step, modulations) of one forward at size² with 128 text tokens, the
    same on every rank (seeded by the size); modulation rows from a modulation-table entry, as the
    pipeline's denoising steps take them."""
    from ..runtime.blocks import StepContext
    from ..runtime.modulation import batch_rows

    g = torch.Generator(device="cuda").manual_seed(size)
    n = (size // 16) ** 2
    x = torch.randn(1, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, 128, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)
    mods = batch_rows(model.modulation_entries([t[:1]])[0], 1)  # modulation Linears stay bf16 under FP8
    return x, txt, t, [(1, size // 16, size // 16)], StepContext(0, 1, 0.5), mods


def generate(pipe, steps: int, cfg: bool):
    """The end-to-end call: 1024², the harness prompt, true CFG 4 with a " " negative prompt or none."""
    from .harness import PROMPT

    kw = dict(
        height=1024,
        width=1024,
        num_inference_steps=steps,
        true_cfg_scale=4.0 if cfg else 1.0,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    )
    if cfg:
        kw["negative_prompt"] = " "
    return pipe(PROMPT, **kw).images


@torch.no_grad()
def forward_rows(
    world: int, sizes: tuple[int, ...], layers: int, diffusers_too: bool, fp8: bool = True
) -> dict:
    """Per size: one GPU vs Ulysses over `world` GPUs, each exchange (peer memory, the default on
    CUDA; NCCL all-to-alls), bf16 and FP8 block GEMMs; each variant its own CUDA graphs. Every forward
    takes its modulation rows from a modulation-table entry, as the pipeline's denoising steps do."""
    from ..runtime.cuda_graphs import CudaGraphRunner
    from ..runtime.parallel import ParallelConfig, ParallelForward, ParallelGroups
    from .transformer import _fp8_modules, _swap, build

    rank = dist.get_rank()
    ours, ref = build(layers, compare=diffusers_too)
    layout = ParallelConfig(ulysses=world)
    groups = {
        ex: ParallelGroups(layout, exchange=ex) for ex in ("peer", "collective")
    }  # same order on every rank
    fp8_mods = _fp8_modules(ours) if fp8 else None
    runners: dict[str, CudaGraphRunner] = {}
    rows = {}
    for size in sizes:
        x, txt, t, shapes, step, mods = forward_inputs(ours, size)
        row = {}
        for prec in ("bf16", "fp8") if fp8 else ("bf16",):
            old = _swap(ours, fp8_mods) if prec == "fp8" else None
            tag = "" if prec == "bf16" else "_fp8"
            one_graphs = runners.setdefault(prec, CudaGraphRunner(ours))
            one = one_graphs(x, txt, None, t, shapes, step=step, modulations=mods)
            if rank == 0:
                row[f"qwenfast_1gpu{tag}_ms"] = _ms(
                    lambda: one_graphs(x, txt, None, t, shapes, step=step, modulations=mods)
                )
            else:
                dist.barrier()
            for exchange in ("peer", "collective") if prec == "bf16" else ("peer",):
                graphs = runners.setdefault(f"{prec}:{exchange}", CudaGraphRunner(ours))
                # the shard's forward as a CUDA graph, its exchanges captured with it
                par = ParallelForward(
                    lambda *a, shard=None, g=graphs: g(*a[:5], step=a[5], shard=shard, modulations=mods),
                    groups[exchange],
                )
                out = par(x, txt, None, t, shapes, step)
                name = f"qwenfast_ulysses{world}{tag}" + ("" if exchange == "peer" else "_collective")
                row[f"{name}_ms"] = _ms(lambda: par(x, txt, None, t, shapes, step))
                row[f"{name}_rel_err_vs_1gpu"] = _rel(out, one)
                if rank == 0:
                    row[f"{name}_speedup"] = round(row[f"qwenfast_1gpu{tag}_ms"] / row[f"{name}_ms"], 2)
            if old is not None:
                _swap(ours, old)
        for r in runners.values():  # each size's graph pools go before the next size's
            r.clear()
        torch.cuda.empty_cache()
        if ref is not None:  # diffusers' own Ulysses: at the first size only (its model is dropped after)
            row.update(_diffusers_rows(ref, x, txt, t, size, world, rank))
            ref = None
            torch.cuda.empty_cache()
        rows[size] = row
    return rows


def _diffusers_rows(ref, x, txt, t, size: int, world: int, rank: int) -> dict:
    row = {}
    kw = dict(
        hidden_states=x,
        encoder_hidden_states=txt,
        encoder_hidden_states_mask=None,
        timestep=t,
        img_shapes=[[(1, size // 16, size // 16)]],
        return_dict=False,
    )
    if rank == 0:
        row["diffusers_1gpu_ms"] = _ms(lambda: ref(**kw))
    else:
        dist.barrier()
    try:
        from diffusers import ContextParallelConfig

        if not getattr(ref, "_qwenfast_parallel", False):
            ref.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, ulysses_anything=True))
            ref._qwenfast_parallel = True
        row[f"diffusers_ulysses{world}_ms"] = _ms(lambda: ref(**kw))
        if "diffusers_1gpu_ms" in row:
            row["diffusers_speedup"] = round(
                row["diffusers_1gpu_ms"] / row[f"diffusers_ulysses{world}_ms"], 2
            )
    except Exception as e:  # noqa: BLE001 - reported, the qwenfast rows stand
        row["diffusers_parallel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


@torch.no_grad()
def end_to_end_rows(world: int) -> dict:
    import numpy as np

    from .pipeline import build

    rank = dist.get_rank()
    ours, _ = build(False, diffusers_transformer=False)
    ours.set_progress_bar_config(disable=True)
    rows = {}
    cases = [
        ("1024:50:cfg", 50, True, f"cfg={min(world, 2)}" + (f",ulysses={world // 2}" if world > 2 else "")),
        ("1024:4:nocfg", 4, False, f"ulysses={world}"),
    ]

    def call(steps, cfg):
        return generate(ours, steps, cfg)

    def timed(steps, cfg, together: bool = True):
        """Median wall time of 3 calls (1 for long ones), each encoding its prompt afresh."""
        call(2, cfg)  # warm-up: graphs, lazy inits
        times = []
        for _ in range(3 if steps <= 8 else 1):
            ours.text_encoder.clear_cache()
            torch.cuda.synchronize()
            if together:
                dist.barrier()
            t0 = time.perf_counter()
            img = call(steps, cfg)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2], img

    for name, steps, cfg, layout in cases:
        row = {"layout": layout}
        ours.configure(parallel=None, cuda_graphs=True, batched_cfg="auto")
        if rank == 0:
            row["one_gpu_s"], one = timed(steps, cfg, together=False)
        dist.barrier()
        ours.configure(parallel=layout)
        row[f"{layout}_s"], img = timed(steps, cfg)
        if rank == 0:
            row["speedup"] = round(row["one_gpu_s"] / row[f"{layout}_s"], 2)
            row["mean_abs_diff_images"] = float(f"{np.abs(img - one).mean():.3e}")
            print(f"  {name:14s} {json.dumps(row)}", flush=True)
        rows[name] = row
    return rows


def _worker(rank: int, world: int, port: int, a: argparse.Namespace) -> None:
    init_worker(rank, world, port)
    try:
        from . import emit, versions

        rec = {"bench": "parallel", "gpus": world, "gpu": torch.cuda.get_device_name(), **versions()}
        if not a.no_forward:
            rec["forward"] = forward_rows(world, tuple(a.size or (1024, 1328)), a.layers, not a.no_diffusers)
            if rank == 0:
                for s, r in rec["forward"].items():
                    print(f"  forward {s}: {json.dumps(r)}", flush=True)
        if not a.no_e2e:
            import gc

            gc.collect()
            torch.cuda.empty_cache()  # the forward stage's models are gone: room for the pipelines
            rec["end_to_end"] = end_to_end_rows(world)
        if rank == 0:
            emit(rec, "parallel.jsonl", Path(a.results) if a.results else None)
    finally:
        dist.destroy_process_group()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus",
        type=_gpu_counts,
        default=None,
        metavar="N[,N...]",
        help="GPU counts to run, one after the other, each against its own one-GPU baseline "
        "(e.g. 2,4; default: all visible)",
    )
    p.add_argument("--size", type=int, action="append", help="forward sizes (default 1024 and 1328)")
    p.add_argument("--layers", type=int, default=60, help="transformer blocks (Qwen-Image has 60)")
    p.add_argument("--no-forward", action="store_true")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--no-diffusers", action="store_true", help="skip diffusers' own Ulysses rows")
    p.add_argument("--results", default=None, metavar="DIR", help="append the record to DIR/parallel.jsonl")


def run_from_args(a: argparse.Namespace) -> int:
    from ..launch import free_port, spawn

    visible = torch.cuda.device_count()
    worlds = a.gpus or [visible]
    if visible < 2:
        raise ValueError(f"`qwenfast bench parallel` needs at least 2 GPUs; {visible} visible")
    if min(worlds) < 2 or max(worlds) > visible:
        raise ValueError(
            f"`qwenfast bench parallel --gpus` takes counts from 2 to the {visible} visible GPUs, "
            f"got {','.join(map(str, worlds))}"
        )
    for world in worlds:  # each its own process group over GPUs 0..world-1
        spawn(_worker, (world, free_port(), a), world, "bench parallel")  # one error naming the failing rank
    return 0


def _gpu_counts(text: str) -> list[int]:
    """ "2,4" -> [2, 4] (argparse type of --gpus)."""
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes GPU counts like 4 or 2,4, got {text!r}") from None
    return counts
