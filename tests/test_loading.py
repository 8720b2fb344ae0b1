"""Loading the real diffusers layout, and clear errors for broken folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenfast import QwenImagePipeline
from qwenfast.loading.diffusers_folder import inspect_folder, load_transformer
from qwenfast.loading.weights import CheckpointError

from .conftest import rel_err


@pytest.fixture
def broken(tiny_t2i, tmp_path):
    """A fresh copy of the saved tiny model to damage."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_t2i[1], dst)
    return dst


def test_sharded_layout_is_used_and_loaded(tiny_t2i):
    ref, path = tiny_t2i
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    model = load_transformer(path / "transformer", "cpu", torch.float32)
    sd = ref.transformer.state_dict()
    blk = model.transformer_blocks[1].attn
    fused = torch.cat([sd[f"transformer_blocks.1.attn.to_{c}.weight"] for c in "qkv"])
    assert torch.equal(blk.to_qkv.weight, fused)
    assert torch.equal(model.proj_out.bias, sd["proj_out.bias"])
    assert not any(p.is_meta for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())


def test_dtype_cast_at_load(tiny_t2i):
    m = load_transformer(tiny_t2i[1] / "transformer", "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


def test_complete_folder_inspects_clean(tiny_t2i):
    assert inspect_folder(tiny_t2i[1]) == ("text-to-image", [])


def test_missing_shard_names_it(broken):
    shard = sorted((broken / "transformer").glob("*-of-*.safetensors"))[0]
    shard.unlink()
    kind, problems = inspect_folder(broken)
    assert any(shard.name in p for p in problems)
    with pytest.raises(CheckpointError, match=shard.name):
        QwenImagePipeline.from_pretrained(broken, device="cpu")


def test_missing_component_folder(broken):
    shutil.rmtree(broken / "vae")
    with pytest.raises(CheckpointError, match="missing folder vae/"):
        QwenImagePipeline.from_pretrained(broken, device="cpu")


def test_not_a_model_folder(tmp_path):
    with pytest.raises(CheckpointError, match="model_index.json"):
        QwenImagePipeline.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(CheckpointError, match="not a folder"):
        QwenImagePipeline.from_pretrained(tmp_path / "nope", device="cpu")


def test_wrong_pipeline_class(broken):
    idx = json.loads((broken / "model_index.json").read_text())
    idx["_class_name"] = "StableDiffusionPipeline"
    (broken / "model_index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="not a Qwen-Image pipeline"):
        QwenImagePipeline.from_pretrained(broken, device="cpu")


def _vae_file_with(folder, key):
    for f in sorted((folder / "vae").glob("*.safetensors")):
        if key in load_file(f):
            return f
    raise AssertionError(key)


def test_corrupt_safetensors_file(broken):
    f = _vae_file_with(broken, "decoder.conv_out.bias")
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{f.name}: cannot read"):
        QwenImagePipeline.from_pretrained(broken, device="cpu")


def test_corrupt_config_json(broken):
    (broken / "transformer" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="transformer/config.json: not valid JSON"):
        QwenImagePipeline.from_pretrained(broken, device="cpu")


def test_missing_and_unexpected_keys_are_listed(broken):
    f = _vae_file_with(broken, "decoder.conv_out.bias")
    sd = load_file(f)
    sd.pop("decoder.conv_out.bias")
    sd["decoder.extra.weight"] = torch.zeros(2)
    save_file(sd, f)
    with pytest.raises(CheckpointError) as e:
        QwenImagePipeline.from_pretrained(broken, device="cpu")
    msg = str(e.value)
    assert "missing keys: decoder.conv_out.bias" in msg and "decoder.extra.weight" in msg


def test_shape_mismatch_is_reported(broken):
    cfg = json.loads((broken / "transformer" / "config.json").read_text())
    cfg["num_attention_heads"] = 4
    cfg["attention_head_dim"] = 16
    cfg["axes_dims_rope"] = [4, 6, 6]
    (broken / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatches"):
        load_transformer(broken / "transformer", "cpu", torch.float32)


def test_vae_loaded_equals_diffusers(tiny_t2i, qf_t2i):
    ref, _ = tiny_t2i
    z = torch.randn(1, 16, 5, 7)
    with torch.no_grad():
        a = ref.vae.decode(z[:, :, None]).sample[:, :, 0]
        b = qf_t2i.vae.decode(z)
    assert rel_err(a, b) < 1e-5
