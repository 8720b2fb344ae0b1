"""Inpainting and img2img through the server (`POST /v1/images/edits` with `mask` / `strength`) on the
embedded demo models, CPU: the official `openai` client's `images.edit(image=..., mask=...)`, bad masks
(clear 400s, never a 500), edit-inpainting on the edit demo, and the web page's mask brush in
headless Chromium (screenshot: docs/server-inpaint.png with QWENFAST_UPDATE_SCREENSHOT=1).

OpenAI mask semantics: a PNG with an alpha channel and the image's size; transparent = repaint.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from PIL import Image, ImageDraw  # noqa: E402

from qwenfast.server.run import load_pipeline  # noqa: E402
from tests.test_server import (  # noqa: E402, F401
    _one_torch_thread,
    _open,
    assert_same_image,
    browser,
    png_pixels,
    running,
)

ROOT = Path(__file__).resolve().parent.parent
E = "/v1/images/edits"
BASE_PROMPT = "a small red circle at the top left, blue background"
INPAINT_PROMPT = "a small red circle at the top left and a large yellow square at the bottom right, blue background"


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _alpha_mask(size=(128, 128), box=(64, 64, 127, 127), mode="RGBA") -> bytes:
    """Opaque everywhere, transparent inside `box` (the part to repaint)."""
    m = Image.new("RGBA", size, (0, 0, 0, 255))
    if box is not None:
        ImageDraw.Draw(m).rectangle(box, fill=(0, 0, 0, 0))
    return _png(m if mode == "RGBA" else m.convert(mode))


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def base_image(pipe) -> Image.Image:
    """A picture the demo model draws: a red circle at the top left on blue."""
    return pipe(BASE_PROMPT, generator=torch.Generator().manual_seed(1), num_inference_steps=10).images[0]


@pytest.fixture(scope="module")
def server(pipe):
    with running(pipe) as (base, _):
        yield base


def _vae_round_trip(pipe, im: Image.Image) -> np.ndarray:
    """The image through the VAE and back (encode's mean, decode), as uint8 pixels."""
    x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    with torch.no_grad():
        mean, _ = pipe.vae.encode(x)
        y = pipe.vae.decode(mean)[0].permute(1, 2, 0).numpy()
    return ((y + 1) * 127.5).round().clip(0, 255).astype(np.uint8)


def test_openai_client_inpaints_the_masked_region_only(server, pipe, base_image):
    openai = pytest.importorskip("openai")
    cl = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    r = cl.images.edit(image=("in.png", _png(base_image), "image/png"), mask=("m.png", _alpha_mask(), "image/png"),
                       prompt=INPAINT_PROMPT, extra_body={"steps": 10, "seed": 3})  # fmt: skip
    assert len(r.data) == 1 and r.size == "128x128"
    got = png_pixels(r.data[0].b64_json).astype(float)
    src = np.asarray(base_image, dtype=float)
    keep = np.ones((128, 128), bool)
    keep[64 - 16 :, 64 - 16 :] = False  # the masked square and 16 px around it (the decoder's reach)
    rt = np.abs(_vae_round_trip(pipe, base_image).astype(float) - src)[keep].mean()
    kept = np.abs(got - src)[keep].mean()
    changed = np.abs(got - src)[72:, 72:].mean()
    assert kept <= 1.5 * rt + 0.5, (kept, rt)  # the rest: within the VAE's round-trip error
    assert changed > 20 * max(rt, 1.0), (changed, rt)  # the masked region: new content
    from qwenfast.demo import score

    checks = score.check(Image.fromarray(got.astype(np.uint8)), score.parse_prompt(INPAINT_PROMPT))
    assert all(checks.values()), checks  # the demo drew the square where the mask was
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle((64, 64, 127, 127), fill=255)
    want = pipe.for_task("inpaint")(INPAINT_PROMPT, negative_prompt=" ", image=base_image, mask_image=mask, strength=1.0,
                                    height=128, width=128, num_inference_steps=10,
                                    generator=torch.Generator("cpu").manual_seed(3))  # fmt: skip
    assert_same_image(got.astype(np.uint8), np.asarray(want.images[0]), "inpaint")


def test_img2img_through_strength(server, pipe, base_image):
    prompt = "a small green circle at the top left, blue background"
    r = httpx.post(server + E, data={"prompt": prompt, "strength": "0.7", "steps": "10", "seed": "2"},
                   files={"image": ("in.png", _png(base_image), "image/png")}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    want = pipe.for_task("img2img")(prompt, negative_prompt=" ", image=base_image, strength=0.7, height=128, width=128,
                                    num_inference_steps=10, generator=torch.Generator("cpu").manual_seed(2))  # fmt: skip
    assert_same_image(png_pixels(r.json()["data"][0]["b64_json"]), np.asarray(want.images[0]), "img2img")


def _bad(base: str, data: dict, files, code: str | None, what: str) -> None:
    r = httpx.post(base + E, data=data, files=files, timeout=60)
    assert r.status_code == 400, (what, r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and (code is None or err["code"] == code), (what, err)


def test_bad_masks_and_strengths_are_clear_400s(server, base_image):
    img = ("in.png", _png(base_image), "image/png")
    ok = {"prompt": "x", "steps": "1"}
    rgb = _png(Image.new("RGB", (128, 128)))
    cases = [
        ("mask of another size", ok, {"image": img, "mask": ("m.png", _alpha_mask((96, 128), (0, 0, 40, 40)), "image/png")}, "invalid_mask"),
        ("mask without alpha", ok, {"image": img, "mask": ("m.png", rgb, "image/png")}, "invalid_mask"),
        ("mask without transparency", ok, {"image": img, "mask": ("m.png", _alpha_mask(box=None), "image/png")}, "invalid_mask"),
        ("mask not an image", ok, {"image": img, "mask": ("m.png", b"not a png", "image/png")}, "invalid_mask"),
        ("mask empty", ok, {"image": img, "mask": ("m.png", b"", "image/png")}, "invalid_mask"),
        ("mask as text", {**ok, "mask": "yes"}, {"image": img}, "invalid_mask"),
        ("two masks", ok, [("image", img), ("mask", ("m.png", _alpha_mask(), "image/png"))] * 1
                          + [("mask", ("m2.png", _alpha_mask(), "image/png"))], "invalid_mask"),
        ("mask and two images", ok, [("image[]", img), ("image[]", img), ("mask", ("m.png", _alpha_mask(), "image/png"))], None),
        ("strength above 1", {**ok, "strength": "1.5"}, {"image": img}, "invalid_value"),
        ("strength nan", {**ok, "strength": "nan"}, {"image": img}, "invalid_value"),
        ("neither mask nor strength", ok, {"image": img}, "wrong_endpoint"),
        ("too small for the strength", {**ok, "strength": "0"}, {"image": img}, "invalid_value"),
    ]  # fmt: skip
    for what, data, files, code in cases:  # the last: strength 0 leaves no step (was a 500 in the worker)
        _bad(server, data, files, code, what)
    r = httpx.post(server + "/v1/images/generations", json={"prompt": "x", "strength": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength"
    assert httpx.get(server + "/health").json()["tasks"] == ["txt2img", "img2img", "inpaint"]


def test_edit_model_inpaints_with_a_mask(base_image):
    edit = load_pipeline(str(ROOT / "qwenfast" / "assets" / "demo-edit"), device="cpu", dtype="fp32")
    img = ("in.png", _png(base_image), "image/png")
    with running(edit) as (base, _):
        data = {"prompt": "make the circle green", "steps": "4", "seed": "5"}
        r = httpx.post(base + E, data=data, files={"image": img, "mask": ("m.png", _alpha_mask(box=(0, 0, 63, 63)),
                                                                        "image/png")}, timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["size"] == "128x128", r.text
        got = png_pixels(r.json()["data"][0]["b64_json"]).astype(float)
        assert np.abs(got - np.asarray(base_image, float))[96:, 96:].mean() < 8  # kept (far from the mask)
        _bad(base, {**data, "size": "64x64"}, {"image": img, "mask": ("m.png", _alpha_mask(), "image/png")},
             "invalid_size", "edit-inpaint with another size")  # fmt: skip
        _bad(base, {**data, "strength": "0.5"}, {"image": img}, None, "strength without a mask on an edit model")
        assert httpx.get(base + "/health").json()["tasks"] == ["edit", "edit-inpaint"]


def test_web_page_mask_brush_in_headless_chromium(server, browser, base_image, tmp_path):  # noqa: F811
    """Upload a picture, paint over its bottom right with the brush, generate: the request carries the
    painted mask (transparent where painted) and the result keeps the unpainted part."""
    src = tmp_path / "in.png"
    base_image.save(src)
    page, errors = _open(browser, server + "/", "demo-t2i")
    try:
        page.evaluate("""() => { const f = window.fetch; window.sent = [];  // the form fields each POST carries
            window.fetch = (u, o) => { if (o && o.body instanceof FormData) window.sent.push([u, [...o.body.keys()]]);
                                       return f(u, o); }; }""")
        page.wait_for_function("() => !document.getElementById('images').disabled")
        page.set_input_files("#images", str(src))
        page.wait_for_function("() => document.getElementById('mask-canvas').width === 128")
        page.fill("#brush", "40")
        page.locator("#mask-canvas").scroll_into_view_if_needed()  # the mouse only reaches what is in view
        box = page.locator("#mask-canvas").bounding_box()
        for fy in (0.6, 0.7, 0.8, 0.9):  # paint the bottom-right square, row by row
            page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * fy)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] * 0.92, box["y"] + box["height"] * fy, steps=5)
            page.mouse.up()
        page.fill("#prompt", INPAINT_PROMPT)
        page.fill("#seed", "3")
        page.click("#generate")
        page.wait_for_selector(".result img", timeout=120_000)
        assert page.inner_text("#status") == "done", page.inner_text("#message")
        sent = page.evaluate("window.sent")
        assert sent[0][0] == E and "mask" in sent[0][1] and "image[]" in sent[0][1] and "size" not in sent[0][1], sent
        import base64

        out = page.get_attribute(".result img", "src")
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.split(",", 1)[1]))).convert("RGB"), float)
        src_px = np.asarray(base_image, float)
        assert np.abs(img - src_px)[:40, :40].mean() < 4  # unpainted: kept
        assert np.abs(img - src_px)[90:118, 90:118].mean() > 30  # painted: repainted
        assert not errors, errors
        shot = tmp_path / "server-inpaint.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 5000
        if os.environ.get("QWENFAST_UPDATE_SCREENSHOT") == "1":
            (ROOT / "docs" / shot.name).write_bytes(shot.read_bytes())
    finally:
        page.context.close()
