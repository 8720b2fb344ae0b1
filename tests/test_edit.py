"""Edit pipelines (v1, Edit-Plus 2509 with 1 and 3 images, Edit-2511 `zero_cond_t`) against diffusers.

Tiny random models are built with diffusers, saved in the Hugging Face layout and loaded by
qwenfast; the same seed must give the same pixels (fp32, CPU). The reference images are resized to
~1024² area for the VAE whatever their size (as in diffusers), so the output is kept small to stay fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _build(tmp_path_factory, edit: str, zero_cond_t: bool = False):
    from qwenfast.pipeline.edit import QwenImageEditPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("models") / f"tiny-{edit}-{int(zero_cond_t)}"
    ref = build_tiny_pipeline(path, seed=0, edit=edit, zero_cond_t=zero_cond_t)
    qf = QwenImageEditPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    qf.progress_bar = False
    return ref, qf, path


@pytest.fixture(scope="module")
def edit_v1(tmp_path_factory):
    return _build(tmp_path_factory, "edit")


@pytest.fixture(scope="module")
def edit_plus(tmp_path_factory):
    return _build(tmp_path_factory, "edit-plus")


@pytest.fixture(scope="module")
def edit_2511(tmp_path_factory):
    return _build(tmp_path_factory, "edit-plus", zero_cond_t=True)


KW = dict(prompt="make the circle red", negative_prompt=" ", num_inference_steps=2, true_cfg_scale=4.0, height=48, width=80)


# max abs pixel difference to diffusers (fp32, [0, 1] pixels; measured 1.9e-6 to 2.7e-6). Tight, because the
# tiny edit models barely look at their reference images (another last image moves diffusers' pixels by
# 4.8e-3 to 2.1e-2) and the sensitivity guard below needs 10 x TOL of that.
TOL = 1e-4


def _both(ref, qf, images, diffusers_image, **kw):
    args = {**KW, **kw}
    a = ref(image=diffusers_image, generator=torch.Generator().manual_seed(7), output_type="np", **args).images
    b = qf(images, generator=torch.Generator().manual_seed(7), output_type="np", **args).images
    return a, b


def _assert_matches_and_sensitive(ref, a, b, diffusers_image):
    """qwenfast's `b` equals diffusers' `a` within TOL, and another last reference image moves diffusers'
    output by >= 10 x TOL: a pipeline that ignored (or dropped the last of) its images could not pass."""
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    assert np.abs(a - b).max() < TOL
    imgs = diffusers_image if isinstance(diffusers_image, list) else [diffusers_image]
    other = imgs[:-1] + [_image(*imgs[-1].size, 99)]
    moved = ref(image=other if isinstance(diffusers_image, list) else other[0],
                generator=torch.Generator().manual_seed(7), output_type="np", **KW).images  # fmt: skip
    assert np.abs(moved - a).max() >= 10 * TOL


def test_edit_v1_matches_diffusers(edit_v1):
    ref, qf, _ = edit_v1
    img = _image(72, 40, 1)
    assert qf.mode == "edit"
    a, b = _both(ref, qf, [img], img)
    assert a.shape == b.shape == (1, 48, 80, 3)
    _assert_matches_and_sensitive(ref, a, b, img)


def test_edit_v1_default_size_follows_the_image(edit_v1):
    ref, qf, _ = edit_v1
    img = _image(40, 72, 2)  # portrait: output ~1024² area, same aspect, multiples of 32
    kw = {**KW, "height": None, "width": None, "negative_prompt": None, "true_cfg_scale": 1.0}
    a = ref(image=img, generator=torch.Generator().manual_seed(7), output_type="latent", **kw).images
    b = qf(img, generator=torch.Generator().manual_seed(7), output_type="latent", **kw).images
    w = round(math.sqrt(1024 * 1024 * 40 / 72) / 32) * 32
    h = round(math.sqrt(1024 * 1024 * 40 / 72) / (40 / 72) / 32) * 32
    assert a.shape == b.shape == (1, (h // 16) * (w // 16), 64)  # packed latents of the output size
    assert (a - b).abs().max() < 1e-4


def test_edit_plus_one_image_matches_diffusers(edit_plus):
    ref, qf, _ = edit_plus
    img = _image(64, 48, 3)
    assert qf.mode == "edit-plus"
    a, b = _both(ref, qf, [img], [img])
    _assert_matches_and_sensitive(ref, a, b, [img])


def test_edit_plus_three_images_matches_diffusers(edit_plus):
    ref, qf, _ = edit_plus
    imgs = [_image(64, 40, 4), _image(40, 64, 5), _image(56, 56, 6)]
    a, b = _both(ref, qf, imgs, imgs)
    _assert_matches_and_sensitive(ref, a, b, imgs)


def test_edit_2511_zero_cond_t_matches_diffusers(edit_2511):
    ref, qf, _ = edit_2511
    assert qf.transformer.cfg.zero_cond_t
    imgs = [_image(64, 40, 7), _image(48, 48, 8)]
    a, b = _both(ref, qf, imgs, imgs)
    _assert_matches_and_sensitive(ref, a, b, imgs)


def test_batched_cfg_equals_separate_passes_and_prompt_cache(edit_plus):
    _, qf, _ = edit_plus
    img = _image(48, 48, 9)
    calls = []
    hook = qf.text_encoder.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        outs = []
        for batched in (True, False):
            qf.configure(batched_cfg=batched)
            outs.append(qf(img, generator=torch.Generator().manual_seed(3), output_type="np", **KW).images)
    finally:
        qf.configure(batched_cfg=True)
        hook.remove()
    assert np.abs(outs[0] - outs[1]).max() < 1e-5
    assert len(calls) == 2  # prompt and negative once; the second run hits the cache


def test_prompt_list_is_each_prompt_alone(edit_plus):
    _, qf, _ = edit_plus
    img = _image(48, 40, 10)
    kw = {**KW, "negative_prompt": None, "true_cfg_scale": 1.0}
    kw.pop("prompt")
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    both = qf(img, ["make it red", "add a blue star to the left"], generator=gens, output_type="np", **kw).images
    for i, (p, s) in enumerate((("make it red", 1), ("add a blue star to the left", 2))):
        one = qf(img, p, generator=torch.Generator().manual_seed(s), output_type="np", **kw).images
        assert np.abs(both[i] - one[0]).max() < 1e-5


def test_wrong_number_of_images(edit_v1, edit_plus):
    img = _image(32, 32, 0)
    with pytest.raises(ValueError, match="exactly 1 image"):
        edit_v1[1]([img, img], "x", num_inference_steps=1)
    with pytest.raises(ValueError, match="1 to 3 images"):
        edit_plus[1]([img] * 4, "x", num_inference_steps=1)
    with pytest.raises(ValueError, match="1 to 3 images"):
        edit_plus[1]([], "x", num_inference_steps=1)


def test_bad_images(edit_plus, tmp_path):
    qf = edit_plus[1]
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"this is not a png")
    with pytest.raises(ValueError, match="not a readable image"):
        qf(str(junk), "x")
    with pytest.raises(ValueError, match="no such file"):
        qf(str(tmp_path / "missing.png"), "x")
    with pytest.raises(TypeError, match="PIL image"):
        qf(42, "x")
    with pytest.raises(ValueError, match="uint8"):
        qf(np.zeros((8, 8, 3), dtype=np.float32), "x")


def test_paths_arrays_and_rgba_are_accepted(edit_plus, tmp_path):
    _, qf, _ = edit_plus
    img = _image(40, 40, 11)
    p = tmp_path / "in.png"
    img.convert("RGBA").save(p)
    kw = {**KW, "num_inference_steps": 1}
    a = qf(img, generator=torch.Generator().manual_seed(0), output_type="np", **kw).images
    b = qf(str(p), generator=torch.Generator().manual_seed(0), output_type="np", **kw).images
    c = qf(np.asarray(img), generator=torch.Generator().manual_seed(0), output_type="np", **kw).images
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_pipeline_classes_refuse_the_other_kind(edit_plus, tiny_t2i):
    import qwenfast
    from qwenfast.loading.weights import CheckpointError

    with pytest.raises(CheckpointError, match="QwenImageEditPipeline"):
        qwenfast.QwenImagePipeline.from_pretrained(edit_plus[2], device="cpu")
    with pytest.raises(CheckpointError, match="runs Qwen-Image-Edit checkpoints"):
        qwenfast.QwenImageEditPipeline.from_pretrained(tiny_t2i[1], device="cpu")
    pipe = qwenfast.from_pretrained(edit_plus[2], device="cpu")
    assert type(pipe).__name__ == "QwenImageEditPipeline" and pipe.mode == "edit-plus"


def test_cli_edit(edit_plus, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    src = tmp_path / "src.png"
    _image(48, 32, 12).save(src)
    out = tmp_path / "out.png"
    rc = main(["edit", str(src), "--prompt", "make it red", "--model", str(edit_plus[2]), "--steps", "1",
               "--size", "64x48", "--seed", "1", "--quiet", "--device", "cpu", "-o", str(out)])  # fmt: skip
    assert rc == 0
    im = Image.open(out)
    assert im.size == (64, 48) and im.text["mode"] == "edit-plus" and im.text["prompt"] == "make it red"
    assert main(["edit", str(tmp_path / "nope.png"), "--prompt", "x", "--model", str(edit_plus[2])]) == 2


def test_single_files_edit_v1_mode(edit_v1):
    from qwenfast.pipeline.edit import QwenImageEditPipeline

    _, qf, path = edit_v1
    files = {k: path / k for k in ("transformer", "vae", "text_encoder", "tokenizer")}
    sf = QwenImageEditPipeline.from_single_files(**files, scheduler=path / "scheduler" / "scheduler_config.json",
                                                 device="cpu", dtype=torch.float32, mode="edit")  # fmt: skip
    sf.progress_bar = False
    assert sf.mode == "edit"
    img = _image(40, 32, 13)
    kw = {**KW, "num_inference_steps": 1, "negative_prompt": None, "true_cfg_scale": 1.0}
    a = qf(img, generator=torch.Generator().manual_seed(0), output_type="np", **kw).images
    b = sf(img, generator=torch.Generator().manual_seed(0), output_type="np", **kw).images
    assert np.abs(a - b).max() < 1e-6
    with pytest.raises(ValueError, match="mode must be one of"):
        QwenImageEditPipeline.from_single_files(**files, mode="v3")


def test_batched_vl_encode_equals_each_text_alone(edit_plus):
    """Texts with different pictures in one padded forward (how training and prompt lists encode) give
    each text's embedding alone."""
    from qwenfast.models.text_encoder import EDIT_DROP, EDIT_TEMPLATE, VISION_SLOT

    qf = edit_plus[1]
    te, proc = qf.text_encoder, qf.image_processor
    texts = [EDIT_TEMPLATE.format(f"Picture 1: {VISION_SLOT}{t}") for t in ("make it red", "add a small blue star")]
    ims = [[_image(56, 56, 11)], [_image(84, 56, 12)]]  # different sizes: different image-token counts
    with torch.no_grad():
        both = te._hidden_vl(texts, ims, proc, EDIT_DROP)
        for t, im, got in zip(texts, ims, both):
            (alone,) = te._hidden_vl([t], [im], proc, EDIT_DROP)
            assert got.shape == alone.shape
            assert torch.allclose(got, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="placeholders"):
        te._hidden_vl(texts[:1], [ims[0] * 2], proc, EDIT_DROP)


