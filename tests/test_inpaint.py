"""img2img, inpainting and edit-inpainting against diffusers 0.42.1 (tiny random models, fp32, CPU).

Same seed -> same pixels (within 1e-3) as diffusers' `QwenImageImg2ImgPipeline`,
`QwenImageInpaintPipeline` and `QwenImageEditInpaintPipeline`: non-square sizes, batch 2, CFG on and
off, strength 0.3 / 0.7 / 1.0, masks with soft (blurred) edges. Each model is shown to react: a
changed prompt word, mask or image moves diffusers' own pixels by >= 10x the tolerance, so a match
is not a match of two outputs that ignore their inputs.

diffusers' edit-inpaint pipeline resizes the image to a hard-coded ~1024² area (seconds per step of a
tiny model on a CPU). The edit tests shrink that one constant (`calculate_dimensions`' target area in
diffusers' module, patched for the call) and give qwenfast the same area through the model folder's
qwenfast.json `image_areas`, which is how qwenfast's own models state theirs.
"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3
AREA = 96 * 64  # edit inputs: a 72x40 image -> 96x64 output (both sides, qwenfast and patched diffusers)


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _mask(w: int, h: int, box: tuple, blur: float = 3.0):
    """White ellipse (repaint) on black (keep), blurred: soft edges that diffusers binarises at 0.5."""
    from PIL import Image, ImageDraw, ImageFilter

    m = Image.new("L", (w, h), 0)
    ImageDraw.Draw(m).ellipse(box, fill=255)
    return m.filter(ImageFilter.GaussianBlur(blur)) if blur else m


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def t2i(tiny_t2i):
    """(diffusers img2img, diffusers inpaint, qwenfast img2img, qwenfast inpaint) on the same weights."""
    import diffusers

    from qwenfast.pipeline.auto import for_task
    from qwenfast.pipeline.img2img import QwenImageImg2ImgPipeline

    ref, path = tiny_t2i
    d_i2i = diffusers.QwenImageImg2ImgPipeline(**ref.components)
    d_inp = diffusers.QwenImageInpaintPipeline(**ref.components)
    for p in (d_i2i, d_inp):
        p.set_progress_bar_config(disable=True)
    q_i2i = QwenImageImg2ImgPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q_i2i.progress_bar = False
    return d_i2i, d_inp, q_i2i, for_task(q_i2i, "inpaint")


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    """(diffusers edit-inpaint (Edit v1), qwenfast edit-inpaint, folder) with AREA as the input area."""
    import diffusers

    from qwenfast.pipeline.inpaint import QwenImageEditInpaintPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny-edit-v1"
    ref = build_tiny_pipeline(path, seed=0, edit="edit")
    (path / "qwenfast.json").write_text(json.dumps({"image_areas": {"vl_area": AREA, "vae_area": AREA}}))
    d = diffusers.QwenImageEditInpaintPipeline(**ref.components)
    d.set_progress_bar_config(disable=True)
    q = QwenImageEditInpaintPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.progress_bar = False
    return d, q, path


def _diffusers_edit(d, **kw):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_inpaint as mod

    real = mod.calculate_dimensions
    with mock.patch.object(mod, "calculate_dimensions", lambda area, ratio: real(AREA, ratio)):
        return d(**kw).images


def _close(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and np.isfinite(b).all()
    assert b.std() > 0.05  # a picture, not a constant
    return float(np.abs(a - b).max())


# ----------------------------------------------------------------------------------------- img2img
I2I = {
    "s0.3-cfg": dict(prompt="a red circle on the left", negative_prompt=" ", true_cfg_scale=4.0, strength=0.3,
                     height=48, width=80, num_inference_steps=4),
    "s0.7-nocfg-batch2": dict(prompt=["a red circle", "a small blue square at the top"], true_cfg_scale=1.0,
                              strength=0.7, height=64, width=32, num_inference_steps=4),
    "s1.0-cfg-2-per-prompt": dict(prompt="green star", negative_prompt="blurry", true_cfg_scale=3.0, strength=1.0,
                                  height=32, width=64, num_inference_steps=3, num_images_per_prompt=2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(I2I))
def test_img2img_matches_diffusers(t2i, case):
    d_i2i, _, q, _ = t2i
    kw = I2I[case]
    img = _image(72, 40, 1)
    B = len(kw["prompt"]) if isinstance(kw["prompt"], list) else kw.get("num_images_per_prompt", 1)
    gens = lambda: [_gen(7 + i) for i in range(B)] if B > 1 else _gen(7)  # noqa: E731
    a = d_i2i(image=img, generator=gens(), output_type="np", **kw).images
    b = q(image=img, generator=gens(), output_type="np", **kw).images
    assert a.shape[0] == B and _close(a, b) <= TOL
    if case == "s0.3-cfg":  # the picture it starts from, and the prompt, both matter
        other = d_i2i(image=_image(72, 40, 2), generator=gens(), output_type="np", **kw).images
        assert np.abs(a - other).max() >= 10 * TOL
        word = d_i2i(image=img, generator=gens(), output_type="np", **{**kw, "prompt": "a blue circle on the left"})
        assert np.abs(a - word.images).max() >= 10 * TOL


def test_img2img_given_latents_and_custom_sigmas(t2i):
    """diffusers' meaning of `latents` here: the start point as it is (the image is not encoded)."""
    d_i2i, _, q, _ = t2i
    lat = torch.randn(1, 4 * 2, 64, generator=_gen(3))  # 32x64 px -> 2x4 tokens
    kw = dict(prompt="a cat", true_cfg_scale=1.0, strength=0.5, height=32, width=64, sigmas=[1.0, 0.8, 0.5, 0.2])
    a = d_i2i(image=_image(64, 32, 3), latents=lat, output_type="np", **kw).images
    b = q(image=_image(64, 32, 3), latents=lat, output_type="np", **kw).images
    assert _close(a, b) <= TOL


