"""numpy / torch / PIL images and masks mean in qwenfast what they mean in diffusers 0.42.1.

`qwenfast.pipeline.images.preprocess` against diffusers' own `VaeImageProcessor.preprocess` (configured
as each Qwen-Image pipeline configures it) on every input form: PIL, HxW / HxWxC / BxHxWxC arrays,
float [0, 1] and uint8 0/1 and 0/255 masks, CHW / BCHW tensors in [0, 1] and [-1, 1], lists, image
latents; then end to end: inpainting with numpy masks, img2img with a float array and with a
[-1, 1] tensor, a numpy ControlNet image and ControlNet-inpainting mask, each against diffusers'
pixels on tiny models, and the inputs qwenfast refuses where diffusers computes a wrong picture.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rgb(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _disc(w: int, h: int, cx: float, cy: float, r: float) -> np.ndarray:
    """HxW bool: a disc (repaint) on the rest (keep)."""
    y, x = np.mgrid[:h, :w]
    return (x - cx) ** 2 + (y - cy) ** 2 < r * r


def _diffusers_processor(spec):
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=spec.latent_channels,
                             do_normalize=spec.normalize, do_binarize=spec.binarize,
                             do_convert_grayscale=spec.grayscale)  # fmt: skip


def _cases():
    from PIL import Image

    rgb = _rgb(40, 24, 1)
    f = rgb.astype(np.float32) / 255
    disc = _disc(40, 24, 15, 10, 8)
    soft = np.clip(np.random.default_rng(2).random((24, 40)), 0, 1).astype(np.float32)
    return {
        "image": [
            ("PIL RGB", Image.fromarray(rgb)),
            ("list of PIL", [Image.fromarray(rgb), Image.fromarray(_rgb(40, 24, 3))]),
            ("HxWx3 float [0,1]", f),
            ("BxHxWx3 float64 [0,1]", np.stack([f, f[::-1]]).astype(np.float64)),
            ("list of HxWx3 float", [f, f[:, ::-1]]),
            ("CHW tensor [0,1]", torch.from_numpy(f).permute(2, 0, 1)),
            ("BCHW tensor [-1,1]", torch.from_numpy(f).permute(2, 0, 1)[None] * 2 - 1),
            ("latents (1, 16, 4, 6)", torch.randn(1, 16, 4, 6, generator=_gen())),
        ],
        "mask": [
            ("PIL L soft", Image.fromarray((soft * 255).astype(np.uint8))),
            ("PIL RGB", Image.fromarray(np.repeat((disc * 255).astype(np.uint8)[..., None], 3, -1))),
            ("HxW uint8 0/1", disc.astype(np.uint8)),
            ("HxW uint8 0/255", disc.astype(np.uint8) * 255),
            ("HxW float [0,1]", soft),
            ("HxWx1 float", soft[..., None]),
            ("BxHxW float", np.stack([soft, 1 - soft])),
            ("list of HxW uint8", [disc.astype(np.uint8), (~disc).astype(np.uint8)]),
            ("HW tensor float", torch.from_numpy(soft)),
            ("BHW tensor", torch.from_numpy(np.stack([soft, 1 - soft]))),
            ("B1HW tensor 0/255", torch.from_numpy(disc.astype(np.float32) * 255)[None, None]),
        ],
    }


@pytest.mark.parametrize("kind", ["image", "mask"])
def test_preprocess_is_diffusers_vae_image_processor(kind):
    """Every input form, at another size (so the resize matters): the same tensor as diffusers'."""
    from qwenfast.pipeline.images import IMAGE_LATENTS, MASK, preprocess

    spec = IMAGE_LATENTS if kind == "image" else MASK
    ref = _diffusers_processor(spec)
    for name, x in _cases()[kind]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # diffusers' [-1, 1] tensor deprecation notice
            want = ref.preprocess(x, height=40, width=64)
            got = preprocess(x, 40, 64, spec)
        assert tuple(got.shape) == tuple(want.shape), name
        assert torch.allclose(got.float(), want.float(), atol=1e-6), name
        if kind == "mask" and "soft" not in name:
            assert set(got.unique().tolist()) <= {0.0, 1.0} and got.max() == 1, name


def test_mask_conventions_are_diffusers_not_bytes():
    """A uint8 0/1 mask is a mask (qwenfast once read it as 0/255 bytes: nothing to repaint); 0/255 is the
    same mask; a float mask is binarised at 0.5."""
    from qwenfast.pipeline.images import MASK, preprocess

    disc = _disc(32, 32, 16, 16, 9)
    a = preprocess(disc.astype(np.uint8), 32, 32, MASK)
    b = preprocess(disc.astype(np.uint8) * 255, 32, 32, MASK)
    c = preprocess(disc.astype(np.float32) * 0.8, 32, 32, MASK)
    d = preprocess(disc, 32, 32, MASK)  # bool: qwenfast reads it as 0/1 (diffusers fails on it)
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert a.sum() == disc.sum() > 0


