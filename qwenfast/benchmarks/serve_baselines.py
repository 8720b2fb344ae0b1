"""What `qwenfast bench serve --workload mixed` measures beside the server (benchmarks/serve_mixed.py):
a plain diffusers loop over the same requests, and the per-row LoRA overhead of one forward.

The diffusers loop is what a user would write to serve this workload: one request at a time through
diffusers' QwenImagePipeline (bf16, PEFT adapters for the LoRAs: `load_lora_weights` on first use,
`set_adapters` per request, `disable_lora` for none; at most `keep` adapters loaded, the least recently
used deleted). Adapter loading is left out of the time (a service would load them ahead); the step
cache is diffusers' none (it has no `cache=` per request), so those requests run full 50 steps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import torch

from ..kernels import fp8_lora_gemm
from ..kernels.fp8_linear import FP8Linear
from . import median_ms


def diffusers_loop(ref, reqs: list, folder: Path, seconds: float, keep: int = 4) -> dict:
    """Serve `reqs` in order with diffusers' pipeline `ref` for `seconds` -> images/min and counts."""
    ref.set_progress_bar_config(disable=True)
    loaded: OrderedDict[str, None] = OrderedDict()
    done, ooms, load_s, per_cls = 0, 0, 0.0, {}
    t0 = time.perf_counter()
    for r in reqs:
        if time.perf_counter() - t0 - load_s >= seconds:
            break
        t_load = time.perf_counter()
        if r.lora is not None:
            if r.lora not in loaded:
                if len(loaded) >= keep:
                    ref.delete_adapters(loaded.popitem(last=False)[0])
                ref.load_lora_weights(str(folder / f"{r.lora}.safetensors"), adapter_name=r.lora)
                loaded[r.lora] = None
            loaded.move_to_end(r.lora)
            ref.enable_lora()
            ref.set_adapters([r.lora], adapter_weights=[r.strength])
        elif loaded:
            ref.disable_lora()
        torch.cuda.synchronize()
        load_s += time.perf_counter() - t_load
        t = time.perf_counter()
        try:
            ref(
                prompt=r.prompt,
                negative_prompt=" " if r.cfg > 1 else None,
                true_cfg_scale=r.cfg,
                height=r.height,
                width=r.width,
                num_inference_steps=r.steps,
                generator=torch.Generator("cpu").manual_seed(r.seed),
                output_type="pil",
            )
        except torch.OutOfMemoryError:
            ooms += 1
            torch.cuda.empty_cache()
            continue
        done += 1
        per_cls.setdefault(r.cls, []).append(time.perf_counter() - t)
    wall = time.perf_counter() - t0 - load_s
    return {
        "images": done,
        "oom": ooms,
        "wall_s": round(wall, 2),
        "images_per_min": round(60 * done / wall, 2),
        "adapter_load_s_left_out": round(load_s, 1),
        "mean_s": {k: round(sum(v) / len(v), 3) for k, v in per_cls.items()},
    }


