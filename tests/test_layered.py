"""Qwen-Image-Layered (RGBA layers from one picture) against diffusers.

A tiny random Layered pipeline (RGBA VAE, layer-3D RoPE, additional t condition) is built with
diffusers, saved in the Hugging Face layout and loaded by qwenfast; the same seed must give the same
pixels (fp32, CPU). diffusers only takes the 640 / 1024 buckets (~640² pixels per layer: far too slow
for a CPU test), so its `calculate_dimensions` is pointed at a 64² area here and qwenfast is asked
for `resolution=64`: both then work on a 96x64 picture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3


def _image(w: int, h: int, seed: int, mode: str = "RGBA"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    from qwenfast.pipeline.layered import QwenImageLayeredPipeline
    from qwenfast.testing.tiny_control import build_tiny_layered

    path = tmp_path_factory.mktemp("layered") / "tiny-layered"
    ref = build_tiny_layered(path, seed=0)
    qf = QwenImageLayeredPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    qf.progress_bar = False
    return ref, qf, path


@pytest.fixture
def small_buckets(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as mod

    orig = mod.calculate_dimensions
    monkeypatch.setattr(mod, "calculate_dimensions", lambda area, ratio: orig(64 * 64, ratio))


def _pair(ref, qf, image, **kw):
    a = ref(image, resolution=640, generator=torch.Generator().manual_seed(3), **kw).images
    b = qf(image, resolution=64, generator=torch.Generator().manual_seed(3), **kw).images
    return np.concatenate(a), b  # diffusers' per-sample lists are shifted for batches > 1 (see layered.py)


@pytest.mark.parametrize("layers,cfg,normalize", [(3, True, False), (4, True, True), (4, False, False)])
def test_layers_match_diffusers(layered, small_buckets, layers, cfg, normalize):
    from PIL import Image

    ref, qf, _ = layered
    kw = dict(prompt=["a red circle", "a blue square on the left"], layers=layers, num_inference_steps=2,
              output_type="np", cfg_normalize=normalize, true_cfg_scale=4.0 if cfg else 1.0,
              negative_prompt=" " if cfg else None)  # fmt: skip
    img = _image(80, 48, 1)
    a, b = _pair(ref, qf, img, **kw)
    assert len(b) == 2 and all(x.shape == (layers, 64, 96, 4) for x in b)  # per sample, RGBA, 96x64 picture
    b = np.concatenate(b)
    assert a.shape == b.shape and np.isfinite(b).all() and np.abs(a - b).max() < TOL
    moved = np.concatenate(ref(img, resolution=640, generator=torch.Generator().manual_seed(3),
                               **{**kw, "prompt": ["a red square", "a blue square on the left"]}).images)  # fmt: skip
    assert np.abs(moved - a).max() >= 10 * TOL  # the prompt matters
    flat = Image.new("RGBA", (80, 48), (255, 255, 255, 255))  # tiny random models barely see a noise-for-noise swap
    other = np.concatenate(ref(flat, resolution=640, generator=torch.Generator().manual_seed(3),
                               **kw).images)  # fmt: skip
    assert np.abs(other - a).max() >= 10 * TOL  # the picture matters


def test_pil_layers_and_rgb_input(layered, small_buckets):
    """PIL output: `layers` RGBA images per sample; an RGB picture is made RGBA (diffusers would fail)."""
    ref, qf, _ = layered
    kw = dict(prompt="a red circle", layers=3, num_inference_steps=2, num_images_per_prompt=2,
              true_cfg_scale=1.0)  # fmt: skip
    out = qf(_image(48, 80, 3), resolution=64, generator=torch.Generator().manual_seed(4), **kw).images
    assert len(out) == 2 and all(len(x) == 3 and all(im.mode == "RGBA" for im in x) for x in out)
    assert out[0][0].size == (64, 96)  # portrait picture -> portrait layers
    rgb = _image(48, 80, 3, "RGB")
    mine = qf(rgb, resolution=64, generator=torch.Generator().manual_seed(4), output_type="np", **kw).images
    theirs = ref(rgb.convert("RGBA"), resolution=640, generator=torch.Generator().manual_seed(4),
                 output_type="np", **kw).images  # fmt: skip
    assert np.abs(np.concatenate(mine) - np.concatenate(theirs)).max() < TOL


def test_empty_prompt_is_captioned_like_diffusers(layered):
    ref, qf, _ = layered
    im, _ = qf.picture(_image(80, 48, 5), 64)
    text = qf.caption(im, use_en_prompt=True)
    assert text and text == ref.get_image_caption(im, use_en_prompt=True, device="cpu")
    kw = dict(layers=1, num_inference_steps=1, true_cfg_scale=1.0, output_type="np", resolution=64)
    auto = qf(_image(80, 48, 5), "", use_en_prompt=True, generator=torch.Generator().manual_seed(1), **kw).images
    given = qf(_image(80, 48, 5), text, generator=torch.Generator().manual_seed(1), **kw).images
    assert np.array_equal(auto[0], given[0])


def test_bad_layered_inputs(layered):
    _, qf, _ = layered
    with pytest.raises(ValueError, match="image is required"):
        qf(None, "x")
    with pytest.raises(ValueError, match="layers"):
        qf(_image(32, 32, 0), "x", layers=0)
    with pytest.raises(ValueError, match="resolution"):
        qf(_image(32, 32, 0), "x", resolution=100)


def test_from_pretrained_picks_layered(layered):
    import qwenfast
    from qwenfast.pipeline.layered import QwenImageLayeredPipeline

    _, _, path = layered
    p = qwenfast.from_pretrained(path, device="cpu", dtype=torch.float32)
    assert type(p) is QwenImageLayeredPipeline and p.vae.cfg.input_channels == 4
    with pytest.raises(ValueError, match="layered model"):
        qwenfast.from_pretrained(path, task="text-to-image", device="cpu")


def test_cli_layers_writes_one_rgba_png_per_layer(layered, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    _, _, path = layered
    _image(80, 48, 1).save(tmp_path / "in.png")
    args = ["layers", str(tmp_path / "in.png"), "-o", str(tmp_path / "out"), "--layers", "3", "--model", str(path),
            "--prompt", "a red circle", "--steps", "1", "--resolution", "64", "--device", "cpu", "--seed", "1",
            "--quiet"]  # fmt: skip
    assert main(args) == 0
    files = sorted((tmp_path / "out").glob("*.png"))
    assert [f.name for f in files] == ["layer-0.png", "layer-1.png", "layer-2.png"]
    assert all(Image.open(f).mode == "RGBA" and Image.open(f).size == (96, 64) for f in files)
    assert main([*args[:-1], "--resolution", "100"]) == 2  # a clear error, no traceback
