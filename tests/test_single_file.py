"""Single-file (ComfyUI) and FP8 checkpoints.

Every layout and FP8 format is written here from the tiny random diffusers model, then loaded by
qwenfast: bf16/fp32 layouts must give bitwise the weights of the diffusers-folder load, FP8 files the
dequantisation formula, `from_single_files` diffusers' pixels, and broken or foreign files a clear
`CheckpointError` naming what was found.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenfast import QwenImagePipeline
from qwenfast.cli import main
from qwenfast.config import QWEN_IMAGE, QWEN_IMAGE_EDIT_2511, VAEConfig
from qwenfast.loading import fp8 as F
from qwenfast.loading import single_file as S
from qwenfast.loading import wan_vae_keys as WK
from qwenfast.loading import weights as W
from qwenfast.loading.diffusers_folder import load_transformer, load_vae
from qwenfast.loading.weights import CheckpointError
from qwenfast.models.text_encoder import TextEncoder
from qwenfast.models.transformer import QwenImageTransformer, split_qkv_key

E4M3 = torch.float8_e4m3fn
AXES = {
    "axes_dims_rope": (8, 12, 12)
}  # the tiny model's RoPE axes (not stored in weights; 128-dim heads are)


def _sd(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def tiny(tiny_t2i, tmp_path_factory):
    """diffusers pipeline, its folder, a scratch folder and the diffusers-named fp32 state dicts."""
    ref, path = tiny_t2i
    te = {k: v for k, v in _sd(ref.text_encoder).items()}  # transformers 5 names
    return ref, path, tmp_path_factory.mktemp("single"), _sd(ref.transformer), _sd(ref.vae), te


def _legacy_te(sd):
    """transformers 5 names -> ComfyUI / transformers 4 names (`model.*`, `visual.*`)."""
    out = {}
    for k, v in sd.items():
        k = k.replace("model.language_model.", "model.", 1) if k.startswith("model.language_model.") else k
        out[k.replace("model.visual.", "visual.", 1) if k.startswith("model.visual.") else k] = v
    return out


def _ours(model, sd: dict) -> dict[str, torch.Tensor]:
    """A diffusers-keyed state dict in our layout (Q/K/V fused) for every key of `model`."""
    return {
        k: torch.cat([sd[p] for p in split_qkv_key(k)]) if split_qkv_key(k) else sd[k]
        for k in model.state_dict()
    }


def _assert_same(model, expected: dict, dtype=torch.float32):
    got = model.state_dict()
    assert set(got) == set(expected)
    for k, v in got.items():
        assert v.dtype == dtype and torch.equal(v, expected[k].to(dtype)), k


def _save(folder, name, tensors, metadata=None):
    p = folder / name
    save_file(tensors, str(p), metadata=metadata)
    return p


# ---------------------------------------------------------------------------------------------- transformer


def _layout(sd, kind):
    if kind == "fused-add-qkv":  # text-stream Q/K/V concatenated, as some ComfyUI files store them
        out = dict(sd)
        for k in [k for k in sd if ".attn.add_q_proj." in k]:
            parts = [k.replace("add_q_proj", f"add_{c}_proj") for c in "qkv"]
            out[k.replace("add_q_proj", "add_qkv_proj")] = torch.cat([out.pop(p) for p in parts])
        return out
    if kind == "2511-marker":
        return {**sd, "__index_timestep_zero__": torch.zeros(1)}
    if kind == "bf16":
        return {k: v.to(torch.bfloat16) for k, v in sd.items()}
    return {kind + k: v for k, v in sd.items()}  # a prefix ("" = bare)


@pytest.mark.parametrize(
    "kind", ["", "model.diffusion_model.", "diffusion_model.", "fused-add-qkv", "2511-marker", "bf16"]
)
def test_transformer_layouts_load_the_folder_weights(tiny, kind):
    ref, path, tmp, sd, _, _ = tiny
    f = _save(tmp, f"tr-{kind or 'bare'}.safetensors", _layout(sd, kind))
    model = S.load_transformer_file(f, "cpu", torch.float32, config=AXES)
    folder = load_transformer(path / "transformer", "cpu", torch.float32)
    expected = (
        folder.state_dict() if kind != "bf16" else {k: v.bfloat16() for k, v in folder.state_dict().items()}
    )
    _assert_same(model, expected)
    assert model.cfg == (
        dataclasses.replace(folder.cfg, zero_cond_t=True) if kind == "2511-marker" else folder.cfg
    )


def test_transformer_config_inferred_for_full_size():
    """60 layers, 3072 wide, 128-dim heads, joint dim 3584: the shapes alone give Qwen-Image's config."""
    with torch.device("meta"):
        model = QwenImageTransformer(QWEN_IMAGE)
    fused = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert (
        S._make_config(type(QWEN_IMAGE), S.infer_transformer_config(fused), None, "transformer", "")
        == QWEN_IMAGE
    )
    fused["__index_timestep_zero__"] = (1,)
    assert (
        S._make_config(type(QWEN_IMAGE), S.infer_transformer_config(fused), None, "t", "")
        == QWEN_IMAGE_EDIT_2511
    )


