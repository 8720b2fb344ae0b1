"""`qwenfast doctor` (what this machine can run) and `qwenfast bench` (its arguments, and which benchmark
module runs): the two commands that report on the machine rather than make images (cli.py dispatches)."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from .engine_args import positive_int as _positive


def _attention_libraries() -> str:
    """Which optional attention libraries are installed (found, not imported): what `attention="fa3"`
    and the 8-bit `attention="fp8"` engines can use (README: 8-bit attention)."""
    import importlib.util

    def found(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            return False

    fa3 = [m for m in ("flash_attn_interface", "fa3_fwd_interface") if found(m)]
    parts = [
        f"FA3 {'(' + ', '.join(fa3) + ')' if fa3 else 'not installed (pip install fa3-fwd)'}",
        f"cuDNN frontend {'installed' if found('cudnn') else 'not installed'}",
    ]
    engines = (["fa3"] if fa3 else []) + (["cudnn"] if found("cudnn") else [])
    parts.append(
        f"8-bit engines: {', '.join(engines) if engines else 'none (attention=fp8 runs cuDNN bf16)'}"
    )
    return "; ".join(parts)


def _parallel_line() -> str:
    """What `--parallel` can use here: the GPU count, the Ulysses layouts 24 heads allow, and whether
    every GPU reaches the others' memory (P2P / NVLink: the fast peer exchange) or the exchange falls
    back to NCCL all-to-alls (README: Several GPUs)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return f"{n} GPU{'s' if n != 1 else ''}: one-GPU runs only (--parallel ... --device cpu runs CPU processes)"
    layouts = (
        ["cfg=2"]
        + [f"ulysses={g}" for g in (2, 3, 4, 6, 8) if g <= n]
        + (["cfg=2,ulysses=2"] if n >= 4 else [])
    )
    p2p = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
    exchange = "peer memory (P2P/NVLink)" if p2p else "NCCL all-to-alls (no P2P between all GPUs: slower)"
    return f"{n} GPUs: {', '.join(layouts)}; Ulysses exchange: {exchange}"


def cmd_doctor(a: argparse.Namespace) -> int:
    import torch

    from . import DEMO_MODEL
    from .pipeline.auto import check_folder

    print(f"python       {platform.python_version()} ({sys.executable})")
    print(f"torch        {torch.__version__}")
    try:
        import triton

        print(f"triton       {triton.__version__}")
    except ImportError:
        print("triton       not installed (GPU kernels fall back to torch)")
    for name in ("transformers", "safetensors", "diffusers"):
        try:
            mod = __import__(name)
            print(f"{name:<12} {mod.__version__}")
        except ImportError:
            print(f"{name:<12} not installed")
    if torch.cuda.is_available():
        print(f"cuda         {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            print(
                f"  cuda:{i}     {p.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), sm_{p.major}{p.minor}"
            )
    else:
        print("cuda         not available (CPU only)")
    _print_arch(torch)
    print(f"attention    {_attention_libraries()}")
    print(f"parallel     {_parallel_line()}")
    path = Path(a.model or DEMO_MODEL)
    kind, problems = check_folder(path)  # the pipeline registry's: any model family qwenfast loads
    if problems:
        print(f"model        {path}: INCOMPLETE")
        for pr in problems:
            print(f"  - {pr}")
        return 1
    print(f"model        {path}: complete ({kind})")
    _print_plan(a, torch, path if a.model else None)
    return 0


def _print_plan(a: argparse.Namespace, torch, folder: Path | None) -> None:
    """The memory plan (runtime/tiers.py) for `--vram` GiB, else this GPU's free memory: full-size
    Qwen-Image at 1024², or `--model`'s folder at its default size (sizes from its file headers)."""
    from .runtime.arch import arch
    from .runtime.memory import GiB, ModelSizes, default_budget
    from .runtime.tiers import TooSmall, plan

    vram = getattr(a, "vram", None)
    if vram is None and torch.cuda.is_available():
        vram = default_budget(torch.device("cuda"), fraction=1.0) / GiB
    if vram is None:
        print("memory plan  no GPU: `qwenfast doctor --vram GIB` prints the plan for a card of GIB GiB")
        return
    if folder is not None:
        from .loading.sizes import folder_sizes

        sizes, what = folder_sizes(folder, torch.bfloat16), str(folder)
    else:
        sizes, what = ModelSizes.qwen_image(), "full-size Qwen-Image"
    card = arch(torch.device("cuda") if torch.cuda.is_available() else None)
    try:
        p = plan(sizes, vram, weights=getattr(a, "weights", "bf16") or "bf16", card=card)
    except (TooSmall, ValueError) as e:
        print(f"memory plan  {what}: {e}")
        return
    lines = p.lines()
    print(f"memory plan  {what}, {lines[0]}")
    for line in lines[1:]:
        print(f"           {line}")


