"""ControlNet and Layered pipelines vs diffusers, full size, random weights, same tensors, same run.

`python -m qwenfast.benchmarks.tasks [--results DIR] [--smoke]`. Rows (each: a 2-step warm-up per
engine with the same shapes, which captures our CUDA graphs, then one timed call; the time, peak
memory and the mean |difference| of the two engines' images):
- controlnet-60: `QwenImageControlNetPipeline` with a ControlNet of diffusers' default config (60
  blocks), 1024², 20 steps, true CFG; then ours again with FP8 (transformer and ControlNet);
- union-2cond: the InstantX Union config (5 blocks), two control images (Multi), 1024², 20 steps, CFG;
- inpaint: `QwenImageControlNetInpaintPipeline`, InstantX Inpainting config (5 blocks, +4 channels);
- layered: `QwenImageLayeredPipeline`, a 1024x768 RGBA picture at resolution 640 (736x544), 4
  layers (5 frames + the picture: 9384 image tokens), 20 steps, CFG.
Weights are shared between the engines (our fused Q/K/V tensors; diffusers' q/k/v Linears are views
into them), so two 20B models + a 60-block ControlNet fit in ~90 GiB. The text encoder is a random
1-layer Qwen2.5-VL of the real width (both engines use the same object; it is not what is measured).
`--smoke`: tiny configs on the CPU (checks the harness; times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from . import emit, versions
from .harness import GiB, _free, _sync

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def share_qkv(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Point diffusers' separate q/k/v Linears at row slices of our fused tensors (frees their copies)."""
    for mine, theirs in zip(ours.transformer_blocks, ref.transformer_blocks):
        for fused, names in (
            ("to_qkv", ("to_q", "to_k", "to_v")),
            ("add_qkv_proj", ("add_q_proj", "add_k_proj", "add_v_proj")),
        ):
            f = getattr(mine.attn, fused)
            for part, name in zip(zip(f.weight.chunk(3), f.bias.chunk(3)), names):
                lin = getattr(theirs.attn, name)
                lin.weight.data, lin.bias.data = part


def _pair(ref_model: torch.nn.Module, ours_cls, cfg, dtype):
    """Our model with diffusers' tensors (streamed in, Q/K/V fused, then shared back)."""
    from pathlib import Path

    from ..loading.weights import QKVFuser, load_streaming
    from ..models.transformer import fuse_qkv_key

    with torch.device("meta"):
        ours = ours_cls(cfg)
    items = ((k, v, Path("diffusers")) for k, v in ref_model.state_dict().items())
    load_streaming(ours, items, dtype=dtype, where="diffusers", convert=QKVFuser(fuse_qkv_key))
    share_qkv(ours, ref_model)
    return ours


def _on(dev, dtype, make):
    with torch.device(dev):
        torch.set_default_dtype(dtype)
        try:
            torch.manual_seed(0)
            return make().eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(torch.float32)


class Env:
    """Sizes and shared components (text encoder, tokenizer, VAEs, scheduler) of one benchmark run."""

    def __init__(self, smoke: bool):
        import diffusers
        from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from ..config import QWEN_IMAGE_SCHEDULER
        from ..pipeline.common import DEFAULT_MODEL
        from .pipeline import QWEN25_VL_7B

        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.size, self.steps, self.res = (64, 2, 64) if smoke else (1024, 20, 640)
        self.tcfg = (
            dict(
                num_layers=2,
                attention_head_dim=32,
                num_attention_heads=2,
                joint_attention_dim=64,
                axes_dims_rope=(8, 12, 12),
            )
            if smoke
            else {}
        )
        te_cfg = json.loads(json.dumps(QWEN25_VL_7B))
        te_cfg["text_config"]["num_hidden_layers"] = 1
        if smoke:
            te_cfg["text_config"].update(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=2048,
            )
            te_cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
            te_cfg["vision_config"].update(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                fullatt_block_indexes=[0],
            )
        self.te = _on(
            self.dev, self.dtype, lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**te_cfg))
        )
        self.tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL / "tokenizer"))
        sched = {k: v for k, v in vars(QWEN_IMAGE_SCHEDULER).items() if not k.startswith("_")}
        self.sched_cfg = QWEN_IMAGE_SCHEDULER
        self.ref_sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(sched)
        vae_kw = dict(base_dim=16, dim_mult=[1, 1, 1, 2], num_res_blocks=1) if smoke else {}
        self.vaes = {c: self._vae(c, vae_kw) for c in (3, 4)}

    def _vae(self, channels: int, kw: dict):
        import diffusers

        from ..config import VAEConfig
        from ..models.vae import QwenImageVAE, convert_vae_state_dict

        ref = _on(
            self.dev, self.dtype, lambda: diffusers.AutoencoderKLQwenImage(input_channels=channels, **kw)
        )
        ours = QwenImageVAE(VAEConfig.from_dict(dict(ref.config))).to(self.dev, self.dtype).eval()
        ours.load_state_dict(convert_vae_state_dict(ref.state_dict()), strict=True)
        return ref, ours.requires_grad_(False)

    def transformer(self, **flags):
        import diffusers

        from ..config import TransformerConfig
        from ..models.transformer import QwenImageTransformer

        ref = _on(self.dev, self.dtype, lambda: diffusers.QwenImageTransformer2DModel(**self.tcfg, **flags))
        return _pair(ref, QwenImageTransformer, TransformerConfig(**self.tcfg, **flags), self.dtype), ref

    def controlnet(self, layers: int | None, extra: int = 0):
        import diffusers

        from ..config import ControlNetConfig
        from ..models.controlnet import QwenImageControlNetModel

        kw = {**self.tcfg, "extra_condition_channels": extra}
        if layers is not None:
            kw["num_layers"] = layers
        ref = _on(self.dev, self.dtype, lambda: diffusers.QwenImageControlNetModel(**kw))
        with torch.no_grad():  # diffusers zero-initialises these: give them weights, or nothing is measured
            g = torch.Generator(self.dev).manual_seed(1)
            for lin in [*ref.controlnet_blocks, ref.controlnet_x_embedder]:
                lin.weight.normal_(0, 0.5 / lin.in_features**0.5, generator=g)
        return _pair(ref, QwenImageControlNetModel, ControlNetConfig(**kw), self.dtype), ref

    def picture(self, w: int, h: int, seed: int, mode: str = "RGB"):
        from PIL import Image

        yy, xx = np.mgrid[0:h, 0:w]
        rng = np.random.default_rng(seed)
        chans = [
            np.sin(xx / (7 + 5 * rng.random()) + yy / (11 + 3 * rng.random()) + k) for k in range(len(mode))
        ]
        return Image.fromarray((np.stack(chans, -1) * 127 + 128).astype(np.uint8), mode)


