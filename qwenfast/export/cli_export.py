"""`qwenfast export onnx ...`: arguments and command (kept out of cli.py, like the benchmarks)."""

from __future__ import annotations

import argparse
import json
import sys

from .onnx_export import COMPONENTS, DTYPES, OPSET


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="format", required=True)
    o = sub.add_parser("onnx", help="one model component as an ONNX graph (TensorRT / Triton / onnxruntime)")
    o.add_argument("--component", required=True, choices=COMPONENTS, help="which part of the model to export")
    o.add_argument(
        "-o", "--output", required=True, help="the .onnx file (weights > 1 GiB go to FILE.data beside it)"
    )
    o.add_argument("--model", default=None, help="diffusers model folder (default: the embedded demo model)")
    o.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="graph precision (default fp32)")
    o.add_argument("--device", default="cpu", help="where to trace (cuda helps for big models; default cpu)")
    o.add_argument(
        "--height", type=int, default=1024, help="example / bucket image height in pixels (default 1024)"
    )
    o.add_argument(
        "--width", type=int, default=1024, help="example / bucket image width in pixels (default 1024)"
    )
    o.add_argument("--text-len", type=int, default=128, help="transformer bucket: text tokens (default 128)")
    o.add_argument("--opset", type=int, default=OPSET, help=f"ONNX opset (default {OPSET})")
    o.add_argument(
        "--random-weights",
        action="store_true",
        help="full-size architecture with random weights (no checkpoint needed): sizes and timing only",
    )
    o.add_argument(
        "--check",
        action="store_true",
        help="run the graph in onnxruntime (CPU) and compare with torch (fp32 / fp16 graphs: "
        "onnxruntime's CPU provider has no bf16 kernels)",
    )


CHECK_BF16 = (
    "--check runs the graph in onnxruntime's CPU provider, which has no bfloat16 kernels (Conv, MatMul, "
    "Where: no bf16 graph of this model loads there), so a bf16 graph cannot be checked here. Export "
    "without --check (bf16 graphs run on TensorRT), or check the same component exported with --dtype "
    "fp32 or fp16"
)


def run(a: argparse.Namespace) -> int:
    from .. import validation as V

    V.require_extra("qwenfast export onnx", "export", "onnx", *(["onnxruntime"] if a.check else []))
    if a.check and a.dtype == "bf16":  # refused before any work: the check could only fail
        raise ValueError(CHECK_BF16)
    if a.height % 16 or a.width % 16 or a.height < 16 or a.width < 16:
        raise ValueError(f"--height and --width must be multiples of 16 (>= 16), got {a.width}x{a.height}")
    import torch

    from .onnx_export import export_onnx

    pipe = _load(a)
    rec = export_onnx(
        pipe, a.component, a.output, height=a.height, width=a.width, text_len=a.text_len, opset=a.opset
    )
    print(rec.summary())
    out = {
        "component": a.component,
        "path": str(rec.path),
        "onnx_bytes": rec.onnx_bytes,
        "data_bytes": rec.data_bytes,
        "seconds": round(rec.seconds, 2),
        "opset": rec.opset,
        "dtype": a.dtype,
        "inputs": rec.inputs,
    }
    if a.check:
        from .onnx_export import build_graph
        from .onnx_runtime import OnnxComponent

        module, args, _, names, _ = build_graph(
            pipe, a.component, height=a.height, width=a.width, text_len=a.text_len
        )
        with torch.no_grad():
            want = module(*args).float().cpu()
        try:
            got = OnnxComponent(rec.path)(**dict(zip(names, args))).float()
        except Exception as e:  # onnxruntime's errors are not one class; say what failed, keep the file
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            print(json.dumps({**out, "check": "failed"}), file=sys.stderr)
            raise ValueError(
                f"{rec.path} was written, but onnxruntime (CPU) could not run it: {first}"
            ) from None
        out["max_abs_diff_vs_torch"] = float((got - want).abs().max())
        print(f"onnxruntime vs torch: max |diff| {out['max_abs_diff_vs_torch']:.3g}")
    print(json.dumps(out), file=sys.stderr)
    return 0


def _load(a):
    import torch

    dt = DTYPES[a.dtype]
    if a.random_weights:  # the full-size Qwen-Image VAE, randomly initialised: graph size and export time
        from types import SimpleNamespace

        from ..config import QWEN_IMAGE_VAE
        from ..models.vae import QwenImageVAE

        if not a.component.startswith("vae"):
            raise ValueError("--random-weights builds the full-size VAE only (vae-decoder, vae-encoder)")
        dev = torch.device(a.device)
        vae = QwenImageVAE(QWEN_IMAGE_VAE).to(dev, dt).eval().requires_grad_(False)
        return SimpleNamespace(
            vae=vae,
            device=dev,
            dtype=dt,
            vae_dtype=dt,
            vae_scale_factor=vae.spatial_compression_ratio,
            transformer=None,
        )
    from ..about import DEMO_MODEL
    from ..pipeline.auto import from_pretrained

    return from_pretrained(a.model or DEMO_MODEL, device=a.device, dtype=dt, cuda_graphs=False)