def test_refused_inputs_name_the_problem():
    from qwenfast.pipeline.images import IMAGE, MASK, preprocess

    with pytest.raises(ValueError, match="arr / 255"):  # diffusers would encode a blown-out picture
        preprocess(_rgb(32, 32, 0), 32, 32, IMAGE)
    with pytest.raises(ValueError, match="arr / 255"):
        preprocess(torch.from_numpy(_rgb(32, 32, 0)).permute(2, 0, 1), 32, 32, IMAGE)
    with pytest.raises(ValueError, match="batch of 32 masks"):  # diffusers reads HxWx3 as H masks
        preprocess(np.zeros((32, 32, 3), np.uint8), 32, 32, MASK)
    with pytest.raises(TypeError, match="PIL image, a path, a numpy array"):
        preprocess(3, 32, 32, IMAGE)
    with pytest.raises(ValueError, match="no such file"):
        preprocess("/nonexistent/picture.png", 32, 32, IMAGE)
    with pytest.raises(ValueError, match="empty list"):
        preprocess([], 32, 32, MASK)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def t2i(tiny_t2i):
    import diffusers

    from qwenfast import QwenImagePipeline

    ref, path = tiny_t2i
    q = QwenImagePipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    out = {}
    for task, cls in (("img2img", diffusers.QwenImageImg2ImgPipeline), ("inpaint", diffusers.QwenImageInpaintPipeline)):
        d = cls(**ref.components)
        d.set_progress_bar_config(disable=True)
        out[task] = (d, q.for_task(task))
    return out


KW = dict(prompt="a red circle on the left", negative_prompt=" ", true_cfg_scale=3.0, height=32, width=48,
          num_inference_steps=3, output_type="np")  # fmt: skip


def _pair(d, q, **kw):
    a = d(**{**KW, **kw}, generator=_gen()).images
    b = q(**{**KW, **kw}, generator=_gen()).images
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return a, b


@pytest.mark.parametrize("form", ["uint8 0/1", "uint8 0/255", "float [0,1]", "torch float"])
def test_inpaint_numpy_and_torch_masks_match_diffusers(t2i, form):
    d, q = t2i["inpaint"]
    disc = _disc(48, 32, 30, 14, 10)
    mask = {"uint8 0/1": disc.astype(np.uint8), "uint8 0/255": disc.astype(np.uint8) * 255,
            "float [0,1]": disc.astype(np.float32) * 0.9 + 0.05,
            "torch float": torch.from_numpy(disc.astype(np.float32))}[form]  # fmt: skip
    image = _rgb(48, 32, 4).astype(np.float32) / 255
    a, b = _pair(d, q, image=image, mask_image=mask, strength=0.9)
    assert np.abs(a - b).max() <= TOL
    other, _ = _pair(d, q, image=image, mask_image=(~disc).astype(np.uint8), strength=0.9)
    assert np.abs(other - a).max() >= 10 * TOL  # the mask matters


def test_img2img_float_array_tensor_and_latents_match_diffusers(t2i):
    d, q = t2i["img2img"]
    f = _rgb(40, 24, 5).astype(np.float32) / 255  # another size: nearest-neighbour resize, as diffusers
    kw = dict(strength=0.5)  # 3 steps: starts at the second one, so the picture is in the start point
    a, b = _pair(d, q, image=f, **kw)
    assert np.abs(a - b).max() <= TOL
    t = torch.from_numpy(f).permute(2, 0, 1)[None] * 2 - 1  # [-1, 1]: taken as it is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        c, e = _pair(d, q, image=t, **kw)
    assert np.abs(c - e).max() <= TOL and np.abs(c - a).max() <= 1e-5  # the same picture: not normalised twice
    flipped, _ = _pair(d, q, image=f[::-1].copy(), **kw)
    assert np.abs(flipped - a).max() >= 10 * TOL  # the picture matters
    z = torch.randn(1, 16, 4, 6, generator=_gen(9))  # image latents (B, 16, h, w) for 32x48
    g, h = _pair(d, q, image=z, **kw)
    assert np.abs(g - h).max() <= TOL and np.abs(g - a).max() >= 10 * TOL
    with pytest.raises(ValueError, match="arr / 255"):
        q(**KW, image=_rgb(48, 32, 5), **kw)


def test_controlnet_numpy_image_and_inpaint_numpy_mask(tiny_t2i, tmp_path):
    import diffusers

    from qwenfast import QwenImageControlNetInpaintPipeline, QwenImageControlNetPipeline
    from qwenfast.testing.tiny_control import build_controlnet

    ref, path = tiny_t2i
    dim = ref.text_encoder.config.text_config.hidden_size
    kw = {**KW, "num_inference_steps": 2}
    for cls, extra in (("QwenImageControlNetPipeline", 0), ("QwenImageControlNetInpaintPipeline", 4)):
        net = build_controlnet(dim, seed=3, extra_condition_channels=extra)
        net.save_pretrained(tmp_path / cls)
        d = getattr(diffusers, cls)(**ref.components, controlnet=net)
        d.set_progress_bar_config(disable=True)
        qcls = QwenImageControlNetPipeline if extra == 0 else QwenImageControlNetInpaintPipeline
        q = qcls.from_pretrained(path, controlnet=tmp_path / cls, device="cpu", dtype=torch.float32)
        q.set_progress_bar_config(disable=True)
        image = _rgb(40, 24, 6).astype(np.float32) / 255
        args = {"control_image": image}
        if extra:
            args["control_mask"] = _disc(40, 24, 12, 12, 8).astype(np.uint8)
        torch.manual_seed(1)  # the inpainting ControlNet samples the masked image's latents from the global RNG
        a = d(**kw, **args, generator=_gen()).images
        torch.manual_seed(1)
        b = q(**kw, **args, generator=_gen()).images
        assert np.isfinite(b).all() and np.abs(a - b).max() <= TOL, cls
        if extra:
            args["control_mask"] = 1 - args["control_mask"]
        else:
            args["control_image"] = image[::-1].copy()
        torch.manual_seed(1)
        moved = d(**kw, **args, generator=_gen()).images
        assert np.abs(moved - a).max() >= 10 * TOL, cls