def _print_arch(torch) -> None:
    """The arch table's row for this GPU (or the one QWENFAST_ARCH names), then the whole table."""
    from .runtime.arch import ENV_VAR, arch, forced, table_lines

    a = arch(torch.device("cuda") if torch.cuda.is_available() else None)
    how = f" (as {ENV_VAR} says)" if forced() else ""
    if a.name == "none":
        print("arch         no CUDA GPU: the torch reference paths run")
    else:
        gemms = ", ".join(["bf16"] + (["fp8 (--fp8, lossy)"] if a.fp8_gemm else []))
        print(
            f"arch         {a.name}, {a.family}{how}: GEMMs {gemms}; exact attention: {a.attention}"
            f"{'; 8-bit attention (opt-in)' if a.fp8_attention else ''}; fastest GEMM precision on "
            f"the spec sheet: {a.fastest_gemm}"
        )
    for line in table_lines(a):
        print("             " + line)


def add_bench_parser(sub) -> None:
    """`qwenfast bench WHAT`: each benchmark's arguments (most from its own module's `add_arguments`)."""
    b = sub.add_parser(
        "bench",
        help="benchmarks: GPU speed (transformer, pipeline, fp8, attention, parallel); "
        "quality and serve also run on the CPU",
    )
    bsub = b.add_subparsers(dest="what", required=True)
    bt = bsub.add_parser(
        "transformer",
        help="full-size transformer forward, random bf16 weights (GPU; "
        "--model-type 2.1 --device cpu checks the code on the CPU)",
    )
    bt.add_argument(
        "--size", type=int, action="append", help="image side in pixels (repeatable; default 1024)"
    )
    bt.add_argument(
        "--compare", choices=["diffusers", "none"], default="none", help="also time diffusers' forward"
    )
    bt.add_argument(
        "--layers", type=_positive, default=None, help="transformer blocks (default: the model's, 60 / 32)"
    )
    bt.add_argument("--txt", type=_positive, default=128, help="text tokens")
    bt.add_argument("--iters", type=_positive, default=10, help="timed forwards per variant")
    bt.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    bt.add_argument("--no-fp8", action="store_true", help="skip the FP8 variant")
    bt.add_argument("--int8", action="store_true", help="add the INT8 W8A8 variant (rel. error vs bf16)")
    bt.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="append the JSON record to DIR/transformer.jsonl (default: only print it)",
    )
    bt.add_argument(
        "--model-type",
        choices=["qwen-image", "2.1"],
        default="qwen-image",
        help="2.1: Qwen-Image-2.1's transformer (prefill and cached step, bf16 and FP8) vs diffusers' "
        "QwenImage21Transformer2DModel, records to DIR/qwenimage21.jsonl",
    )
    bt.add_argument(
        "--device", default="cuda", help="with --model-type 2.1: cpu runs the code (timings meaningless)"
    )
    from .benchmarks.serve import add_arguments as add_bench_serve_arguments

    add_bench_serve_arguments(
        bsub.add_parser("serve", help="server throughput and p50/p95 latency vs concurrency (CPU or GPU)")
    )
    from .benchmarks.fp8 import add_arguments as add_bench_fp8_arguments
    from .benchmarks.parallel import add_arguments as add_bench_parallel_arguments
    from .benchmarks.pipeline import add_arguments as add_bench_pipeline_arguments

    add_bench_fp8_arguments(
        bsub.add_parser(
            "fp8",
            help="FP8 from files (load peak), LoRA on an FP8 base (switch, quality), FP8 under a memory budget",
        )
    )

    from .benchmarks.tiers import add_arguments as add_bench_tiers_arguments

    add_bench_tiers_arguments(
        bsub.add_parser(
            "tiers",
            help="full-size Qwen-Image under 24/16/12/8 GiB caps (--vram), one fresh process per cap (GPU)",
        )
    )
    from .benchmarks.attention import add_arguments as add_bench_attention_arguments

    add_bench_attention_arguments(
        bsub.add_parser(
            "attention",
            help="8-bit attention: FP8 engines per layer, in the FP8 forward, and the quality gate",
        )
    )

    add_bench_parallel_arguments(
        bsub.add_parser(
            "parallel",
            help="one image over several GPUs (ulysses, cfg) vs one GPU, and diffusers' own Ulysses",
        )
    )

    add_bench_pipeline_arguments(
        bsub.add_parser(
            "pipeline",
            help="end to end vs diffusers (random full-size weights), VAE, memory planner, offload",
        )
    )
    from .benchmarks.peers import add_arguments as add_bench_peers_arguments

    add_bench_peers_arguments(
        bsub.add_parser(
            "peers",
            help="qwenfast beside diffusers (+ compile, + torchao FP8) and cache-dit, one process each, same weights",
        )
    )
    from .benchmarks.report import add_arguments as add_bench_report_arguments

    add_bench_report_arguments(
        bsub.add_parser(
            "report", help="render the published tables of README.md and docs/ from bench/results (CPU)"
        )
    )
    bq = bsub.add_parser("quality", help="prompt-adherence score of the held-out demo suite (CPU or GPU)")
    bq.add_argument(
        "--model",
        default=None,
        help="demo model folder, text-to-image or edit (default: the embedded text-to-image demo; "
        "'edit': the embedded edit demo)",
    )
    bq.add_argument(
        "--n",
        type=_positive,
        default=None,
        help="items of the held-out suite to score (default and max: 120 prompts, or 36 edits; "
        "--paths scores up to 120 edits)",
    )
    bq.add_argument("--steps", type=_positive, default=None, help="denoising steps (default: model's)")
    bq.add_argument("--cfg", type=float, default=None, help="true CFG scale (default: model's)")
    bq.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    bq.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    bq.add_argument("--verbose", action="store_true", help="list the failing prompts and checks")
    bq.add_argument(
        "--paths",
        action="store_true",
        help="score every code path (fp32 reference, bf16, kernels, graphs, batched CFG, FP8) "
        "and each one's gap to the reference",
    )
    bq.add_argument(
        "--path",
        action="append",
        default=None,
        metavar="NAME",
        help="with --paths: only the paths whose name contains NAME (repeatable; the fp32 reference "
        "always runs first, as the gap's base), e.g. --path fp8",
    )
    bq.add_argument(
        "--cache",
        action="append",
        default=None,
        metavar="POLICY",
        help="score the suite uncached and with each step-cache preset (repeatable: balanced, fast), "
        "at --steps (default 50) with CFG: score, computed fraction, PSNR/SSIM vs uncached",
    )
    bq.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="append the record to DIR/quality.jsonl (default: only print it)",
    )
    from .benchmarks.cache_pareto import add_arguments as add_bench_cache_pareto_arguments

    add_bench_cache_pareto_arguments(
        bsub.add_parser(
            "cache-pareto",
            help="step caching at matched quality: qwenfast's presets vs cache-dit on diffusers, demo model (CPU or GPU)",
        )
    )