def test_image_areas_from_qwenfast_json(edit_plus, tmp_path):
    """A model trained at another scale says so in qwenfast.json; the default output size follows it."""
    import json
    import shutil

    from qwenfast.pipeline.edit import QwenImageEditPipeline, calculate_dimensions

    path = tmp_path / "small-edit"
    shutil.copytree(edit_plus[2], path)
    (path / "qwenfast.json").write_text(json.dumps({"image_areas": {"vl_area": 56 * 56, "vae_area": 64 * 64}}))
    qf = QwenImageEditPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    assert qf.image_areas == {"vl_area": 3136, "vae_area": 4096}
    vl, vae_in, (w, h) = qf.prepare_images([_image(200, 100, 13)])
    assert (w, h) == (96, 32) and vae_in[0].size == (96, 32)  # ~4096 px at 2:1, sides multiples of 32
    assert vl[0].size == calculate_dimensions(3136, 2.0)
    for bad, msg in (({"vl_area": 10}, "vl_area"), ({"size": 4096}, "unknown image_areas field"),
                     ({"vae_area": "big"}, "vae_area"), ([1], "must be an object")):  # fmt: skip
        (path / "qwenfast.json").write_text(json.dumps({"image_areas": bad}))
        with pytest.raises(ValueError, match=msg):
            QwenImageEditPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)


