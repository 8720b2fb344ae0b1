"""`qwenfast export onnx`: one component of a Qwen-Image model as an ONNX graph (for TensorRT, Triton
Inference Server, onnxruntime).

Components and their graphs (inputs -> outputs; B, h, w, L dynamic where the model allows):
- vae-decoder: latents (B, 16, h, w), raw VAE space (`z * std + mean` of the pipeline's normalised
  latents) -> images (B, 3, 8h, 8w) in [-1, 1]. Dynamic batch and size.
- vae-encoder: images (B, 3, H, W) in [-1, 1] -> latent_mean (B, 16, H/8, W/8), the posterior mode
  edits use. Dynamic batch and size (H, W multiples of 8).
- transformer: hidden_states (B, h/2*w/2, 64) packed latents, encoder_hidden_states (B, L, D),
  encoder_hidden_states_mask (B, L) int64 (1 = real token), timestep (B,) sigma in [0, 1] -> the
  velocity (B, h/2*w/2, 64). RoPE tables are built from the image grid and the text length, so the
  image size and L are a fixed *bucket* chosen at export (`--height --width --text-len`): pad prompts
  to L with mask 0 and export one graph per size you serve. Batch is dynamic.
- text-encoder: input_ids (B, S), attention_mask (B, S) -> last_hidden_state (B, S, D), the language
  model's final normed state (what the pipeline reads; tokenising with the prompt template and
  dropping its 34 prefix tokens stay outside). Dynamic batch and length. Traced with transformers'
  "eager" attention (matmul, softmax in fp32, matmul: the same math as SDPA): the exporter's own SDPA
  decomposition casts its scale constant to the graph dtype, and constant-folding that cast for bf16
  makes a ComplexDouble constant the ONNX writer refuses ("ScalarType ComplexDouble is an unexpected
  tensor scalar type"), so bf16 text encoders could not be exported.

Graphs use the reference modules (no Triton kernels), the TorchScript-based exporter
(`torch.onnx.export(..., dynamo=False)`, no onnxscript needed) at opset `OPSET`, and store weights
in an external data file next to the .onnx when the model is above `EXTERNAL_ABOVE` bytes (ONNX's
protobuf limit is 2 GB). `dtype` picks the weight/activation precision: fp32, fp16 or bf16 (bf16 runs
on TensorRT; onnxruntime's CPU provider has few bf16 kernels).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

OPSET = 17  # LayerNormalization (17) for the text encoder; TensorRT 8.6+ and onnxruntime 1.14+ read it
EXTERNAL_ABOVE = 1 << 30  # weights above 1 GiB go to an external file (ONNX's protobuf limit is 2 GB)
COMPONENTS = ("vae-decoder", "vae-encoder", "transformer", "text-encoder")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class VaeDecoderGraph(nn.Module):
    """latents (B, 16, h, w), raw VAE space -> images (B, 3, 8h, 8w) in [-1, 1] (the reference modules)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decoder(self.vae.post_quant_conv(latents)).clamp(-1.0, 1.0)


class VaeEncoderGraph(nn.Module):
    """images (B, 3, H, W) in [-1, 1] -> the posterior mean (B, 16, H/8, W/8)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vae.quant_conv(self.vae.encoder(images)).chunk(2, dim=1)[0]


class TransformerGraph(nn.Module):
    """The MMDiT forward at one image grid (the bucket); reference blocks (`fused=False` semantics)."""

    def __init__(self, transformer, h: int, w: int):
        super().__init__()
        self.transformer, self.img_shapes = transformer, [(1, h // 2, w // 2)]

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep):
        return self.transformer(
            hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, self.img_shapes
        )


class TextEncoderGraph(nn.Module):
    """input_ids, attention_mask (B, S) -> the language model's last hidden state (B, S, D)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.hidden_states[-1]


@dataclass
class Exported:
    path: Path
    component: str
    inputs: dict  # name -> example shape
    onnx_bytes: int
    data_bytes: int  # external weights (0 = inside the .onnx)
    seconds: float
    opset: int = OPSET

    def summary(self) -> str:
        ext = f" + {self.data_bytes / 2**20:.1f} MiB external data" if self.data_bytes else ""
        return (
            f"{self.component}: {self.path} ({self.onnx_bytes / 2**20:.1f} MiB{ext}; opset {self.opset}; "
            f"{self.seconds:.1f}s)"
        )