# ----------------------------------------------------------------------------------------- inpaint
INP = {
    "s0.3-cfg-soft": dict(prompt="a red circle", negative_prompt=" ", true_cfg_scale=4.0, strength=0.3,
                          height=48, width=80, num_inference_steps=4),
    "s0.7-nocfg-batch2": dict(prompt=["a red circle", "blue sky"], true_cfg_scale=1.0, strength=0.7,
                              height=64, width=48, num_inference_steps=4),
    "s1.0-cfg": dict(prompt="a yellow triangle", negative_prompt="ugly", true_cfg_scale=4.0, strength=1.0,
                     height=32, width=80, num_inference_steps=3),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INP))
def test_inpaint_matches_diffusers(t2i, case):
    _, d_inp, _, q = t2i
    kw = INP[case]
    img, mask = _image(72, 40, 4), _mask(72, 40, (12, 4, 52, 34))
    B = len(kw["prompt"]) if isinstance(kw["prompt"], list) else 1
    gens = lambda: [_gen(7 + i) for i in range(B)] if B > 1 else _gen(7)  # noqa: E731
    a = d_inp(image=img, mask_image=mask, generator=gens(), output_type="np", **kw).images
    b = q(image=img, mask_image=mask, generator=gens(), output_type="np", **kw).images
    assert _close(a, b) <= TOL
    if case == "s0.3-cfg-soft":
        moved = d_inp(image=img, mask_image=_mask(72, 40, (30, 4, 70, 34)), generator=gens(), output_type="np", **kw)
        assert np.abs(a - moved.images).max() >= 10 * TOL
        word = d_inp(image=img, mask_image=mask, generator=gens(), output_type="np", **{**kw, "prompt": "a blue circle"})
        assert np.abs(a - word.images).max() >= 10 * TOL


def test_inpaint_one_image_and_mask_per_row_and_an_oom_split(t2i):
    """Two images with their own masks and generators (diffusers encodes each with its generator);
    then the same call split by an injected OOM: the blend must see each chunk's own rows."""
    _, d_inp, _, q = t2i
    imgs, masks = [_image(64, 48, 5), _image(64, 48, 6)], [_mask(64, 48, (0, 0, 30, 30)), _mask(64, 48, (20, 10, 64, 48))]
    kw = dict(prompt=["a red circle", "a green square"], negative_prompt=" ", true_cfg_scale=3.0, strength=0.8,
              height=48, width=64, num_inference_steps=3)  # fmt: skip
    a = d_inp(image=imgs, mask_image=masks, generator=[_gen(1), _gen(2)], output_type="np", **kw).images
    b = q(image=imgs, mask_image=masks, generator=[_gen(1), _gen(2)], output_type="np", **kw).images
    assert _close(a, b) <= TOL
    real = type(q.transformer).forward

    def tight(module, *args, **k):
        if args[0].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(module, *args, **k)

    q.transformer.forward = tight.__get__(q.transformer)
    try:
        split = q(image=imgs, mask_image=masks, generator=[_gen(1), _gen(2)], output_type="np", **kw)
    finally:
        del q.transformer.forward
    assert split.info["oom_backoff"] and np.abs(split.images - b).max() <= 1e-5