def test_transformer_nonstandard_head_dim_needs_rope_axes(tiny):
    _, _, tmp, sd, _, _ = tiny
    f = _save(tmp, "tr-noaxes.safetensors", sd)
    with pytest.raises(CheckpointError, match=r"axes_dims_rope.*cannot be read from the weights"):
        S.inspect_transformer(f)


# ---------------------------------------------------------------------------------------------- FP8


def _scale(w: torch.Tensor) -> torch.Tensor:
    return (w.abs().amax().float() / 448.0).reshape(())  # 0-dim fp32, as ComfyUI stores it


def write_fp8(folder, sd, style, prefix=""):
    """Quantise every 2D `.weight` of `sd` in a ComfyUI format; -> (path, expected fp32 weights, diffusers-keyed).

    style: cast | cast-e5m2 | scaled_fp8 | comfy_quant | metadata | mixed (every other layer FP8 + comfy_quant, others bf16).
    """
    out, expected, layers = {}, {}, {}
    quantised = [k for k in sorted(sd) if k.endswith(".weight") and sd[k].ndim == 2]
    for k, v in sd.items():
        key, layer = prefix + k, prefix + k[: -len(".weight")]
        if k not in quantised or (style == "mixed" and quantised.index(k) % 2):
            out[key] = v.bfloat16() if style == "mixed" else v
            expected[k] = out[key].float()
            continue
        if style.startswith("cast"):
            out[key] = v.to(torch.float8_e5m2 if style == "cast-e5m2" else E4M3)
            expected[k] = out[key].float()
            continue
        s = _scale(v)
        if style == "comfy_quant" and quantised.index(k) == 0:  # one per-row scale, shape (out,)
            s = v.abs().amax(dim=1).float() / 448.0
        w = (v / (s if s.ndim == 0 else s[:, None])).to(E4M3)
        out[key] = w
        expected[k] = w.float() * (s if s.ndim == 0 else s[:, None])
        if style == "scaled_fp8":
            out[layer + ".scale_weight"] = s
            out[layer + ".scale_input"] = torch.tensor(1.0)
        else:
            out[layer + ".weight_scale"] = s
            out[layer + ".input_scale"] = torch.tensor(0.5)
            layers[layer] = {"format": "float8_e4m3fn"}
            if style in ("comfy_quant", "mixed"):
                out[layer + ".comfy_quant"] = torch.tensor(
                    list(json.dumps(layers[layer]).encode()), dtype=torch.uint8
                )
    if style == "scaled_fp8":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=E4M3)
    meta = (
        {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
        if style == "metadata"
        else None
    )
    return _save(folder, f"fp8-{style}-{len(prefix)}.safetensors", out, meta), expected


FP8_STYLES = {"cast": "fp8 cast", "cast-e5m2": "fp8 cast", "scaled_fp8": "legacy scaled_fp8", "comfy_quant": "comfy_quant",
              "metadata": "_quantization_metadata", "mixed": "comfy_quant"}  # fmt: skip


@pytest.mark.parametrize("style", list(FP8_STYLES))
def test_fp8_transformer_equals_dequant_formula(tiny, style):
    _, _, tmp, sd, _, _ = tiny
    prefix = "model.diffusion_model." if style in ("scaled_fp8", "metadata") else ""
    f, expected = write_fp8(tmp, sd, style, prefix)
    src, _ = S.inspect_transformer(f, AXES)
    assert FP8_STYLES[style] in src.quant.kind
    model = S.load_transformer_file(f, "cpu", torch.float32, config=AXES)
    _assert_same(model, _ours(model, expected))


def test_fp8_to_bf16_is_comfyui_formula(tiny):
    """bf16 compute dtype: w.to(bf16) * scale (ComfyUI's dequant; torch evaluates it in fp32 then rounds once)."""
    _, _, tmp, sd, _, _ = tiny
    f, _ = write_fp8(tmp, sd, "scaled_fp8")
    raw = load_file(f)
    model = S.load_transformer_file(f, "cpu", torch.bfloat16, config=AXES)
    expected = {}
    for k in sd:
        w = raw[k]  # stored tensor: fp8 or fp32
        s = raw.get(k[: -len(".weight")] + ".scale_weight")
        expected[k] = w.to(torch.bfloat16) * s if s is not None else w.to(torch.bfloat16)
    _assert_same(model, _ours(model, expected), torch.bfloat16)


def test_fp8_pixels_match_diffusers_with_the_same_dequantised_weights(tiny):
    """An FP8 transformer gives the image diffusers gives with those dequantised weights (fp32)."""
    import diffusers

    ref, path, tmp, sd, _, _ = tiny
    f, expected = write_fp8(tmp, sd, "comfy_quant")
    t2 = copy.deepcopy(ref.transformer)
    t2.load_state_dict(expected)
    ref2 = diffusers.QwenImagePipeline(**{**ref.components, "transformer": t2})
    ref2.set_progress_bar_config(disable=True)
    pipe = QwenImagePipeline.from_single_files(f, path / "vae", path / "text_encoder", path / "tokenizer", device="cpu",
                                               dtype=torch.float32, transformer_config=AXES)  # fmt: skip
    pipe.progress_bar = False
    kw = dict(
        prompt="a red circle",
        height=32,
        width=48,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        output_type="np",
    )
    a = ref2(**kw, generator=torch.Generator().manual_seed(3)).images
    b = pipe(**kw, generator=torch.Generator().manual_seed(3)).images
    assert np.abs(a - b).max() <= 1e-3


def test_chunked_staged_read_equals_direct_read(tiny):
    """The GPU path reads through a small reused buffer in chunks; here on CPU with a 7-byte buffer."""
    _, _, tmp, sd, _, _ = tiny
    f, _ = write_fp8(tmp, sd, "mixed")
    header = F.read_header(f)
    with open(f, "rb") as fh:
        for key in ["img_in.weight", "img_in.weight_scale", "proj_out.bias", "txt_norm.weight"]:
            direct = F.read_tensor(fh, header, key)
            staged = F.read_tensor(fh, header, key, "cpu", torch.empty(7, dtype=torch.uint8))
            assert staged.dtype == direct.dtype and torch.equal(
                staged.reshape(-1).view(torch.uint8), direct.reshape(-1).view(torch.uint8)
            )


def _measure_fp8_load(path: str) -> dict:
    """Load an FP8 transformer file to fp32 on CPU and watch memory (run in a fresh process, see below).

    (1) counting: at every read from the file, how many tensors read earlier are still alive outside
    the model (Q/K/V pieces waiting for their group may be); (2) bytes: resident memory (VmRSS: anonymous
    and file-backed, so a memory-mapped file would show) above the start
    minus the model tensors assigned so far, sampled at every read, dequantisation and assignment.
    """

    def rss() -> int:
        with open("/proc/self/status") as fh:
            return int(re.search(r"VmRSS:\s+(\d+) kB", fh.read()).group(1)) * 1024

    st = {"assigned": 0, "ptrs": set(), "reads": [], "peak": 0, "max_alive": 0, "largest": 0}
    real_set, real_read, real_deq = W._set_tensor, F.read_tensor, F.dequantize

    def sample():
        st["peak"] = max(st["peak"], rss() - base - st["assigned"])

    def set_tensor(module, name, value):
        real_set(module, name, value)
        nbytes = value.numel() * value.element_size()
        st["assigned"] += nbytes
        st["largest"] = max(st["largest"], nbytes)
        st["ptrs"].add(value.data_ptr())
        sample()

    def dequantize(*a):
        out = real_deq(*a)
        sample()  # the stored FP8 tensor and its dequantised copy are both alive here
        return out

    def read_tensor(*a):
        alive = [t for t in (r() for r in st["reads"]) if t is not None and t.numel() > 1]
        st["max_alive"] = max(st["max_alive"], sum(t.data_ptr() not in st["ptrs"] for t in alive))
        t = real_read(*a)
        st["reads"].append(weakref.ref(t))
        sample()
        return t

    S.load_transformer_file(path, "cpu", torch.float32)  # warm-up: lazy imports, libraries mapped; then freed
    W._set_tensor, F.read_tensor, F.dequantize = set_tensor, read_tensor, dequantize
    base = rss()
    model = S.load_transformer_file(path, "cpu", torch.float32)
    st["model"] = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    st["layers"] = model.cfg.num_layers
    return {k: v for k, v in st.items() if k not in ("ptrs", "reads")}


def test_fp8_streams_one_tensor_at_a_time(tiny, capsys):
    """Peak host memory while loading an FP8 file stays near one tensor, not the model.

    A 2-layer, 384-wide transformer (128-dim heads, so its config is fully inferred) in legacy scaled
    FP8 is loaded to fp32 on CPU in a fresh process with glibc's mmap threshold fixed at 64 KiB, so
    that freed tensors go back to the OS and RSS follows the live allocations.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    import diffusers

    _, _, tmp, _, _, _ = tiny
    with torch.device("meta"):
        meta = diffusers.QwenImageTransformer2DModel(num_layers=2, attention_head_dim=128, num_attention_heads=3,
                                                     joint_attention_dim=256, axes_dims_rope=(16, 56, 56))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    f, _ = write_fp8(tmp, {k: torch.randn(v.shape, generator=g) * 0.02 for k, v in meta.state_dict().items()},
                     "scaled_fp8")  # fmt: skip
    code = "import json, sys; from tests.test_single_file import _measure_fp8_load as m; print(json.dumps(m(sys.argv[1])))"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(
        [sys.executable, "-c", code, str(f)], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    st = json.loads(run.stdout.strip().splitlines()[-1])
    assert st["layers"] == 2 and st["assigned"] == st["model"]
    assert st["max_alive"] <= 2  # only to_q/to_k (or add_q/add_k) waiting for their third piece
    assert (
        st["largest"] * 8 < st["model"] and st["peak"] < 2 * st["largest"] + 2**20
    )  # ~ one tensor, not the model
    mib = 2**20
    with capsys.disabled():
        print(f"\n[fp8 streaming] {st['model'] / mib:.0f} MiB fp32 model from a {f.stat().st_size / mib:.0f} MiB fp8 "
              f"file: peak host memory above the model {st['peak'] / mib:.1f} MiB (largest tensor "
              f"{st['largest'] / mib:.1f} MiB); stored tensors alive outside the model at once <= {st['max_alive']}")  # fmt: skip


# ---------------------------------------------------------------------------------------------- VAE


def test_vae_wan_and_diffusers_names_load_the_folder_weights(tiny):
    ref, path, tmp, _, vsd, _ = tiny
    wan_names = WK.diffusers_to_wan_vae_keys(list(vsd))
    back, unknown = WK.wan_to_diffusers_vae_keys(list(wan_names.values()))
    assert not unknown and all(back[wan_names[k]] == k for k in vsd)  # both directions round-trip
    assert wan_names["decoder.mid_block.resnets.0.norm1.gamma"] == "decoder.middle.0.residual.0.gamma"
    assert wan_names["decoder.conv_in.weight"] == "decoder.conv1.weight"
    assert (
        wan_names["post_quant_conv.bias"] == "conv2.bias"
        and wan_names["decoder.norm_out.gamma"] == "decoder.head.0.gamma"
    )
    folder = load_vae(path / "vae", "cpu", torch.float32)
    for name, tensors in [("wan", {wan_names[k]: v for k, v in vsd.items()}), ("diffusers", vsd),
                          ("wan-prefixed", {"first_stage_model." + wan_names[k]: v for k, v in vsd.items()})]:  # fmt: skip
        f = _save(tmp, f"vae-{name}.safetensors", tensors)
        model = S.load_vae_file(f, "cpu", torch.float32, config=path / "vae")
        _assert_same(model, folder.state_dict())
        assert model.cfg == folder.cfg
        inferred = S.inspect_vae(f)[1]  # no config: structure from shapes, Qwen-Image's latents_mean/std
        assert (inferred.base_dim, inferred.dim_mult, inferred.num_res_blocks, inferred.temperal_downsample) == (
            folder.cfg.base_dim, folder.cfg.dim_mult, folder.cfg.num_res_blocks, folder.cfg.temperal_downsample)  # fmt: skip


def test_wan_map_matches_diffusers_converter():
    """Full-size VAE: our diffusers->Wan names, fed to diffusers' own convert_wan_vae_to_diffusers, come back."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    with torch.device("meta"):
        vae = AutoencoderKLQwenImage()
    keys = list(vae.state_dict())
    wan = WK.diffusers_to_wan_vae_keys(keys)
    assert set(convert_wan_vae_to_diffusers({w: 0 for w in wan.values()})) == set(keys)
    # spot checks from musubi-tuner's convert_comfyui_state_dict table
    assert wan["decoder.up_blocks.1.resnets.0.conv_shortcut.weight"] == "decoder.upsamples.4.shortcut.weight"
    assert (
        wan["decoder.up_blocks.2.upsamplers.0.resample.1.weight"] == "decoder.upsamples.11.resample.1.weight"
    )
    assert wan["encoder.down_blocks.5.time_conv.weight"] == "encoder.downsamples.5.time_conv.weight"
    cfg = S.infer_vae_config({k: tuple(v.shape) for k, v in vae.state_dict().items()})
    assert S._make_config(VAEConfig, cfg, None, "vae", "") == VAEConfig()  # = Qwen-Image's VAE


# ---------------------------------------------------------------------------------------------- text encoder


@pytest.fixture(scope="module")
def te_ref(tiny):
    _, path, *_ = tiny
    return TextEncoder.from_pretrained(path / "text_encoder", path / "tokenizer", "cpu", torch.float32)


@pytest.mark.parametrize("naming", ["comfyui", "transformers5", "no-lm-head", "fp8-scaled"])
def test_text_encoder_file_matches_from_pretrained(tiny, te_ref, naming):
    _, path, tmp, _, _, tsd = tiny
    sd = _legacy_te(tsd) if naming != "transformers5" else dict(tsd)
    expected = dict(tsd)
    if naming == "no-lm-head":
        del sd["lm_head.weight"]
        expected["lm_head.weight"] = tsd["model.language_model.embed_tokens.weight"]
    if naming == "fp8-scaled":
        f, exp = write_fp8(tmp, sd, "scaled_fp8")
        expected = {k: exp[_legacy_te({k: 0}).popitem()[0]] for k in tsd}
    else:
        f = _save(tmp, f"te-{naming}.safetensors", sd)
    te = S.load_text_encoder_file(f, path / "tokenizer", "cpu", torch.float32, config=path / "text_encoder")
    _assert_same(te.model, expected)
    got, want = dict(te.model.named_buffers()), dict(te_ref.model.named_buffers())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)  # RoPE inv_freq
    if naming != "fp8-scaled":
        e1, e2 = te.encode(["a red cat", "blue"]), te_ref.encode(["a red cat", "blue"])
        assert torch.equal(e1[0], e2[0]) and torch.equal(e1[1], e2[1])
    if naming == "no-lm-head":
        assert (
            te.model.lm_head.weight.data_ptr() == te.model.model.language_model.embed_tokens.weight.data_ptr()
        )