def cmd_bench(a: argparse.Namespace) -> int:
    if a.what == "report":  # records -> the published tables; no torch
        from .benchmarks.report import run_from_args as run_report

        return run_report(a)
    import torch

    if a.what == "quality":  # the demo model's quality gate; CPU or GPU
        from .demo.bench import quality, quality_paths

        if a.cache:
            from .benchmarks import emit, versions
            from .demo.bench import quality_cache

            rows = quality_cache(
                a.model, tuple(a.cache), n=a.n, device=a.device, dtype=a.dtype, steps=a.steps or 50, cfg=a.cfg
            )
            emit(
                {
                    "bench": "quality_cache",
                    "model": a.model or "demo-t2i",
                    **versions(),
                    "steps": a.steps or 50,
                    "rows": rows,
                },
                "quality.jsonl",
                a.results,
            )
            return 0
        from .benchmarks import emit, versions

        if not a.paths:  # every bench ends with its record as one JSON line
            emit(
                quality(
                    a.model,
                    n=a.n,
                    device=a.device,
                    dtype=a.dtype,
                    steps=a.steps,
                    cfg=a.cfg,
                    verbose=a.verbose,
                ),
                "quality.jsonl",
                a.results,
            )
            return 0

        n = min(a.n or 120, 120)
        from .demo.bench import PATHS

        paths = [p for i, p in enumerate(PATHS) if i == 0 or not a.path or any(k in p[0] for k in a.path)]
        if a.path and len(paths) == 1:
            raise SystemExit(
                f"--path {a.path}: no code path matches; the paths are: " + ", ".join(p[0] for p in PATHS[1:])
            )
        rows = quality_paths(a.model, n=n, device=a.device, paths=paths)
        record = {
            "bench": "quality_paths",
            "model": a.model or "demo-t2i",
            **versions(),
            "n": n,
            "rows": rows,
            "max_abs_gap": max((abs(r["gap"]) for r in rows if "gap" in r), default=0.0),
        }
        emit(record, "quality.jsonl", a.results)
        return 0
    if a.what == "cache-pareto":  # the demo model's quality under step caching; CPU or GPU
        from .benchmarks.cache_pareto import run_from_args as run_cache_pareto

        return run_cache_pareto(a)
    if a.what == "fp8":
        from .benchmarks.fp8 import run_from_args as run_fp8

        return run_fp8(a)
    if a.what == "tiers":
        from .benchmarks.tiers import run_from_args as run_tiers

        return run_tiers(a)
    if a.what == "attention":
        from .benchmarks.attention import run_from_args as run_attention

        return run_attention(a)
    if a.what == "parallel" and torch.cuda.is_available():
        from .benchmarks.parallel import run_from_args as run_parallel

        return run_parallel(a)
    if a.what == "serve":  # runs on CPU too (smoke test on the embedded model)
        from .benchmarks.serve import run_from_args

        return run_from_args(a)
    if a.what in ("transformer", "pipeline") and a.model_type == "2.1":
        return _bench21(a, on_cpu=(a.device == "cpu") if a.what == "transformer" else a.smoke)
    if a.what == "pipeline" and a.size is not None and not a.task:
        print(
            "error: bench pipeline --size is for --model-type 2.1 and --task; Qwen-Image's sizes are its "
            "--case choices (the high-resolution ones: bench peers --highres)",
            file=sys.stderr,
        )
        return 2
    if a.what == "pipeline" and a.task and a.fp8 and len(a.task) > 1:
        print(
            "error: --task with --fp8 takes one task (FP8 is one-way: it would carry into the next)",
            file=sys.stderr,
        )
        return 2
    if a.what == "pipeline" and a.task and (a.smoke or torch.cuda.is_available()):  # img2img / inpaint rows
        from .benchmarks import results_dir
        from .benchmarks.tasks_inpaint import run_tasks

        run_tasks(
            a.task, smoke=a.smoke, steps=a.steps, size=a.size, fp8=a.fp8, out_dir=results_dir(a.results)
        )
        return 0
    if a.what == "peers" and (a.smoke or torch.cuda.is_available()):  # --smoke: the demo model on the CPU
        from .benchmarks.peers import run_from_args as run_peers

        return run_peers(a)
    if a.what == "pipeline" and (a.smoke or torch.cuda.is_available()):  # --smoke: tiny model on the CPU
        from .benchmarks.pipeline import run_from_args as run_pipeline

        return run_pipeline(a)
    if not torch.cuda.is_available():
        print(
            "error: `qwenfast bench` measures GPU speed and needs a CUDA device (pipeline, peers: --smoke runs on CPU)",
            file=sys.stderr,
        )
        return 2
    from .benchmarks.transformer import run

    run(
        sizes=tuple(a.size or [1024]),
        compare=a.compare == "diffusers",
        num_layers=a.layers or 60,
        txt_len=a.txt,
        iters=a.iters,
        compile_=not a.no_compile,
        out_dir=a.results,
        fp8=not a.no_fp8,
        int8=a.int8,
    )
    return 0