def save_loras(folder: Path, model, n: int, seed: int = 0) -> list[str]:
    """n random LoRAs on every block Linear of `model` (diffusers names, rank 32 or 64 alternating,
    bf16), written to `folder` as lora-<i>.safetensors; their names."""
    from safetensors.torch import save_file

    dim = model.cfg.inner_dim
    ff = 4 * dim
    attn = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")
    shapes = {f"attn.{n}": (dim, dim) for n in attn}
    for stream in ("img", "txt"):
        shapes |= {f"{stream}_mlp.net.0.proj": (dim, ff), f"{stream}_mlp.net.2": (ff, dim)}
    folder.mkdir(parents=True, exist_ok=True)
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    names = []
    for i in range(n):
        rank = 32 if i % 2 == 0 else 64
        sd = {}
        for b in range(len(model.transformer_blocks)):
            for mod, (k, o) in shapes.items():
                pre = f"transformer.transformer_blocks.{b}.{mod}"
                a = torch.randn(rank, k, device=dev, generator=g) / k**0.5
                up = torch.randn(o, rank, device=dev, generator=g) * (0.02 / rank**0.5)
                sd[f"{pre}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
                sd[f"{pre}.lora_B.weight"] = up.to(torch.bfloat16).cpu()
        names.append(f"lora-{i}")
        save_file(sd, str(folder / f"{names[-1]}.safetensors"))
    return names


@torch.no_grad()
def row_overhead(
    pipe, names: list[str], size: int = 1024, batch: int = 4, txt_len: int = 128, graphs: bool = False
) -> dict:
    """One transformer forward (batch `batch`, `size`², no CFG, eager) with no per-row adapters installed,
    with each row its own LoRA (`names[:batch]`), and with every row choosing none; ms (median of 10).
    `graphs`: the same three replayed as CUDA graphs too (`*_graph_ms`: what a server with
    --cuda-graphs runs)."""
    from ..runtime.cuda_graphs import CudaGraphRunner

    tr, dev = pipe.transformer, pipe.device
    h = w = size // 16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(batch, h * w, 64, device=dev, dtype=pipe.dtype, generator=g)
    txt = torch.randn(batch, txt_len, tr.cfg.joint_attention_dim, device=dev, dtype=pipe.dtype, generator=g)
    t = torch.full((batch,), 0.7, device=dev)

    def fwd():
        return tr(x, txt, None, t, [(1, h, w)])

    def timed(key: str) -> None:
        res[f"{key}_ms"] = round(median_ms(fwd), 2)
        if graphs:
            runner = CudaGraphRunner(tr)  # a new one: the layers' side paths differ between the three
            res[f"{key}_graph_ms"] = round(median_ms(lambda: runner(x, txt, None, t, [(1, h, w)])), 2)
            runner.clear()

    rows = pipe.row_loras
    res = {"batch": batch, "size": size, "ranks": []}
    if rows is not None:
        rows.uninstall()
    timed("none_installed")
    if rows is None:
        return res
    rows.install()
    try:
        sel = [[(n, 1.0)] for n in names[:batch]]
        rows.select(sel, dev)
        res["ranks"] = [int(rows.stacks[m].down.shape[1]) for m in list(rows.stacks)[:1]]
        fp8 = any(isinstance(m, FP8Linear) for m in tr.modules())
        was = fp8_lora_gemm.FUSED_GEMM["on"]
        try:
            fp8_lora_gemm.FUSED_GEMM["on"] = 0  # the side path: the base GEMM, then the expand
            timed("each_row_its_lora")
            if fp8:  # the update in the FP8 GEMM's epilogue instead (eagerly too)
                ref = fwd().float()
                fp8_lora_gemm.FUSED_GEMM["on"] = 2
                timed("each_row_its_lora_fused_gemm")
                res["fused_gemm_rel_err"] = round(float((fwd().float() - ref).norm() / ref.norm()), 5)
        finally:
            fp8_lora_gemm.FUSED_GEMM["on"] = was
        rows.select([[] for _ in range(batch)], dev)
        timed("rows_without_lora")
    finally:
        rows.clear()
    for suffix in ("", "_graph") if graphs else ("",):
        base = res[f"none_installed{suffix}_ms"]
        res[f"overhead{suffix}_pct"] = round(100 * (res[f"each_row_its_lora{suffix}_ms"] / base - 1), 1)
        if f"each_row_its_lora_fused_gemm{suffix}_ms" in res:
            fused = res[f"each_row_its_lora_fused_gemm{suffix}_ms"]
            res[f"overhead_fused_gemm{suffix}_pct"] = round(100 * (fused / base - 1), 1)
        res[f"no_lora_rows_overhead{suffix}_pct"] = round(
            100 * (res[f"rows_without_lora{suffix}_ms"] / base - 1), 1
        )
    return res


def run_rows(lora_folder: str | None = None, n_loras: int = 10, out_dir=None, weights: str = "fp8") -> dict:
    """`qwenfast bench serve --workload rows`: only the per-row LoRA overhead of one forward
    (`row_overhead`, eager and CUDA-graphed) on the mixed workload's model (random-full; `weights` fp8,
    int8 or bf16: the same side path beside an 8-bit or a float GEMM) and its random LoRAs (the rank-64
    ones), without the serving levels: a record of its own in serve_mixed.jsonl (`mode: row_overhead`).
    A CUDA GPU only."""
    import tempfile
    import time
    from pathlib import Path

    from . import emit, versions
    from .pipeline import build

    if not torch.cuda.is_available():
        raise RuntimeError("--workload rows builds full-size weights on a CUDA GPU; none is visible")
    t0 = time.perf_counter()
    pipe, _ = build(smoke=False, diffusers_transformer=False)
    pipe.configure(fp8=weights == "fp8", int8=weights == "int8")
    folder = Path(lora_folder) if lora_folder else Path(tempfile.mkdtemp(prefix="qwenfast-loras-"))
    names = [f"lora-{i}" for i in range(n_loras)]
    if not all((folder / f"{n}.safetensors").is_file() for n in names):
        names = save_loras(folder, pipe.transformer, n_loras)
    pipe.enable_row_loras(folder, slots=n_loras)
    res = {
        "bench": "serve_mixed",
        "mode": "row_overhead",
        **versions(),
        "model": "random-full",
        "weights": weights,
    }
    res["build_s"] = round(time.perf_counter() - t0, 1)
    from ..kernels import lora_rows

    res["tiles"] = {k: list(v) if isinstance(v, tuple) else v for k, v in lora_rows.TILES.items()}
    res["tiles"]["fp8_lora_gemm"] = list(fp8_lora_gemm.FUSED_GEMM["gemm"])
    res["row_overhead"] = row_overhead(pipe, names[1::2], graphs=True)  # the rank-64 LoRAs (save_loras)
    print(f"  per-row LoRA overhead, one forward: {res['row_overhead']}")
    emit(res, "serve_mixed.jsonl", out_dir)
    return res
