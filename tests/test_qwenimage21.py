"""Qwen-Image-2.1 against diffusers 0.42.1's `QwenImage21Pipeline`, pixel by pixel (fp32, CPU).

A tiny random 2.1 pipeline (Qwen3-VL text encoder + vision tower, processor, transformer, RGBA
VAE) is built offline, saved in the Hugging Face layout and loaded by qwenfast; the same seed must
give the same RGBA pixels within 1e-3. The tiny models are made sensitive, and each group checks
that a deliberate change (a prompt word, swapped condition images) moves diffusers' own pixels by
at least 10x that tolerance, so the comparisons could fail.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3
RES = 128  # output_resolution: ~128² pixels, 8x8 latent tokens


def _image(w: int, h: int, seed: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    if mode == "RGBA":
        arr[..., 3] = np.where(np.arange(w)[None, :] < w // 2, 255, rng.integers(0, 256, (h, w)))
    return Image.fromarray(arr)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    import qwenfast
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny21"
    ref = build_tiny21_pipeline(path, seed=0)
    qf = qwenfast.from_pretrained(path, device="cpu", dtype=torch.float32)
    qf.progress_bar = False
    return ref, qf, path


def _both(ref, qf, **kw):
    kw = {"output_resolution": RES, "num_inference_steps": 3, **kw}
    a = ref(generator=torch.Generator().manual_seed(3), output_type="np", **kw).images
    b = qf(generator=torch.Generator().manual_seed(3), output_type="np", **kw).images
    assert np.isfinite(a).all() and np.isfinite(b).all()
    assert a.shape == b.shape, (a.shape, b.shape)
    return a, b


def test_class_is_picked_and_exported(pipes):
    import qwenfast
    from qwenfast.pipeline.pipeline21 import QwenImage21Pipeline

    _, qf, _ = pipes
    assert qwenfast.QwenImage21Pipeline is QwenImage21Pipeline and type(qf) is QwenImage21Pipeline
    assert qf.defaults["num_inference_steps"] == 40 and qf.defaults["true_cfg_scale"] == 1.0
    assert qf.text_encoder.drop_idx == pipes[0]._drop_idx


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_text_to_image(pipes, use_kv_cache):
    ref, qf, _ = pipes
    a, b = _both(ref, qf, prompt="a red circle on the left of a blue square", use_kv_cache=use_kv_cache)
    assert a.shape == (1, RES, RES, 4)  # RGBA out
    assert np.abs(a - b).max() < TOL
    if use_kv_cache:  # the comparison is sensitive: one word moves diffusers' pixels
        c, _ = _both(ref, qf, prompt="a green circle on the left of a blue square")
        assert np.abs(a - c).max() > 10 * TOL


def test_pil_output_is_rgba(pipes):
    _, qf, _ = pipes
    im = qf("a dog", output_resolution=64, num_inference_steps=1, generator=torch.Generator().manual_seed(0)).images[0]
    assert im.mode == "RGBA" and im.size == (64, 64)


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_one_rgba_condition_image(pipes, use_kv_cache):
    ref, qf, _ = pipes
    img = _image(96, 160, 1, "RGBA")  # portrait: the output follows its aspect ratio
    a, b = _both(ref, qf, prompt="make it red", image=img, use_kv_cache=use_kv_cache)
    assert a.shape[1] > a.shape[2]
    assert np.abs(a - b).max() < TOL


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_three_condition_images(pipes, use_kv_cache):
    ref, qf, _ = pipes
    imgs = [_image(128, 96, 2), _image(96, 96, 3, "RGBA"), _image(96, 96, 4)]
    a, b = _both(ref, qf, prompt="put the flowers into the scene", image=imgs, use_kv_cache=use_kv_cache)
    assert np.abs(a - b).max() < TOL
    if use_kv_cache:  # swapping two same-sized condition images moves diffusers' pixels
        c, _ = _both(ref, qf, prompt="put the flowers into the scene", image=[imgs[0], imgs[2], imgs[1]])
        assert np.abs(a - c).max() > 10 * TOL


def test_cfg_and_prompt_lists(pipes):
    ref, qf, _ = pipes
    kw = {"prompt": ["a red circle", "two cats under a tall tree"], "negative_prompt": ["blurry", "dark, ugly"]}
    a, b = _both(ref, qf, true_cfg_scale=3.0, **kw)
    assert np.abs(a - b).max() < TOL
    c, d = _both(ref, qf, true_cfg_scale=1.0, **kw)  # CFG off: the negative prompt is ignored
    assert np.abs(c - d).max() < TOL
    assert np.abs(a - c).max() > 10 * TOL


def test_cfg_with_image_and_images_per_prompt(pipes):
    ref, qf, _ = pipes
    img = _image(160, 96, 5)
    a, b = _both(ref, qf, prompt="make it blue", negative_prompt="blurry", true_cfg_scale=2.5, image=img,
                 num_images_per_prompt=2, num_inference_steps=2)  # fmt: skip
    assert a.shape[0] == 2 and np.abs(a - b).max() < TOL


def test_sigmas_and_turbo_schedule(pipes, tmp_path):
    from qwenfast.pipeline.pipeline21 import TURBO_SIGMAS, QwenImage21Pipeline

    ref, qf, path = pipes
    a, b = _both(ref, qf, prompt="a red circle", sigmas=[1.0, 0.8, 0.45, 0.2])
    assert np.abs(a - b).max() < TOL
    # a Turbo-style folder: model_index.json ships the sampling grid
    turbo = tmp_path / "turbo"
    turbo.mkdir()
    for sub in ("transformer", "vae", "text_encoder", "processor", "scheduler"):
        os.symlink(path / sub, turbo / sub)
    index = json.loads((path / "model_index.json").read_text())
    index["sample_sigmas"] = list(TURBO_SIGMAS["turbo-4"])
    (turbo / "model_index.json").write_text(json.dumps(index))
    qt = QwenImage21Pipeline.from_pretrained(turbo, device="cpu")
    qt.progress_bar = False
    ref.register_to_config(sample_sigmas=list(TURBO_SIGMAS["turbo-4"]))
    try:
        c, d = _both(ref, qt, prompt="a red circle")
    finally:
        ref.register_to_config(sample_sigmas=None)
    assert np.abs(c - d).max() < TOL
    qf.apply_preset("turbo-4")  # the same schedule as a preset on the base folder
    try:
        e = qf("a red circle", output_resolution=RES, generator=torch.Generator().manual_seed(3), output_type="np").images
    finally:
        qf.sample_sigmas, qf.defaults["num_inference_steps"] = None, 40
    assert np.abs(e - d).max() == 0


def test_bad_inputs_say_what_to_do(pipes):
    _, qf, _ = pipes
    img = _image(64, 64, 0)
    with pytest.raises(ValueError, match="1 to 10"):
        qf("x", image=[img] * 11, num_inference_steps=1)
    with pytest.raises(ValueError, match="flat set"):
        qf("x", image=[[img]], num_inference_steps=1)
    with pytest.raises(ValueError, match="unknown preset"):
        qf.apply_preset("lightning-4")


def test_comfyui_single_file_transformer(pipes, tmp_path):
    from safetensors.torch import save_file

    from qwenfast.errors import CheckpointError
    from qwenfast.loading.folder21 import load_transformer21_single_file

    ref, qf, _ = pipes
    sd, out = ref.transformer.state_dict(), {}
    for k, v in sd.items():  # ComfyUI's layout: prefixed keys, gate and up projections fused
        if ".img_mlp.proj." in k:
            continue
        if ".img_mlp.gate_layer." in k:
            v = torch.cat([v, sd[k.replace("gate_layer", "proj")]])
            k = k.replace("gate_layer", "gate_up")
        out["model.diffusion_model." + k] = v.contiguous()
    f = tmp_path / "qwen_image_2.1_bf16.safetensors"
    save_file(out, str(f))
    with pytest.raises(CheckpointError, match="pass config="):  # tiny head dim: the RoPE axes cannot be inferred
        load_transformer21_single_file(f, "cpu", torch.float32)
    m = load_transformer21_single_file(f, "cpu", torch.float32, config=dict(ref.transformer.config))
    for k, v in qf.transformer.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k
    bad = tmp_path / "other.safetensors"
    save_file({"txt_norm.weight": torch.ones(4)}, str(bad))
    with pytest.raises(CheckpointError, match="Qwen-Image \\(1.x\\)"):
        load_transformer21_single_file(bad, "cpu", torch.float32)


def test_cli_generate_and_edit(pipes, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    ref, qf, path = pipes
    out = tmp_path / "gen.png"
    assert main(["generate", "a red circle", "--model", str(path), "--device", "cpu", "-o", str(out), "--seed", "3",
                 "--steps", "2", "--size", "64x96", "--quiet"]) == 0  # fmt: skip
    with Image.open(out) as im:
        assert im.mode == "RGBA" and im.size == (64, 96)
        got = np.asarray(im)
    want = ref("a red circle", height=96, width=64, num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(3)).images[0]  # fmt: skip
    assert np.abs(got / 255.0 - want).max() <= 1 / 255 + TOL
    small = tmp_path / "small"  # the same model with qwenfast.json defaults: condition images at ~128²
    small.mkdir()
    for f in path.iterdir():
        os.symlink(f, small / f.name)
    (small / "qwenfast.json").write_text(json.dumps({"defaults": {"output_resolution": RES}}))
    src = tmp_path / "in.png"
    _image(96, 64, 9, "RGBA").save(src)
    out2 = tmp_path / "edit.png"
    assert main(["edit", str(src), str(src), "--prompt", "make it red", "--model", str(small), "--device", "cpu",
                 "-o", str(out2), "--steps", "1", "--quiet"]) == 0  # fmt: skip
    with Image.open(out2) as im:
        assert im.mode == "RGBA" and im.size[0] > im.size[1]  # follows the (landscape) input


@torch.no_grad()
def test_text_encoder_graph_path_equals_the_left_padded_call(pipes, monkeypatch):
    """The CUDA-graph path of 2.1's prompt encode (ids right-padded to a bucket, no mask, the final
    norm's input read through a hook) gives the states of diffusers' left-padded masked call; run
    eagerly on CPU (the graph replays the same kernels). Prompts of different lengths: padding."""
    from qwenfast.runtime.cuda_graphs import TextEncoderGraphs

    _, qf, _ = pipes
    te = qf.text_encoder
    prompts = ["a red fox", "a large blue star at the top left of a green field, soft light", " "]
    want = te.encode(prompts)
    runner = TextEncoderGraphs(te._lm, te.tokenizer.pad_token_id, bucket=16, pre_norm=True)
    monkeypatch.setattr(te, "_graph_runner", lambda: runner)
    got = te.encode(prompts)
    assert want[1] is not None and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    m = want[1].bool()
    assert torch.allclose(got[0][m], want[0][m], atol=1e-5, rtol=1e-5)
    other = te.encode(["a red fox", prompts[1].replace("blue", "pink"), " "])[0]
    assert (other[1] - got[0][1]).abs().max() > 1e-3  # one word moves the states far beyond the tolerance
    # the hook is gone after the call: the plain language model output is normed again
    ids = te.tokenizer(["a red fox"], return_tensors="pt").input_ids
    normed = te._lm(input_ids=ids, use_cache=False).last_hidden_state
    assert not torch.allclose(normed, runner.eager(ids), atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.no_grad()
def test_text_encoder_cuda_graph_on_gpu(pipes):
    import copy

    from qwenfast.models.text_encoder21 import TextEncoder21

    _, qf, _ = pipes
    src = qf.text_encoder
    model = copy.deepcopy(src.model).cuda().to(torch.bfloat16)
    te = TextEncoder21(model, src.tokenizer, src.image_processor)
    te.drop_idx = src.drop_idx
    prompts = ["a red fox", "a large blue star at the top left of a green field, soft light"]
    te.cuda_graphs = False
    want = te.encode(prompts)
    te.cuda_graphs = True
    for _ in range(2):  # capture, then replay
        got = te.encode(prompts)
        assert te._graphs and te._graphs.enabled and len(te._graphs.graphs) == 1
        assert torch.equal(got[1], want[1]) and torch.isfinite(got[0]).all()
        m = want[1].bool()
        assert ((got[0][m].float() - want[0][m].float()).norm() / want[0][m].float().norm()).item() < 1e-2
