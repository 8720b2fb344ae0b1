"""LoRA on Qwen-Image-2.1 against diffusers' `QwenImage21Pipeline.load_lora_weights` (+ `fuse_lora`),
pixel by pixel on a tiny random 2.1 pipeline (fp32, CPU).

2.1 LoRAs name diffusers' modules: `attn.to_q/to_k/to_v/to_out.0`, `img_mlp.gate_layer/proj/out`, and
the shared ones (`img_in`, `txt_in.*`, `modulation.1`, `norm_out.linear`, `proj_out`, the timestep
MLP). We fuse Q|K|V into `attn.to_qkv` (thirds) and gate|up into `img_mlp.gate_up` (halves, gate
first, ComfyUI's layout) and call `norm_out.linear` `norm_out_linear`: every naming must land on the
right rows. The same LoRA is written as diffusers/PEFT, kohya-flattened, ComfyUI (`diffusion_model.`)
and ComfyUI on the fused projections; all must give diffusers' pixels.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

TOL = 1e-3
KW = {"prompt": "a red circle on the left of a blue square", "output_resolution": 128, "num_inference_steps": 3,
      "output_type": "np"}  # fmt: skip


def gen():
    return torch.Generator().manual_seed(3)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    import qwenfast
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("lora21") / "tiny21"
    ref = build_tiny21_pipeline(path, seed=0)
    qf = qwenfast.from_pretrained(path, device="cpu", dtype=torch.float32)
    qf.progress_bar = False
    return ref, copy.deepcopy(ref.transformer.state_dict()), qf


def make_lora(model, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """diffusers module name -> (down (r, in), up (out, r), alpha) for every Linear."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            down = torch.randn(4, m.in_features, generator=g) / m.in_features**0.5
            out[n] = (down, torch.randn(m.out_features, 4, generator=g) * 0.15, 3.0)
    return out


def write(lora, naming: str) -> dict[str, torch.Tensor]:
    sd = {}
    for n, (down, up, alpha) in lora.items():
        if naming == "diffusers":
            sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = down, up * (alpha / 4)
            continue
        stem = {"kohya": "lora_unet_" + n.replace(".", "_"), "comfyui": f"diffusion_model.{n}",
                "comfyui-fused": f"diffusion_model.{n}"}[naming]  # fmt: skip
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down, up
        sd[f"{stem}.alpha"] = torch.tensor(alpha)
    if naming == "comfyui-fused":  # Q|K|V and gate|up as ONE LoRA on each fused projection
        blocks = sorted({k.split(".attn.")[0] for k in sd if ".attn." in k})
        for blk in blocks:
            for fused, parts in (("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                                 ("img_mlp.gate_up", ("img_mlp.gate_layer", "img_mlp.proj"))):  # fmt: skip
                stems = [f"{blk}.{p}" for p in parts]
                downs = [sd.pop(f"{s}.lora_down.weight") for s in stems]
                ups = [sd.pop(f"{s}.lora_up.weight") for s in stems]
                for s in stems:
                    sd.pop(f"{s}.alpha")
                sd[f"{blk}.{fused}.lora_down.weight"] = torch.cat(downs)
                sd[f"{blk}.{fused}.lora_up.weight"] = torch.block_diag(*ups)
                sd[f"{blk}.{fused}.alpha"] = torch.tensor(3.0 * len(parts))  # alpha / rank stays 3/4
    return sd


@pytest.fixture(scope="module")
def reference(pipes):
    ref, orig, _ = pipes
    lora = make_lora(ref.transformer, seed=1)
    base = ref(**KW, generator=gen()).images
    try:
        ref.load_lora_weights(write(lora, "diffusers"), adapter_name="a")
        ref.fuse_lora(lora_scale=0.7)
        with_lora = ref(**KW, generator=gen()).images
    finally:
        ref.unload_lora_weights()
        ref.transformer.load_state_dict(orig)
    return lora, base, with_lora


@pytest.mark.parametrize("naming", ["diffusers", "kohya", "comfyui", "comfyui-fused"])
def test_lora21_namings_match_diffusers(pipes, reference, naming):
    _, _, qf = pipes
    lora, base, theirs = reference
    snap = {k: v.clone() for k, v in qf.transformer.state_dict().items()}
    name = qf.load_lora(write(lora, naming), strength=0.7)
    try:
        assert qf.loras == {name: 0.7}
        ours = qf(**KW, generator=gen()).images
    finally:
        qf.unload_lora()
    assert np.abs(theirs - base).max() > 10 * TOL  # the LoRA really changes diffusers' picture
    assert np.abs(ours - theirs).max() <= TOL
    assert all(torch.equal(v, snap[k]) for k, v in qf.transformer.state_dict().items())  # unloaded bitwise


def test_lora21_for_another_model_is_refused(pipes):
    from qwenfast.errors import LoraError

    _, _, qf = pipes
    bad = {"transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight": torch.zeros(4, 64),
           "transformer.transformer_blocks.0.attn.add_q_proj.lora_B.weight": torch.zeros(64, 4)}  # fmt: skip
    with pytest.raises(LoraError, match="layers this model does not have"):
        qf.load_lora(bad)
