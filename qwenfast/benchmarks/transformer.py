"""`qwenfast bench transformer`: full-size transformer forward, random bf16 weights, vs diffusers.

With `--compare diffusers`, diffusers builds the random model and qwenfast takes the *same* tensors
(shared storage; only Q/K/V are concatenated), so both engines run identical weights in the same
process on the same GPU. Each variant: warm-up, then the median of timed forwards (CUDA events).
FLOPs are counted from the config (GEMMs + attention); the floor assumes 809 TFLOP/s for every
FLOP, the bf16 GEMM rate measured on H200. Prints a table and a final JSON line, with `--results DIR`
also appended to DIR/transformer.jsonl.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import emit, median_ms, rel_err, versions

if TYPE_CHECKING:
    from ..models.transformer import QwenImageTransformer

PEAK_TFLOPS = 809.0  # bf16 dense GEMM, measured on H200 (see shared facts)


def _profile(fn) -> dict[str, float]:
    """Share of GPU kernel time by category for one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        n = e.key.lower()
        if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn_generated")):
            cats["attention"] += t
        elif any(s in n for s in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "_mm")):
            cats["gemm"] += t
        else:
            cats["other"] += t
    total = sum(cats.values()) or 1.0
    return {k: round(100 * v / total, 1) for k, v in cats.items()} | {"total_ms": round(total / 1e3, 2)}


def build(
    num_layers: int, compare: bool, dtype: torch.dtype = torch.bfloat16, zero_cond_t: bool = False
) -> tuple[QwenImageTransformer, torch.nn.Module | None]:
    """(qwenfast model, diffusers model or None), same weights."""
    from pathlib import Path as _P

    from ..config import TransformerConfig
    from ..loading.weights import QKVFuser, load_streaming
    from ..models.transformer import QwenImageTransformer, fuse_qkv_key

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=num_layers, zero_cond_t=zero_cond_t)
    ref = None
    if compare:
        from diffusers import QwenImageTransformer2DModel

        with torch.device("cuda"):
            torch.set_default_dtype(dtype)
            try:
                ref = QwenImageTransformer2DModel(num_layers=num_layers, zero_cond_t=zero_cond_t).eval()
            finally:
                torch.set_default_dtype(torch.float32)
        with torch.device("meta"):
            ours = QwenImageTransformer(cfg)
        items = ((k, v, _P("diffusers")) for k, v in ref.state_dict().items())
        load_streaming(ours, items, dtype=dtype, where="diffusers", convert=QKVFuser(fuse_qkv_key))
    else:
        with torch.device("cuda"):
            torch.set_default_dtype(dtype)
            try:
                ours = QwenImageTransformer(cfg).eval().requires_grad_(False)
            finally:
                torch.set_default_dtype(torch.float32)
    return ours, ref