def test_text_encoder_bf16_buffers_and_params_like_from_pretrained(tiny):
    _, path, tmp, _, _, tsd = tiny
    f = _save(tmp, "te-bf16.safetensors", _legacy_te(tsd))
    te = S.load_text_encoder_file(f, path / "tokenizer", "cpu", torch.bfloat16, config=path / "text_encoder")
    ref = TextEncoder.from_pretrained(path / "text_encoder", path / "tokenizer", "cpu", torch.bfloat16)
    a = dict(te.model.state_dict(keep_vars=True)) | dict(te.model.named_buffers())
    b = dict(ref.model.state_dict(keep_vars=True)) | dict(ref.model.named_buffers())
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_text_encoder_config_is_7b_or_must_be_given(tiny):
    from transformers import Qwen2_5_VLForConditionalGeneration

    shapes = {"model.language_model.embed_tokens.weight": (152064, 3584)}
    shapes |= {f"model.language_model.layers.{i}.input_layernorm.weight": (3584,) for i in range(28)}
    cfg = S.text_encoder_config(shapes)
    with S._parameters_on_meta():
        m = Qwen2_5_VLForConditionalGeneration(cfg)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert (
        len(got) == 729 and sum(v.numel() for v in m.state_dict().values()) == 8_292_166_656
    )  # Qwen2.5-VL-7B
    assert got["model.language_model.layers.0.self_attn.k_proj.weight"] == (512, 3584)
    assert got["model.visual.merger.mlp.0.weight"] == (5120, 5120)
    _, path, tmp, _, _, tsd = tiny
    f = _save(tmp, "te-tiny.safetensors", _legacy_te(tsd))
    with pytest.raises(CheckpointError, match=r"not Qwen2.5-VL-7B .*give its config.json"):
        S.load_text_encoder_file(f, path / "tokenizer", "cpu", torch.float32)


