"""ComfyUI's own Qwen-Image model as a `bench peers` engine: `comfy/ldm/qwen_image/model.py` with its
attention (`comfy/ldm/modules/attention.py`) and its ops (`comfy/ops.py`), over the same seeded weights.

Why: ComfyUI is what most Qwen-Image users run, so its transformer forward is the baseline they know.
Its end-to-end path (sampler, VAE, text encoder) needs its node graph: that is the `comfyui-workflow`
engine (`peers_comfyui_e2e`); the rows here are one transformer forward.

ComfyUI is not a dependency: the worker imports it from the folder named by `QWENFAST_COMFYUI` (a work
tree of the pip-installable fork hiddenswitch/pip-and-uv-installable-ComfyUI; docs/comfyui.md names the
commit). Its key layout for this model is diffusers' names under `model.diffusion_model.` (the prefix
qwenfast's single-file loader strips, `loading.single_file`), so the weights are diffusers' seeded ones
renamed. The model is built as ComfyUI's `BaseModel` builds it: `comfy.ops.pick_operations` on the weight
dtype and `unet_manual_cast`'s compute dtype (bf16 weights on a bf16 GPU: `disable_weight_init`).
"FP8 scaled" is a scaled fp8 checkpoint as such files store it (block Linears in e4m3 with a per-tensor
`.scale_weight` and the `scaled_fp8` marker), read through ComfyUI's own `convert_old_quants`, so it
runs its mixed-precision ops: fp8 GEMMs where `supports_fp8_compute`, dequantised weights elsewhere.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..loading.single_file import TRANSFORMER_PREFIXES, _split_prefix

COMFY_PREFIX = TRANSFORMER_PREFIXES[0]  # "model.diffusion_model.": ComfyUI's checkpoints and model_base
ENV = "QWENFAST_COMFYUI"
NOT_RUN_E2E = "end to end is the comfyui-workflow engine (ComfyUI's own workflow), not asked in this run"
FP8_MAX = 448.0  # float8_e4m3fn
ROWS = ("ComfyUI native bf16", "ComfyUI native fp8 scaled")


# ------------------------------------------------------------------------------------------------ keys
def to_comfy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers `QwenImageTransformer2DModel` state dict -> ComfyUI's checkpoint layout."""
    return {COMFY_PREFIX + k: v for k, v in sd.items()}