def run(
    sizes: Iterable[int] = (1024,),
    compare: bool = True,
    num_layers: int = 60,
    txt_len: int = 128,
    warmup: int = 3,
    iters: int = 10,
    compile_: bool = True,
    variants: Sequence[str] | None = None,
    out_dir: Path | None = None,
    fp8: bool = True,
    int8: bool = False,
) -> dict:
    from .. import kernels
    from ..runtime.cuda_graphs import CudaGraphRunner, compile_blocks

    ours, ref = build(num_layers, compare)
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {
        "bench": "transformer",
        **versions(),
        "kernels_backend": kernels.backend(),
        "layers": num_layers,
        "txt_len": txt_len,
        "sizes": {},
    }
    print(f"GPU {res['gpu']}, torch {res['torch']}, triton {res['triton']}, kernels {res['kernels_backend']}")
    compiled_ref = compiled_ours = None
    fp8_sets, bf16_modules = {}, None
    for size in sizes:
        h = w = size // 16
        g = torch.Generator(device=dev).manual_seed(size)
        x = torch.randn(1, h * w, 64, device=dev, dtype=dt, generator=g)
        txt = torch.randn(1, txt_len, 3584, device=dev, dtype=dt, generator=g)
        t = torch.tensor([0.7], device=dev)
        shapes = [(1, h, w)]
        flops = ours.cfg.flops_per_forward(h * w, txt_len)
        floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
        rows, outs = {}, {}

        def ref_fwd(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
            return lambda: model(
                hidden_states=x,
                encoder_hidden_states=txt,
                encoder_hidden_states_mask=None,
                timestep=t,
                img_shapes=[shapes],
                return_dict=False,
            )[0]

        def ours_fwd(fused: bool, model: QwenImageTransformer = ours) -> Callable[[], torch.Tensor]:
            def f() -> torch.Tensor:
                model.fused = fused
                return model(x, txt, None, t, shapes)

            return f

        graphs = CudaGraphRunner(ours)
        todo = {}
        if ref is not None:
            todo["diffusers eager"] = ref_fwd(ref)
        todo["qwenfast reference (eager)"] = ours_fwd(False)
        todo["qwenfast fused (eager)"] = ours_fwd(True)
        todo["qwenfast fused + CUDA graph"] = lambda: (
            setattr(ours, "fused", True),
            graphs(x, txt, None, t, shapes),
        )[1]
        # the pipeline's default: the modulation rows come from its table (runtime/modulation.py), not 120 GEMVs
        todo["qwenfast fused + CUDA graph + modulation table"] = "table"
        if fp8:  # FP8 e4m3 block GEMMs (opt-in in the product: not bitwise diffusers)
            todo["qwenfast FP8 + CUDA graph"] = "fp8:all"
            todo["qwenfast FP8 + CUDA graph + modulation table"] = "fp8:all:table"
            todo["qwenfast FP8 image stream + CUDA graph"] = "fp8:img"
        if int8:  # INT8 W8A8 block GEMMs (kernels/int8_linear.py; opt-in, lossy)
            todo["qwenfast INT8 + CUDA graph + modulation table"] = "int8:all:table"
        if compile_:  # torch.compile of the plain-torch blocks, beside the hand kernels
            if ref is not None:
                todo["diffusers regional compile"] = "compile-ref"
            todo["qwenfast reference + compile"] = "compile-ours"
        for name, fn in todo.items():
            if variants and not any(v in name for v in variants):
                continue
            t0 = time.perf_counter()
            stance = "default"
            if fn == "compile-ref":
                if compiled_ref is None:
                    ref.compile_repeated_blocks(fullgraph=True)
                    compiled_ref = True
                fn = ref_fwd(ref)
            elif fn == "compile-ours":
                if compiled_ours is None:
                    compile_blocks(ours)
                    compiled_ours = True
                fn = ours_fwd(False)
            elif fn == "table":
                stance = "force_eager"
                fn = _table_fwd(ours, CudaGraphRunner(ours), x, txt, t, shapes)
            elif isinstance(fn, str) and fn.startswith(("fp8:", "int8:")):
                table, fn = fn.endswith(":table"), fn.removesuffix(":table")
                if fn not in fp8_sets:
                    mods = (
                        _int8_modules(ours) if fn.startswith("int8") else _fp8_modules(ours, fn == "fp8:img")
                    )
                    fp8_sets[fn] = (mods, CudaGraphRunner(ours))
                mods, fp8_graphs = fp8_sets[fn]
                bf16_modules = _swap(ours, mods)
                stance = "force_eager"

                def fn(g: CudaGraphRunner = fp8_graphs) -> torch.Tensor:
                    ours.fused = True
                    return g(x, txt, None, t, shapes)

                if table:
                    fn = _table_fwd(ours, CudaGraphRunner(ours), x, txt, t, shapes)
            else:
                stance = "force_eager"  # blocks compiled for an earlier size run eagerly here
            with torch.no_grad(), torch.compiler.set_stance(stance):
                out = fn().clone()
                ms = median_ms(fn, warmup, iters)
            outs[name] = out
            if bf16_modules is not None:  # back to bf16 for the other variants and sizes
                _swap(ours, bf16_modules)
                bf16_modules = None
            rows[name] = {
                "ms": round(ms, 2),
                "tflops": round(flops / ms / 1e9, 1),
                "pct_floor": round(100 * floor_ms / ms, 1),
                "setup_s": round(time.perf_counter() - t0, 1),
            }
        base = outs.get("diffusers eager")
        bf16 = outs.get("qwenfast fused + CUDA graph + modulation table")
        for name, r in rows.items():
            if bf16 is not None and ("FP8" in name or "INT8" in name):
                r["rel_err_vs_bf16"] = float(f"{rel_err(outs[name], bf16):.2e}")
            if base is not None:
                r["rel_err_vs_diffusers"] = float(f"{rel_err(outs[name], base):.2e}")
                r["speedup_vs_diffusers_eager"] = round(rows["diffusers eager"]["ms"] / r["ms"], 2)
                if "diffusers regional compile" in rows:
                    r["speedup_vs_diffusers_compile"] = round(
                        rows["diffusers regional compile"]["ms"] / r["ms"], 2
                    )
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            ours.fused = True
            prof = _profile(lambda: ours(x, txt, None, t, shapes))
            cfg_check = _batched_cfg_check(ours, x, txt, t, shapes)
        res["sizes"][size] = {
            "tflop": round(flops / 1e12, 2),
            "floor_ms": round(floor_ms, 1),
            "variants": rows,
            "profile_fused_eager_pct": prof,
            "batched_cfg_rel_err": cfg_check,
        }
        _print_table(size, flops, floor_ms, rows, prof, cfg_check)
    emit(res, "transformer.jsonl", out_dir)
    return res


def _table_fwd(model, graphs, x, txt, t, shapes) -> Callable[[], torch.Tensor]:
    """The graphed forward with its modulation rows from a table entry (computed once, as the
    pipeline's table does): what a denoising step runs by default."""
    from ..runtime.modulation import batch_rows

    with torch.no_grad():
        mods = batch_rows(model.modulation_entries([t[:1]])[0], x.shape[0])

    def f() -> torch.Tensor:
        model.fused = True
        return graphs(x, txt, None, t, shapes, modulations=mods)

    return f


def _fp8_modules(model, image_only: bool = False) -> dict:
    """FP8 copies of the blocks' big Linears, by module name (the bf16 ones stay for other variants)."""
    from ..kernels.fp8_linear import FP8Linear
    from ..models.transformer import BLOCK_LINEARS, IMAGE_LINEARS

    names = IMAGE_LINEARS if image_only else BLOCK_LINEARS
    return {
        f"transformer_blocks.{i}.{n}": FP8Linear.from_linear(b.get_submodule(n))
        for i, b in enumerate(model.transformer_blocks)
        for n in names
    }


def _int8_modules(model) -> dict:
    """INT8 copies of the blocks' big Linears, by module name (the bf16 ones stay for other variants)."""
    from ..kernels.int8_linear import Int8Linear
    from ..models.transformer import BLOCK_LINEARS

    return {
        f"transformer_blocks.{i}.{n}": Int8Linear.from_linear(b.get_submodule(n))
        for i, b in enumerate(model.transformer_blocks)
        for n in BLOCK_LINEARS
    }


def _swap(model, modules: dict) -> dict:
    """Put `modules` (name -> module) into `model`; returns the ones they replaced."""
    old = {}
    for name, m in modules.items():
        parent, _, leaf = name.rpartition(".")
        par = model.get_submodule(parent)
        old[name] = par[int(leaf)] if leaf.isdigit() else getattr(par, leaf)
        if leaf.isdigit():
            par[int(leaf)] = m
        else:
            setattr(par, leaf, m)
    return old


def _batched_cfg_check(model, x, txt, t, shapes) -> float:
    """Batch-2 forward with text lengths L and ~0.6L (padded + masked) vs two separate forwards."""
    from ..pipeline.text_to_image import join_text

    short = txt[:, : max(1, int(txt.shape[1] * 0.6))]
    emb2, mask2 = join_text(txt, None, short, None)
    both = model(torch.cat([x, x]), emb2, mask2, torch.cat([t, t]), shapes)
    a, b = model(x, txt, None, t, shapes), model(x, short, None, t, shapes)
    return float(f"{max(rel_err(both[:1], a), rel_err(both[1:], b)):.2e}")


def _print_table(size, flops, floor_ms, rows, prof, cfg_check):
    print(
        f"\n{size}x{size}: {flops / 1e12:.1f} TFLOP per forward, floor {floor_ms:.1f} ms at {PEAK_TFLOPS:.0f} TFLOP/s"
    )
    print(f"{'variant':34}{'ms':>9}{'TFLOP/s':>9}{'%floor':>8}{'x eager':>9}{'x compile':>10}{'rel err':>10}")
    for name, r in rows.items():
        print(
            f"{name:34}{r['ms']:>9.1f}{r['tflops']:>9.0f}{r['pct_floor']:>8.1f}"
            f"{r.get('speedup_vs_diffusers_eager', float('nan')):>9.2f}"
            f"{r.get('speedup_vs_diffusers_compile', float('nan')):>10.2f}"
            f"{r.get('rel_err_vs_diffusers', float('nan')):>10.1e}"
        )
    print(
        f"kernel time (fused eager): GEMM {prof['gemm']}%  attention {prof['attention']}%  other {prof['other']}%"
        f"  ({prof['total_ms']} ms);  batched CFG vs separate: rel err {cfg_check:.1e}"
    )