def _bench21(a: argparse.Namespace, on_cpu: bool) -> int:
    """`bench transformer|pipeline --model-type 2.1`: the Qwen-Image-2.1 benchmarks (benchmarks/transformer21.py,
    pipeline21.py) with this command's arguments; on the CPU a tiny size and one block check the code."""
    import torch

    if not on_cpu and not torch.cuda.is_available():
        print(
            "error: the Qwen-Image-2.1 benchmarks measure GPU speed and need a CUDA device "
            "(--device cpu / --smoke run the code on the CPU)",
            file=sys.stderr,
        )
        return 2
    if a.what == "transformer":
        from .benchmarks.transformer21 import main as bench

        name = "qwenimage21.jsonl"
        if on_cpu:  # one full-width block, a 64² image, 8 prompt tokens
            argv = ["--device", "cpu", "--layers", "1", "--size", "64", "--text", "8"]
        else:
            argv = [
                "--text",
                str(a.txt),
                *(["--size", str(a.size[0])] if a.size else []),
                *(["--layers", str(a.layers)] if a.layers else []),
                *([] if a.no_compile else ["--compile"]),
            ]
    else:
        from .benchmarks.pipeline21 import main as bench

        name = "qwenimage21.jsonl"  # one file for the 2.1 records: the transformer and the end-to-end rows
        argv = ["--fp8"] if a.fp8 else []
        argv += ["--steps", str(a.steps or (2 if on_cpu else 40))]
        if a.size and not on_cpu:
            argv += ["--size", str(a.size)]
        if on_cpu:  # one full-width block, a 64² image, a 2-layer text encoder, one timed call per row
            argv += [
                "--device",
                "cpu",
                "--layers",
                "1",
                "--size",
                "64",
                "--text-encoder",
                "tiny",
                "--runs",
                "1",
            ]
    if a.results:
        Path(a.results).mkdir(parents=True, exist_ok=True)
        argv += ["--out", str(Path(a.results) / name)]
    bench(argv)
    return 0