def test_inpaint_keeps_the_unmasked_region(t2i):
    """Outside the mask the result is the image's own latents decoded (the VAE round trip), not new content."""
    _, _, _, q = t2i
    img = _image(64, 64, 7)
    full_keep = q("x", image=img, mask_image=_mask(64, 64, (0, 0, 0, 0), blur=0), strength=1.0, true_cfg_scale=1.0,
                  height=64, width=64, num_inference_steps=2, generator=_gen(1), output_type="np").images  # fmt: skip
    other = q("x", image=img, mask_image=_mask(64, 64, (0, 0, 0, 0), blur=0), strength=1.0, true_cfg_scale=1.0,
              height=64, width=64, num_inference_steps=2, generator=_gen(1), output_type="np").images  # fmt: skip
    assert np.array_equal(full_keep, other)
    repaint = q("x", image=img, mask_image=_mask(64, 64, (-10, -10, 80, 80), blur=0), strength=1.0,
                true_cfg_scale=1.0, height=64, width=64, num_inference_steps=2, generator=_gen(1), output_type="np")  # fmt: skip
    assert np.abs(repaint.images - full_keep).max() > 0.1  # an all-white mask repaints


# ----------------------------------------------------------------------------------------- edit-inpaint
EDIT = {
    "s0.7-cfg-soft": dict(prompt="make it red", negative_prompt=" ", true_cfg_scale=4.0, strength=0.7,
                          num_inference_steps=3),
    "s0.3-nocfg-batch2": dict(prompt="add a blue star", true_cfg_scale=1.0, strength=0.3, num_inference_steps=4,
                              num_images_per_prompt=2),  # diffusers' edit takes one prompt per image
    "s1.0-cfg": dict(prompt="turn the circle into a square", negative_prompt="blurry", true_cfg_scale=3.0,
                     strength=1.0, num_inference_steps=2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EDIT))
def test_edit_inpaint_matches_diffusers(edit, case):
    d, q, _ = edit
    kw = EDIT[case]
    img, mask = _image(72, 40, 8), _mask(72, 40, (8, 6, 48, 36))
    B = kw.get("num_images_per_prompt", 1)
    gens = lambda: [_gen(7 + i) for i in range(B)] if B > 1 else _gen(7)  # noqa: E731
    a = _diffusers_edit(d, image=img, mask_image=mask, generator=gens(), output_type="np", **kw)
    b = q(image=img, mask_image=mask, generator=gens(), output_type="np", **kw).images
    assert a.shape == (B, 64, 96, 3) and _close(a, b) <= TOL
    if case == "s0.7-cfg-soft":
        moved = _diffusers_edit(d, image=img, mask_image=_mask(72, 40, (30, 6, 70, 36)), generator=gens(),
                                output_type="np", **kw)  # fmt: skip
        assert np.abs(a - moved).max() >= 10 * TOL
        word = _diffusers_edit(d, image=img, mask_image=mask, generator=gens(), output_type="np",
                               **{**kw, "prompt": "make it blue"})  # fmt: skip
        assert np.abs(a - word).max() >= 10 * TOL


def test_edit_inpaint_ignores_height_and_width_like_diffusers(edit):
    _, q, _ = edit
    img = _image(72, 40, 9)
    assert q.output_size({"image": img, "height": 32, "width": 32}) == (64, 96)
    out = q(img, "make it red", mask_image=_mask(72, 40, (0, 0, 30, 30)), height=32, width=32, true_cfg_scale=1.0,
            num_inference_steps=1, strength=1.0, generator=_gen(0))  # fmt: skip
    assert out.images[0].size == (96, 64)