# ---------------------------------------------------------------------------------------------- pipeline + CLI


@pytest.fixture(scope="module")
def comfy_files(tiny):
    """ComfyUI-style split files of the tiny model: prefixed transformer, Wan VAE, ComfyUI-named TE."""
    _, _, tmp, sd, vsd, tsd = tiny
    wan = WK.diffusers_to_wan_vae_keys(list(vsd))
    return (_save(tmp, "c-transformer.safetensors", {"model.diffusion_model." + k: v for k, v in sd.items()}),
            _save(tmp, "c-vae.safetensors", {wan[k]: v for k, v in vsd.items()}),
            _save(tmp, "c-te.safetensors", _legacy_te(tsd)))  # fmt: skip


def test_from_single_files_pixels_match_diffusers(tiny, comfy_files):
    ref, path, *_ = tiny

    class Sub(QwenImagePipeline):  # subclasses (the edit pipeline) inherit the constructor
        pass

    pipe = Sub.from_single_files(*comfy_files, tokenizer=path / "tokenizer", device="cpu", dtype=torch.float32,
                                 transformer_config=AXES, vae_config=path / "vae",
                                 text_encoder_config=path / "text_encoder" / "config.json")  # fmt: skip
    assert type(pipe) is Sub and pipe.model_path == str(comfy_files[0])
    pipe.progress_bar = False
    kw = dict(prompt="a red circle", negative_prompt=" ", height=48, width=32, num_inference_steps=2)
    a = ref(**kw, generator=torch.Generator().manual_seed(5), output_type="np").images
    b = pipe(**kw, generator=torch.Generator().manual_seed(5), output_type="np").images
    assert b.std() > 0.05 and np.abs(a - b).max() <= 1e-3