def _time(pipe, engine: str, call, warm) -> tuple[np.ndarray, dict]:
    warm()
    _free()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    out = call()
    _sync()
    row = {"total_s": round(time.perf_counter() - t0, 3)}
    if torch.cuda.is_available():
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    return out, row


def _row(name: str, ours, ref, kw: dict, steps: int, seed_global: bool = False, flat: bool = False) -> dict:
    """Warm-up + timed call per engine with the same arguments; mean |difference| of the images."""

    def run(p, n):
        if seed_global:
            torch.manual_seed(0)  # the inpainting ControlNet samples the masked latents from the global RNG
        out = p(
            generator=torch.Generator("cpu").manual_seed(0), num_inference_steps=n, output_type="np", **kw
        )
        return np.concatenate(out.images) if flat else out.images

    row, images = {"case": name}, {}
    for engine, p in (("diffusers", ref), ("qwenfast", ours)):
        images[engine], row[engine] = _time(p, engine, lambda p=p: run(p, steps), lambda p=p: run(p, 2))
        print(f"  {name:14s} {engine:10s} {json.dumps(row[engine])}", flush=True)
    row["speedup"] = round(row["diffusers"]["total_s"] / row["qwenfast"]["total_s"], 2)
    row["mean_abs_diff_images"] = float(f"{np.abs(images['diffusers'] - images['qwenfast']).mean():.3e}")
    row["finite"] = bool(np.isfinite(images["qwenfast"]).all())
    row["_ref_images"] = images["diffusers"]
    return row