# ----------------------------------------------------------------------------------------- loading, errors
def test_from_pretrained_task_and_for_task(tiny_t2i, edit):
    import qwenfast
    from qwenfast.pipeline.auto import for_task

    _, path = tiny_t2i
    assert type(qwenfast.from_pretrained(path, device="cpu", task="inpaint")).__name__ == "QwenImageInpaintPipeline"
    assert type(qwenfast.from_pretrained(edit[2], device="cpu", task="inpaint")).__name__ == "QwenImageEditInpaintPipeline"
    with pytest.raises(ValueError, match="needs an edit model"):
        qwenfast.from_pretrained(path, device="cpu", task="edit-inpaint")
    with pytest.raises(ValueError, match="needs a text-to-image model"):
        qwenfast.from_pretrained(edit[2], device="cpu", task="img2img")
    with pytest.raises(ValueError, match="unknown task"):
        qwenfast.from_pretrained(path, device="cpu", task="outpaint")
    base = qwenfast.QwenImagePipeline.from_pretrained(path, device="cpu")
    view = for_task(base, "img2img")
    assert isinstance(view, qwenfast.QwenImageImg2ImgPipeline) and view.transformer is base.transformer
    view.configure(batched_cfg=False)  # one state: a change through either is seen by both
    assert base.options.batched_cfg is False
    for name in ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditInpaintPipeline"):
        assert name in qwenfast.__all__ and getattr(qwenfast, name).__name__ == name


def test_bad_arguments_are_clear(t2i, edit):
    _, _, i2i, inp = t2i
    img, mask = _image(32, 32, 0), _mask(32, 32, (0, 0, 16, 16))
    kw = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0)
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="strength"):
            i2i("x", image=img, strength=bad, **kw)
    with pytest.raises(ValueError, match="leaves 0 denoising steps"):
        i2i("x", image=img, strength=0.0, **kw)
    with pytest.raises(ValueError, match="`image` is required"):
        i2i("x", **kw)
    with pytest.raises(ValueError, match="`mask_image` is required"):
        inp("x", image=img, **kw)
    with pytest.raises(ValueError, match="padding_mask_crop"):
        inp("x", image=img, mask_image=mask, padding_mask_crop=8, **kw)
    with pytest.raises(ValueError, match="`latents` is not supported"):
        inp("x", image=img, mask_image=mask, latents=torch.zeros(1, 4, 64), **kw)
    with pytest.raises(ValueError, match="cannot be spread over"):
        inp(["a", "b", "c"], image=img, mask_image=[mask, mask], **kw)
    with pytest.raises(ValueError, match="no such file"):
        inp("x", image=img, mask_image="/nonexistent/mask.png", **kw)
    with pytest.raises(TypeError, match="mask_image must be"):
        inp("x", image=img, mask_image=3, **kw)
    with pytest.raises(ValueError, match="exactly 1 image and 1 mask"):
        edit[1]([img, img], "x", mask_image=mask)


# ----------------------------------------------------------------------------------------- CLI
def test_cli_img2img_inpaint_and_edit_mask(tiny_t2i, edit, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    src, m = tmp_path / "src.png", tmp_path / "mask.png"
    _image(64, 48, 10).save(src)
    _mask(64, 48, (0, 0, 40, 40)).save(m)
    common = ["--steps", "2", "--seed", "3", "--quiet", "--device", "cpu", "--cfg", "1"]
    for extra, name in ((["--strength", "0.6"], "i2i.png"), (["--mask", str(m), "--strength", "0.9"], "inp.png")):
        out = tmp_path / name
        assert main(["generate", "a red circle", "--model", str(tiny_t2i[1]), "--image", str(src), *extra, *common,
                     "-o", str(out)]) == 0  # fmt: skip
        im = Image.open(out)
        assert im.size == (64, 48) and im.text["strength"] in ("0.6", "0.9") and im.text["input"] == str(src)
    assert "mask" in Image.open(tmp_path / "inp.png").text
    out = tmp_path / "edit.png"
    assert main(["edit", str(src), "--prompt", "make it red", "--mask", str(m), "--model", str(edit[2]), *common,
                 "-o", str(out)]) == 0  # fmt: skip
    h, w = edit[1].output_size({"image": Image.open(src)})  # the image's aspect at the model's area (AREA)
    assert Image.open(out).size == (w, h) and Image.open(out).text["task"] == "edit-inpaint"
    assert main(["generate", "x", "--model", str(tiny_t2i[1]), "--mask", str(m), *common]) == 2  # mask needs --image
    assert main(["generate", "x", "--model", str(tiny_t2i[1]), "--image", str(src), "--strength", "2"]) == 2
    assert main(["edit", str(src), str(src), "--prompt", "x", "--mask", str(m), "--model", str(edit[2])]) == 2