def test_cli_generate_from_single_files(tiny, comfy_files, tmp_path, capsys):
    _, path, *_ = tiny
    tr, vae, te = map(str, comfy_files)
    out = tmp_path / "sf.png"
    args = ["generate", "a cat", "-o", str(out), "--transformer", tr, "--vae", vae, "--text-encoder", te,
            "--tokenizer", str(path / "tokenizer"), "--configs", str(path), "--size", "32x32", "--steps", "1",
            "--seed", "1", "--quiet", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0 and out.is_file()
    assert "RANDOM weights" not in capsys.readouterr().err
    assert main(args + ["--model", str(path)]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main([a for a in args if a not in ("--tokenizer", str(path / "tokenizer"))]) == 2
    assert "missing ['--tokenizer']" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- errors


def test_missing_or_bad_tokenizer(tiny, comfy_files, tmp_path):
    _, path, *_ = tiny
    with pytest.raises(CheckpointError, match="no tokenizer given; ComfyUI single files carry no tokenizer"):
        QwenImagePipeline.from_single_files(*comfy_files, device="cpu")
    with pytest.raises(CheckpointError, match="no tokenizer.json or vocab.json"):
        QwenImagePipeline.from_single_files(*comfy_files, tokenizer=tmp_path, device="cpu")
    with pytest.raises(CheckpointError, match=r"missing: \['vae'\]"):
        QwenImagePipeline.from_single_files(
            comfy_files[0], None, comfy_files[2], tokenizer=path, device="cpu"
        )


def test_truncated_and_non_safetensors_files(tiny, comfy_files, tmp_path):
    _, path, *_ = tiny
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(comfy_files[0].read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cut.safetensors: truncated"):
        S.inspect_transformer(cut)
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(CheckpointError, match=r"not a safetensors file.*\.gguf"):
        S.inspect_transformer(junk)
    with pytest.raises(CheckpointError, match="does not exist"):  # a bad VAE path fails before any loading
        QwenImagePipeline.from_single_files(comfy_files[0], tmp_path / "nope.safetensors", comfy_files[2],
                                            tokenizer=path, device="cpu", transformer_config=AXES)  # fmt: skip


def test_unknown_layouts_name_the_key_pattern(tiny, tmp_path):
    _, _, _, sd, vsd, _ = tiny
    flux = _save(
        tmp_path,
        "flux.safetensors",
        {f"double_blocks.{i}.img_attn.qkv.weight": torch.zeros(2) for i in range(3)},
    )
    with pytest.raises(
        CheckpointError,
        match=r"not a Qwen-Image transformer: found keys like 'double_blocks.N.img_attn.qkv.weight' \(x3\)",
    ):
        S.inspect_transformer(flux)
    with pytest.raises(CheckpointError, match="not a Qwen-Image VAE"):
        S.inspect_vae(flux)
    with pytest.raises(CheckpointError, match="not a Qwen2.5-VL text encoder"):
        S.inspect_text_encoder(flux)
    lora = _save(
        tmp_path, "lora.safetensors", {"transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(2, 4)}
    )
    with pytest.raises(CheckpointError, match="is a LoRA file"):
        S.inspect_transformer(lora)
    gap = _save(
        tmp_path,
        "gap.safetensors",
        {k: v for k, v in sd.items() if not k.startswith("transformer_blocks.0.")},
    )
    with pytest.raises(CheckpointError, match=r"transformer blocks \[0\] are missing \(1 found\)"):
        S.inspect_transformer(gap, AXES)


def test_unsupported_quantisation_is_refused_by_name(tiny, tmp_path):
    _, _, _, sd, _, _ = tiny
    k = "img_in.weight"
    nv = {**sd, k: sd[k].to(torch.uint8), "img_in.weight_scale": torch.ones(4), "img_in.weight_scale_2": torch.ones(()),
          "img_in.comfy_quant": torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)}  # fmt: skip
    with pytest.raises(CheckpointError, match=r"NVFP4.*supported: "):
        S.inspect_transformer(_save(tmp_path, "nv.safetensors", nv), AXES)
    del nv["img_in.weight_scale_2"]
    with pytest.raises(CheckpointError, match=r"layer img_in is quantised as 'nvfp4' \(comfy_quant marker\)"):
        S.inspect_transformer(_save(tmp_path, "nv2.safetensors", nv), AXES)
    i8 = {**sd, k: sd[k].to(torch.int8)}
    with pytest.raises(
        CheckpointError, match=r"integers without a known quantisation format: 'img_in.weight \(I8\)'"
    ):
        S.inspect_transformer(_save(tmp_path, "i8.safetensors", i8), AXES)
    bad_scale = {**sd, "img_in.weight_scale": torch.ones(())}
    with pytest.raises(
        CheckpointError, match=r"img_in.weight_scale belongs to img_in.weight, stored as F32, not FP8"
    ):
        S.inspect_transformer(_save(tmp_path, "bs.safetensors", bad_scale), AXES)
    block = {**sd, k: sd[k].to(E4M3), "img_in.weight_scale": torch.ones(2, 2)}
    with pytest.raises(CheckpointError, match="block-wise scales are not"):
        S.inspect_transformer(_save(tmp_path, "blk.safetensors", block), AXES)


def test_vram_plans_single_files_before_they_load(tiny, comfy_files, monkeypatch):
    """Sizes read from the files' headers equal the folder's; `vram_gib` then loads the offloaded parts to
    host memory (the plan is made before anything loads) and the image is the resident one."""
    import numpy as np

    from qwenfast import EngineOptions
    from qwenfast.loading.sizes import files_sizes, folder_sizes
    from qwenfast.runtime import memory
    from qwenfast.runtime.tiers import TooSmall, plan

    _, path, *_ = tiny
    got, want = files_sizes(*comfy_files, torch.float32), folder_sizes(path, torch.float32)
    for name in (
        "transformer",
        "transformer_block",
        "num_blocks",
        "block_modulation",
        "te_block",
        "te_blocks",
        "dim",
    ):
        assert getattr(got, name) == getattr(want, name), name
    monkeypatch.setattr(memory.Calibration, "load", classmethod(lambda cls, path=None: cls(overhead=0)))

    def blocks_plan(gib):
        try:
            return plan(got, gib, dtype=torch.float32).offload == "blocks"
        except TooSmall:
            return False

    gib = next(g for g in np.geomspace(0.001, 1.0, 400) if blocks_plan(g))
    kw = dict(tokenizer=path / "tokenizer", device="cpu", dtype=torch.float32, transformer_config=AXES,
              vae_config=path / "vae", text_encoder_config=path / "text_encoder" / "config.json")  # fmt: skip
    ref = QwenImagePipeline.from_single_files(*comfy_files, **kw)
    pipe = QwenImagePipeline.from_single_files(*comfy_files, options=EngineOptions(vram_gib=float(gib)), **kw)
    assert pipe.options.offload == "blocks" and pipe._block_streamer is not None
    assert (
        pipe.memory_plan is not None
        and len(pipe._block_streamer.resident) == pipe.memory_plan.resident_blocks
    )
    call = dict(prompt="a red circle", height=32, width=48, num_inference_steps=2, output_type="np")
    ref.progress_bar = pipe.progress_bar = False
    a = ref(**call, generator=torch.Generator().manual_seed(5)).images
    b = pipe(**call, generator=torch.Generator().manual_seed(5)).images
    np.testing.assert_array_equal(a, b)