def run(smoke: bool = False, out_dir=None) -> dict:
    import diffusers

    from ..models.text_encoder import TextEncoder
    from ..pipeline.controlnet import QwenImageControlNetInpaintPipeline, QwenImageControlNetPipeline
    from ..pipeline.layered import QwenImageLayeredPipeline

    env = Env(smoke)
    s, n = env.size, env.steps
    te = TextEncoder(env.te, env.tok)
    rows = []
    base = dict(prompt=PROMPT, negative_prompt=" ", true_cfg_scale=4.0, height=s, width=s)

    def cn_pipes(ours_tr, ref_tr, net, ref_net, cls, ref_cls, vae=3):
        ref_vae, vae_ours = env.vaes[vae]
        ours = cls(ours_tr, vae_ours, te, env.sched_cfg, controlnet=net, model_path="random full size")
        ours.set_progress_bar_config(disable=True)
        ref = ref_cls(
            scheduler=env.ref_sched,
            vae=ref_vae,
            text_encoder=env.te,
            tokenizer=env.tok,
            transformer=ref_tr,
            controlnet=ref_net,
        )
        ref.set_progress_bar_config(disable=True)
        return ours, ref

    tr, ref_tr = env.transformer()
    # a ControlNet of diffusers' default config (60 blocks at full size)
    net, ref_net = env.controlnet(None)
    ours, ref = cn_pipes(
        tr, ref_tr, net, ref_net, QwenImageControlNetPipeline, diffusers.QwenImageControlNetPipeline
    )
    kw = {**base, "control_image": env.picture(s, s, 1), "controlnet_conditioning_scale": 0.8}
    rows.append(_row("controlnet-60", ours, ref, kw, n))
    del (
        ref,
        ref_tr,
        ref_net,
    )  # diffusers' views keep our bf16 tensors alive: drop them before FP8 replaces ours
    _free()
    ours.configure(fp8=not smoke)  # FP8 for the transformer and the ControlNet (no FP8 GEMMs on the CPU)
    img, r = _time(
        ours,
        "qwenfast",
        lambda: (
            ours(
                generator=torch.Generator("cpu").manual_seed(0), num_inference_steps=n, output_type="np", **kw
            ).images
        ),
        lambda: ours(
            generator=torch.Generator("cpu").manual_seed(0), num_inference_steps=2, output_type="np", **kw
        ),
    )
    rows[-1]["qwenfast_fp8"] = {
        **r,
        "mean_abs_diff_vs_diffusers": float(f"{np.abs(img - rows[-1]['_ref_images']).mean():.3e}"),
    }
    print(f"  {'controlnet-60':14s} {'fp8':10s} {json.dumps(rows[-1]['qwenfast_fp8'])}", flush=True)
    del ours, net, img, tr
    _free()
    tr, ref_tr = env.transformer()  # fresh bf16 weights (FP8 replaced ours)
    # InstantX Union (5 blocks), two conditions through one net
    net, ref_net = env.controlnet(5)
    from ..models.controlnet import QwenImageMultiControlNetModel

    ours, ref = cn_pipes(
        tr,
        ref_tr,
        QwenImageMultiControlNetModel([net]),
        diffusers.QwenImageMultiControlNetModel([ref_net]),
        QwenImageControlNetPipeline,
        diffusers.QwenImageControlNetPipeline,
    )
    kw = {
        **base,
        "control_image": [env.picture(s, s, 2), env.picture(s, s, 3)],
        "controlnet_conditioning_scale": [0.6, 0.5],
        "control_guidance_end": [1.0, 0.6],
    }
    rows.append(_row("union-2cond", ours, ref, kw, n))
    del ours, ref, net, ref_net
    _free()
    # InstantX Inpainting (5 blocks, + mask channels)
    net, ref_net = env.controlnet(5, extra=4)
    ours, ref = cn_pipes(
        tr,
        ref_tr,
        net,
        ref_net,
        QwenImageControlNetInpaintPipeline,
        diffusers.QwenImageControlNetInpaintPipeline,
    )
    mask = np.zeros((s, s), np.uint8)
    mask[s // 4 : 3 * s // 4, s // 4 : 3 * s // 4] = 255
    from PIL import Image

    kw = {**base, "control_image": env.picture(s, s, 4), "control_mask": Image.fromarray(mask)}
    rows.append(_row("inpaint", ours, ref, kw, n, seed_global=True))
    del ours, ref, net, ref_net, tr, ref_tr
    _free()
    # Layered: its own transformer flags and the RGBA VAE
    tr, ref_tr = env.transformer(use_layer3d_rope=True, use_additional_t_cond=True)
    ref_vae, vae_ours = env.vaes[4]
    ours = QwenImageLayeredPipeline(tr, vae_ours, te, env.sched_cfg, model_path="random full size")
    ours.set_progress_bar_config(disable=True)
    ref = diffusers.QwenImageLayeredPipeline(
        scheduler=env.ref_sched,
        vae=ref_vae,
        text_encoder=env.te,
        tokenizer=env.tok,
        processor=None,
        transformer=ref_tr,
    )
    ref.set_progress_bar_config(disable=True)
    pic = env.picture(s, s * 3 // 4, 5, "RGBA")
    if smoke:  # diffusers takes the 640 / 1024 buckets only; the smoke run compares at 64
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as mod

        orig = mod.calculate_dimensions
        mod.calculate_dimensions = lambda area, ratio: orig(64 * 64, ratio)
    kw = dict(image=pic, prompt=PROMPT, negative_prompt=" ", true_cfg_scale=4.0, layers=4, cfg_normalize=True)
    ours_kw = {**kw, "resolution": env.res}

    class _Ours:  # the same call with our resolution argument
        def __call__(self, **k):
            return ours(**{**k, **ours_kw})

    rows.append(_row("layered", _Ours(), ref, {**kw, "resolution": 640}, n, flat=True))
    record = {
        "bench": "tasks_control",
        **versions(),
        "smoke": smoke,
        "steps": n,
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    print("\ncase            diffusers_s  qwenfast_s  speedup  mean|Δ|")
    for r in record["rows"]:
        print(
            f"{r['case']:15s} {r['diffusers']['total_s']:11.2f} {r['qwenfast']['total_s']:11.2f} "
            f"{r['speedup']:8.2f}  {r['mean_abs_diff_images']:.2e}"
        )
    emit(record, "tasks.jsonl", out_dir)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny configs on the CPU")
    p.add_argument("--results", default=None, metavar="DIR", help="append the JSON record to DIR/tasks.jsonl")
    a = p.parse_args(argv)
    run(smoke=a.smoke, out_dir=a.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