@contextlib.contextmanager
def _eager_attention(module: nn.Module):
    """transformers' attention of every config under `module` set to "eager" while tracing (see the module
    docstring: the SDPA decomposition cannot be exported in bf16)."""
    configs = {
        id(m.config): m.config
        for m in module.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    old = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = "eager"
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = old[k]


@contextlib.contextmanager
def _reference_modules(transformer=None):
    """The transformer's plain blocks and the default attention for the export (no Triton, no graphs)."""
    if transformer is None:
        yield
        return
    old = transformer.fused
    transformer.fused = False
    try:
        yield
    finally:
        transformer.fused = old


def build_graph(
    pipe, component: str, *, height: int = 1024, width: int = 1024, text_len: int = 128, batch: int = 1
) -> tuple[nn.Module, tuple, dict, list[str], list[str]]:
    """(module, example inputs, dynamic axes, input names, output names) of one component of `pipe`."""
    from ..pipeline.sampling import latent_hw

    dev, dt = pipe.device, pipe.dtype
    h, w = latent_hw(height, width, pipe.vae_scale_factor)
    if component == "vae-decoder":
        z = torch.randn(batch, pipe.vae.cfg.z_dim, h, w, device=dev, dtype=pipe.vae_dtype)
        return (
            VaeDecoderGraph(pipe.vae),
            (z,),
            {"latents": {0: "batch", 2: "h", 3: "w"}, "images": {0: "batch", 2: "height", 3: "width"}},
            ["latents"],
            ["images"],
        )
    if component == "vae-encoder":
        x = torch.rand(batch, 3, 8 * h, 8 * w, device=dev, dtype=pipe.vae_dtype) * 2 - 1
        return (
            VaeEncoderGraph(pipe.vae),
            (x,),
            {"images": {0: "batch", 2: "height", 3: "width"}, "latent_mean": {0: "batch", 2: "h", 3: "w"}},
            ["images"],
            ["latent_mean"],
        )
    if component == "transformer":
        cfg = pipe.transformer.cfg
        x = torch.randn(batch, (h // 2) * (w // 2), cfg.in_channels, device=dev, dtype=dt)
        emb = torch.randn(batch, text_len, cfg.joint_attention_dim, device=dev, dtype=dt)
        mask = torch.ones(batch, text_len, dtype=torch.long, device=dev)
        mask[:, text_len * 3 // 4 :] = 0  # traced with padding, so the masked path is in the graph
        t = torch.full((batch,), 0.5, device=dev, dtype=dt)
        names = ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"]
        axes = {n: {0: "batch"} for n in [*names, "velocity"]}
        return TransformerGraph(pipe.transformer, h, w), (x, emb, mask, t), axes, names, ["velocity"]
    if component == "text-encoder":
        from ..models.text_encoder import language_model

        te = pipe.text_encoder
        ids = te.tokenizer([text_prompt_example()] * batch, return_tensors="pt").input_ids.to(dev)
        mask = torch.ones_like(ids)
        lm = language_model(te.model) or te.model
        axes = {
            "input_ids": {0: "batch", 1: "tokens"},
            "attention_mask": {0: "batch", 1: "tokens"},
            "last_hidden_state": {0: "batch", 1: "tokens"},
        }
        return TextEncoderGraph(lm), (ids, mask), axes, ["input_ids", "attention_mask"], ["last_hidden_state"]
    raise ValueError(f"unknown component {component!r}; choose one of {', '.join(COMPONENTS)}")


def text_prompt_example() -> str:
    from ..models.text_encoder import T2I_TEMPLATE

    return T2I_TEMPLATE.format("a red fox in the snow, photograph")


def export_onnx(
    pipe,
    component: str,
    output: str | Path,
    *,
    height: int = 1024,
    width: int = 1024,
    text_len: int = 128,
    opset: int = OPSET,
    external: bool | None = None,
) -> Exported:
    """Export one component of a loaded pipeline (its dtype is the graph's) to `output` (.onnx).

    external: weights in `<output>.data` (None = when the weights exceed `EXTERNAL_ABOVE`).
    """
    from ..validation import MissingExtra

    try:
        import onnx  # the [export] extra
    except ImportError:
        raise MissingExtra("exporting to ONNX", "export", "onnx") from None

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    module, args, axes, inputs, outputs = build_graph(
        pipe, component, height=height, width=width, text_len=text_len
    )
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    external = weights > EXTERNAL_ABOVE if external is None else external
    t0 = time.perf_counter()
    tmp = output.with_suffix(".tmp.onnx")
    eager = _eager_attention(module) if component == "text-encoder" else contextlib.nullcontext()
    with (
        torch.no_grad(),
        _reference_modules(pipe.transformer if component == "transformer" else None),
        eager,
        warnings.catch_warnings(),
    ):
        # expected and harmless here: shape checks traced as constants (the graphs' dynamic axes are tested),
        # and the exporter's note on how it writes advanced indexing
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*advanced indexing.*")
        torch.onnx.export(
            module.eval(),
            args,
            str(tmp),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    model = onnx.load(str(tmp), load_external_data=True)
    for f in tmp.parent.glob(tmp.name + "*"):
        f.unlink()
    for leftover in tmp.parent.glob("*.tmp.onnx*"):  # the exporter's own external files, if any
        leftover.unlink()
    data = output.with_name(output.name + ".data")
    if data.exists():
        data.unlink()
    if external:
        onnx.save_model(
            model,
            str(output),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(output))
    seconds = time.perf_counter() - t0
    shapes = {n: tuple(a.shape) for n, a in zip(inputs, args)}
    return Exported(
        output,
        component,
        shapes,
        output.stat().st_size,
        data.stat().st_size if data.exists() else 0,
        seconds,
        opset,
    )
