"""qwenfast's transformer is the same function as diffusers' QwenImageTransformer2DModel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwenfast.config import TransformerConfig
from qwenfast.loading.weights import QKVFuser, load_streaming
from qwenfast.models.transformer import QwenImageTransformer, fuse_qkv_key, split_qkv_key

from .conftest import rel_err

diffusers = pytest.importorskip("diffusers")


def _pair(zero_cond_t=False, seed=0, layers=2):
    from qwenfast.testing.tiny import build_transformer

    ref = build_transformer(48, seed=seed, num_layers=layers, zero_cond_t=zero_cond_t).eval()
    cfg = TransformerConfig.from_dict(dict(ref.config))
    with torch.device("meta"):
        ours = QwenImageTransformer(cfg)
    items = ((k, v.clone(), Path("mem")) for k, v in ref.state_dict().items())
    load_streaming(ours, items, dtype=torch.float32, where="test", convert=QKVFuser(fuse_qkv_key))
    return ref, ours


def _inputs(B, shapes, txt_len, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    L = sum(f * h * w for f, h, w in shapes)
    x = torch.randn(B, L, 64, generator=g).to(dtype)
    txt = torch.randn(B, txt_len, 48, generator=g).to(dtype)
    t = torch.rand(B, generator=g)
    return x, txt, t


def _run_ref(ref, x, txt, mask, t, shapes):
    with torch.no_grad():
        return ref(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=t,
                   img_shapes=[shapes] * x.shape[0], return_dict=False)[0]  # fmt: skip


@pytest.mark.parametrize("shapes", [[(1, 3, 5)], [(1, 4, 4)], [(1, 7, 2)]])
def test_forward_matches_diffusers_fp32(shapes):
    ref, ours = _pair()
    x, txt, t = _inputs(2, shapes, 9)
    a = _run_ref(ref, x, txt, None, t, shapes)
    with torch.no_grad():
        b = ours(x, txt, None, t, shapes)
    assert a.shape == b.shape == (2, x.shape[1], 64)
    assert rel_err(a, b) < 1e-5


def test_padded_text_mask_batch2():
    ref, ours = _pair()
    shapes = [(1, 3, 5)]
    x, txt, t = _inputs(2, shapes, 11)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    a = _run_ref(ref, x, txt, mask, t, shapes)
    with torch.no_grad():
        b = ours(x, txt, mask, t, shapes)
        unmasked = ours(x, txt, None, t, shapes)
    assert rel_err(a, b) < 1e-5
    # the mask matters for the padded sample only (so the test would catch a mask that is ignored)
    assert rel_err(b[0], unmasked[0]) < 1e-6
    assert rel_err(b[1], unmasked[1]) > 1e-3


def test_zero_cond_t_with_reference_images():
    """Edit-2511: tokens after the first image are modulated with t=0."""
    ref, ours = _pair(zero_cond_t=True)
    shapes = [(1, 3, 4), (1, 2, 3), (1, 4, 2)]
    x, txt, t = _inputs(2, shapes, 7)
    a = _run_ref(ref, x, txt, None, t, shapes)
    with torch.no_grad():
        b = ours(x, txt, None, t, shapes)
    assert rel_err(a, b) < 1e-5


def test_layered_config_layer3d_rope_and_additional_t_cond():
    """Qwen-Image-Layered: condition image at frame -1, plus a learned additional timestep embedding."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(5)
    ref = QwenImageTransformer2DModel(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                                      axes_dims_rope=(8, 12, 12), use_layer3d_rope=True,
                                      use_additional_t_cond=True).eval()  # fmt: skip
    cfg = TransformerConfig.from_dict(dict(ref.config))
    with torch.device("meta"):
        ours = QwenImageTransformer(cfg)
    items = ((k, v.clone(), Path("mem")) for k, v in ref.state_dict().items())
    load_streaming(ours, items, dtype=torch.float32, where="test", convert=QKVFuser(fuse_qkv_key))
    shapes = [(1, 3, 4), (1, 3, 4), (1, 3, 4)]
    x, txt, t = _inputs(2, shapes, 5)
    cond = torch.tensor([0, 1])
    with torch.no_grad():
        a = ref(hidden_states=x, encoder_hidden_states=txt, timestep=t, img_shapes=[shapes] * 2,
                additional_t_cond=cond, return_dict=False)[0]  # fmt: skip
        b = ours(x, txt, None, t, shapes, additional_t_cond=cond)
    assert rel_err(a, b) < 1e-5


def test_bf16_matches_diffusers_bf16():
    """bf16 is where precision choices show (e.g. the timestep sinusoid's dtype)."""
    ref, ours = _pair(seed=3)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    shapes = [(1, 4, 6)]
    x, txt, t = _inputs(2, shapes, 8, dtype=torch.bfloat16)
    a = _run_ref(ref, x, txt, None, t, shapes)
    with torch.no_grad():
        b = ours(x, txt, None, t, shapes)
    assert b.dtype == torch.bfloat16
    assert rel_err(a, b) < 5e-3


def test_fused_qkv_keys_round_trip():
    assert fuse_qkv_key("transformer_blocks.3.attn.to_k.weight") == ("transformer_blocks.3.attn.to_qkv.weight", 1)
    assert fuse_qkv_key("transformer_blocks.0.attn.add_v_proj.bias") == ("transformer_blocks.0.attn.add_qkv_proj.bias", 2)
    assert fuse_qkv_key("transformer_blocks.0.attn.to_out.0.weight") is None
    assert split_qkv_key("transformer_blocks.1.attn.to_qkv.weight") == [
        "transformer_blocks.1.attn.to_q.weight", "transformer_blocks.1.attn.to_k.weight",
        "transformer_blocks.1.attn.to_v.weight"]  # fmt: skip


def test_config_rejects_unsupported_fields():
    from qwenfast.config import ConfigError

    with pytest.raises(ConfigError, match="axes_dims_rope"):
        TransformerConfig(attention_head_dim=32, axes_dims_rope=(8, 8, 8))
    with pytest.raises(ConfigError, match="guidance_embeds"):
        TransformerConfig.from_dict({"guidance_embeds": True})
    with pytest.raises(ConfigError, match="unknown config fields"):
        TransformerConfig.from_dict({"num_layers": 2, "foo": 1})


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_fused_path_equals_reference_path(zero_cond_t):
    """The fused-kernel forward (here through the kernels' torch references) == the plain forward,
    and both match diffusers: a CPU smoke test of the `fused` flag."""
    ref, ours = _pair(zero_cond_t=zero_cond_t, seed=4)
    shapes = [(1, 3, 5)] + ([(1, 2, 2)] if zero_cond_t else [])
    x, txt, t = _inputs(2, shapes, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 4:] = 0
    with torch.no_grad():
        ours.fused = True
        a = ours(x, txt, mask, t, shapes)
        ours.fused = False
        b = ours(x, txt, mask, t, shapes)
    assert rel_err(b, a) < 1e-5
    assert rel_err(_run_ref(ref, x, txt, mask, t, shapes), a) < 1e-5