def test_edit_oom_backoff_splits_and_keeps_the_images(edit_plus, monkeypatch):
    """An OOM in a batch of edits splits it like text-to-image; the images equal the unsplit batch."""
    _, qf, _ = edit_plus
    img = _image(48, 40, 14)
    kw = {**KW, "negative_prompt": None, "true_cfg_scale": 1.0, "num_images_per_prompt": 2}
    kw.pop("prompt")
    prompts = ["make it red", "add a blue star"]
    want = qf(img, prompts, generator=torch.Generator().manual_seed(5), output_type="np", **kw).images
    real = qf._forward

    def tight(x, *a, **k):  # more than 2 images at once "does not fit"
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(x, *a, **k)

    monkeypatch.setattr(qf, "_forward", tight)
    out = qf(img, prompts, generator=torch.Generator().manual_seed(5), output_type="np", **kw)
    assert out.info["oom_backoff"] and "batch of 4" in out.info["oom_backoff"][0]
    assert out.images.shape == want.shape and np.abs(out.images - want).max() < 1e-5


def test_edit_offload_model_equals_no_offload(edit_plus):
    from qwenfast.pipeline.edit import QwenImageEditPipeline

    _, qf, path = edit_plus
    off = QwenImageEditPipeline.from_pretrained(path, device="cpu", dtype=torch.float32, offload="model")
    off.progress_bar = False
    assert off.offload == "model"
    img = _image(48, 48, 15)
    a = qf(img, generator=torch.Generator().manual_seed(2), output_type="np", **KW).images
    b = off(img, generator=torch.Generator().manual_seed(2), output_type="np", **KW).images
    assert np.abs(a - b).max() < 1e-5