def from_comfy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's layout -> diffusers names, the way qwenfast's single-file loader reads such a file."""
    prefix, keys = _split_prefix(list(sd), TRANSFORMER_PREFIXES)
    return {k[len(prefix) :]: sd[k] for k in keys}


def is_block_linear(key: str, t: torch.Tensor) -> bool:
    """The weights a Qwen-Image scaled fp8 checkpoint quantises: the 2-D weights inside the blocks."""
    return key.startswith(COMFY_PREFIX + "transformer_blocks.") and key.endswith(".weight") and t.ndim == 2


def scaled_fp8(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI-layout state dict -> a scaled fp8 checkpoint's tensors: each block Linear weight in e4m3
    with its per-tensor `.scale_weight` (amax / 448), other tensors as they are, and the empty
    `scaled_fp8` marker (an empty one: fp8 matmuls allowed; two elements would ask for full precision)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if not is_block_linear(k, t):
            out[k] = t
            continue
        scale = (t.detach().float().abs().amax() / FP8_MAX).clamp(min=1e-12)
        out[k] = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[k[: -len("weight")] + "scale_weight"] = scale.reshape(())
    out[COMFY_PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


# ------------------------------------------------------------------------------------------------ model
def import_comfyui(folder: str | None = None) -> Path:
    """Put the ComfyUI work tree (`folder` or `$QWENFAST_COMFYUI`) first on sys.path; its folder."""
    folder = folder or os.environ.get(ENV)
    if not folder or not (Path(folder) / "comfy" / "ldm" / "qwen_image" / "model.py").is_file():
        raise RuntimeError(
            f"${ENV} must name a ComfyUI work tree (with comfy/ldm/qwen_image/model.py); got {folder!r}"
        )
    if folder not in sys.path:
        sys.path.insert(0, folder)
    argv, sys.argv = sys.argv, sys.argv[:1]  # ComfyUI parses the command line at import: not ours to read
    try:
        import comfy.cli_args  # noqa: F401  (parsed now, while it sees no arguments)
        import comfy.ldm.qwen_image.model  # noqa: F401  (fails here, with the missing package named, if any)
    finally:
        sys.argv = argv

    return Path(folder)


def comfy_config(cfg: Any) -> dict:
    """ComfyUI's QwenImageTransformer2DModel arguments from diffusers' transformer config."""
    return dict(
        patch_size=cfg.patch_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
        num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.joint_attention_dim,
        axes_dims_rope=tuple(cfg.axes_dims_rope), use_additional_t_cond=cfg.use_additional_t_cond,
    )  # fmt: skip


def build_comfy(cfg: Any, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, fp8: bool):
    """ComfyUI's model over `sd` (ComfyUI layout, weights in `dtype`), its ops picked as `BaseModel`
    picks them; `fp8`: `sd` made a scaled fp8 checkpoint and read through `convert_old_quants`."""
    import comfy.model_management as mm
    import comfy.ops
    import comfy.utils
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    supported = (torch.bfloat16, torch.float32)  # comfy.supported_models.QwenImage
    if fp8:
        sd, _ = comfy.utils.convert_old_quants(scaled_fp8(sd), COMFY_PREFIX, {})
        quant = comfy.utils.detect_layer_quantization(sd, COMFY_PREFIX)
        cast, weight_dtype = mm.unet_manual_cast(None, device, supported), None
    else:
        quant, cast, weight_dtype = None, mm.unet_manual_cast(dtype, device, supported), dtype
    ops = comfy.ops.pick_operations(
        weight_dtype, cast, device, model_config=SimpleNamespace(quant_config=quant)
    )
    model_dtype = cast or dtype
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(
            **comfy_config(cfg), dtype=model_dtype, device=None, operations=ops
        )
    # assign: the model takes the tensors (no second copy of 40 GB on the GPU)
    missing, unexpected = model.load_state_dict(from_comfy(sd), strict=False, assign=True)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing or unexpected or left:
        raise RuntimeError(
            f"ComfyUI model: missing {missing[:5]}, unexpected {unexpected[:5]}, unset {left[:5]}"
        )
    print(f"ComfyUI ops: {ops.__name__}, weights {weight_dtype}, compute {model_dtype}", flush=True)
    return model.eval().requires_grad_(False), ops.__name__


# ------------------------------------------------------------------------------------------------ forward
def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """diffusers' packed latents (B, h*w, C*4) -> ComfyUI's (B, C, 1, 2h, 2w) (inverse of `_pack_latents`)."""
    b, _, c4 = x.shape
    x = x.view(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 1, 2 * h, 2 * w)


def pack(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's (B, C, 1, H, W) output -> diffusers' packed (B, H/2*W/2, C*4), to compare like with like."""
    b, c, _, hh, ww = x.shape
    x = x.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


def comfy_forward(model, x: torch.Tensor, txt: torch.Tensor, t: torch.Tensor, shape: tuple[int, int, int]):
    """The same forward as diffusers' (`forward_inputs`: packed latents, text states, t in [0, 1], no mask)
    through ComfyUI's signature: its `_forward(x, timesteps, context)` takes the unpacked latents and the
    same t (its time embedding scales by 1000 as diffusers' does). Returns a callable giving packed output."""
    _, h, w = shape
    lat = unpack(x, h, w)
    return lambda: pack(model(lat, t, txt))


def run_comfyui(cases: list[str], emit, smoke: bool, helpers: SimpleNamespace) -> None:
    """Rows "ComfyUI native bf16" and "… fp8 scaled" for the forward cases (the smoke: the demo model in
    fp32 on the CPU); end-to-end cases are not run (see the module docstring)."""
    import_comfyui()
    pipe = helpers.build_diffusers(smoke)
    fp = helpers.fingerprint(pipe.transformer.transformer_blocks, pipe.vae, pipe.text_encoder)
    cfg, device, dtype = pipe.transformer.config, pipe.transformer.device, pipe.transformer.dtype
    sd = to_comfy({k: v for k, v in pipe.transformer.state_dict().items()})
    del pipe
    helpers.free()
    cases = [c for c in cases if helpers.CASES[c][0] == "fwd"]
    for row, fp8 in zip(ROWS, (False, True)):  # fp8 on the CPU: ComfyUI dequantises (no fp8 GEMM there)
        t0 = time.perf_counter()
        model, ops = build_comfy(cfg, sd, device, dtype, fp8)
        setup = round(time.perf_counter() - t0, 1)
        for case in cases:
            _, size, _, _ = helpers.shape(case, smoke)
            x, txt, t, shapes = helpers.forward_inputs(size, device, dtype, cfg.joint_attention_dim)
            r = helpers.time_forward(comfy_forward(model, x, txt, t, shapes[0]))
            emit(row, case, r, fingerprint=fp, setup_s=setup, comfy_ops=ops)
        del model
        helpers.free()
