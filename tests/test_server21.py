"""`qwenfast serve --model <a Qwen-Image-2.1 folder>` on a tiny random 2.1 pipeline, CPU: one model for both
endpoints. Generations and edits (1, 3 and 10 images, RGB and RGBA, `image[]` as the openai client sends
them) give the pixels of `QwenImage21Pipeline` called directly with the same seed, size and steps; 11
images, masks, `strength` and a step cache are clear 400s; the hostile-request suite and the every-field
matrix of test_server_hostile.py never get a 5xx; /health, /v1/models and /metrics name the model type;
the CLI takes --lora and --preset turbo-8 for 2.1;
the web page offers optional reference images.

The folder's qwenfast.json sets `output_resolution` 128 (the default size of generations and the area
of edits), so every image here is <= 128² and 2 steps: the whole file costs seconds of CPU.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from qwenfast.server.options import Limits  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from tests.test_server import OK, G, _one_torch_thread, assert_same_image, browser, metric, running  # noqa: E402, F401
from tests.test_server_hostile import (  # noqa: E402
    EDIT_OK,
    HOSTILE,
    PNG,
    _is_openai_error,
    _matrix_edits,
    _matrix_generations,
    _send_all,
)

E = "/v1/images/edits"
RES = 128


def _pixels(b64: str) -> tuple[np.ndarray, str]:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    return np.asarray(im), im.mode


def _png(w: int, h: int, seed: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """Random pixels (half of an RGBA image's alpha random too): the tiny model reacts to them."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    if mode == "RGBA":
        arr[..., 3] = np.where(np.arange(w)[None, :] < w // 2, 255, rng.integers(0, 256, (h, w)))
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _write_lora(pipe, path) -> str:
    """A small LoRA on two shared layers of the 2.1 transformer (ComfyUI naming)."""
    from safetensors.torch import save_file

    g, sd = torch.Generator().manual_seed(1), {}
    for n in ("img_in", "proj_out"):
        m = pipe.transformer.get_submodule(n)
        sd[f"diffusion_model.{n}.lora_down.weight"] = torch.randn(4, m.in_features, generator=g) / m.in_features**0.5
        sd[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(m.out_features, 4, generator=g) * 0.5
        sd[f"diffusion_model.{n}.alpha"] = torch.tensor(4.0)
    save_file(sd, str(path))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny21"
    build_tiny21_pipeline(path, seed=0)
    (path / "qwenfast.json").write_text(json.dumps({"defaults": {"output_resolution": RES}}))
    return path


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(str(folder), device="cpu", dtype="fp32")  # what `qwenfast serve --model` loads


@pytest.fixture(scope="module")
def lora_dir(pipe, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras21")
    _write_lora(pipe, d / "style.safetensors")
    (d / "notes.txt").write_text("not a LoRA")
    return d


@pytest.fixture(scope="module")
def server(pipe, lora_dir):
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with running(pipe, max_batch=4, lora_dir=str(lora_dir), limits=lim) as (base, _):
        yield base


def direct(pipe, seed: int, steps: int = 2, **kw) -> np.ndarray:
    """QwenImage21Pipeline called directly, as uint8 pixels (RGBA)."""
    out = pipe(generator=torch.Generator("cpu").manual_seed(seed), num_inference_steps=steps, output_type="pil", **kw)
    return np.asarray(out.images[0])


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    """The comparisons allow 1 level: a change that matters must move some pixel by >= 10x that."""
    return a.shape != b.shape or np.abs(a.astype(int) - b.astype(int)).max() >= 10


# ------------------------------------------------------------------------------------------ generations
def test_generations_equal_the_pipeline(server, pipe):
    openai = pytest.importorskip("openai")
    cl = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    prompt = "a red circle on the left of a blue square"
    r = cl.images.generate(prompt=prompt, size="128x96", n=2, extra_body={"steps": 2, "seed": 5})  # one batch of 2
    assert r.size == "128x96" and len(r.data) == 2
    for i, d in enumerate(r.data):
        got, mode = _pixels(d.b64_json)
        assert mode == "RGBA" and got.shape == (96, 128, 4)  # the 2.1 VAE answers RGBA, as diffusers'
        assert_same_image(got, direct(pipe, 5 + i, prompt=prompt, height=96, width=128), f"image {i}")
    other = direct(pipe, 5, prompt="a green circle on the left of a blue square", height=96, width=128)
    assert _differs(other, _pixels(r.data[0].b64_json)[0])  # the comparison could fail

    r = httpx.post(server + G, json={"prompt": prompt, "steps": 2, "seed": 9}, timeout=60)  # no size
    assert r.status_code == 200 and r.json()["size"] == f"{RES}x{RES}", r.text  # output_resolution²
    assert_same_image(_pixels(r.json()["data"][0]["b64_json"])[0], direct(pipe, 9, prompt=prompt), "default size")


def test_streamed_previews_and_lora(server, pipe, lora_dir):
    events = []
    with httpx.stream("POST", server + G, json={"prompt": "a dog", "size": "64x64", "steps": 3, "seed": 2,
                                                "stream": True, "partial_images": 1}, timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds == ["image_generation.partial_image", "image_generation.completed"], events
    assert Image.open(io.BytesIO(base64.b64decode(events[0]["b64_json"]))).format == "JPEG"
    assert_same_image(_pixels(events[-1]["b64_json"])[0], direct(pipe, 2, steps=3, prompt="a dog", height=64, width=64))

    # the pipeline's own answer first (the server's worker is idle; it puts back its LoRA set per batch)
    plain = direct(pipe, 3, prompt=OK["prompt"], height=64, width=64)
    pipe.set_loras([(str(lora_dir / "style.safetensors"), 1.0)])
    try:
        want = direct(pipe, 3, prompt=OK["prompt"], height=64, width=64)
    finally:
        pipe.set_loras([])
    assert _differs(plain, want)
    r = httpx.post(server + G, json={**OK, "size": "64x64", "steps": 2, "seed": 3, "lora": [{"name": "style"}]},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    got = _pixels(r.json()["data"][0]["b64_json"])[0]
    r = httpx.post(server + G, json={**OK, "size": "64x64", "steps": 2, "seed": 3}, timeout=60)
    assert_same_image(_pixels(r.json()["data"][0]["b64_json"])[0], plain, "the LoRA taken off again")
    assert_same_image(got, want, "with the LoRA")


# ------------------------------------------------------------------------------------------ edits
@pytest.mark.parametrize("n", [1, 3, 10])
def test_edits_equal_the_pipeline(server, pipe, n):
    """`image[]` as the openai client sends a list; RGB, RGBA and JPEG uploads of different aspects. The
    output follows the last image's aspect at ~output_resolution² (size auto), RGBA as diffusers'."""
    openai = pytest.importorskip("openai")
    kinds = [("RGBA", "PNG"), ("RGB", "PNG"), ("RGB", "JPEG")]
    uploads = [_png(48 + 16 * (i % 3), 64 - 8 * (i % 2), seed=i, mode=kinds[i % 3][0], fmt=kinds[i % 3][1])
               for i in range(n)]  # fmt: skip
    cl = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    r = cl.images.edit(image=[(f"in{i}.png", b, "image/png") for i, b in enumerate(uploads)],
                       prompt="put them side by side", extra_body={"steps": 2, "seed": 7})  # fmt: skip
    got, mode = _pixels(r.data[0].b64_json)
    images = [Image.open(io.BytesIO(b)) for b in uploads]
    images = [im.convert("RGBA" if im.mode == "RGBA" else "RGB") for im in images]
    assert images[0].mode == "RGBA" and mode == "RGBA"
    want = direct(pipe, 7, prompt="put them side by side", image=images)
    assert r.size == f"{want.shape[1]}x{want.shape[0]}"
    assert_same_image(got, want, f"{n} images")
    # the comparison could fail: dropping the first upload's alpha (as the server did for Qwen-Image) moves it
    flat = direct(pipe, 7, prompt="put them side by side", image=[images[0].convert("RGB"), *images[1:]])
    assert _differs(flat, want)


def test_edit_with_a_size(server, pipe):
    a, b = _png(64, 48, seed=1, mode="RGBA"), _png(40, 40, seed=2)
    r = httpx.post(server + E, data={"prompt": "blend", "size": "96x64", "steps": "2", "seed": "4"},
                   files=[("image[]", ("a.png", a, "image/png")), ("image[]", ("b.png", b, "image/png"))], timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["size"] == "96x64", r.text
    want = direct(pipe, 4, prompt="blend", image=[Image.open(io.BytesIO(a)), Image.open(io.BytesIO(b)).convert("RGB")],
                  height=64, width=96)  # fmt: skip
    assert_same_image(_pixels(r.json()["data"][0]["b64_json"])[0], want, "sized edit")


def test_what_2_1_cannot_do_is_a_clear_400(server):
    img = ("a.png", PNG, "image/png")
    r = httpx.post(server + E, data={"prompt": "x", "steps": "1"}, files=[("image[]", img)] * 11, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "image" and "at most 10" in err["message"], r.text
    mask = _png(40, 40, seed=3, mode="RGBA")
    for data, files, param in (({"prompt": "x"}, {"image": img, "mask": ("m.png", mask, "image/png")}, "mask"),
                               ({"prompt": "x", "strength": "0.5"}, {"image": img}, "strength")):  # fmt: skip
        r = httpx.post(server + E, data=data, files=files, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and err["code"] == "unsupported_parameter", r.text
    r = httpx.post(server + G, json={**OK, "cache": "fast"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache", r.text
    assert httpx.post(server + G, json={**OK, "cache": "off", "seed": 1}, timeout=60).status_code == 200


# ------------------------------------------------------------------------------------------ hostile requests
def test_hostile_requests_never_5xx(server):
    """test_server_hostile.py's cases on both endpoints (all open on 2.1): each the same 4xx as on the
    Qwen-Image servers, except 4 images (fine here: 2.1 takes 10) and an edit without a mask or strength."""
    skip = {"edits 4 images", "edits on a text-to-image model"}
    wrong = _send_all(server, [c for c in HOSTILE if c[0] not in skip])
    assert not wrong, "\n".join(wrong)


def test_every_field_wrong_never_5xx(server):
    wrong = _matrix_generations(server, OK) + _matrix_edits(server)
    assert not wrong, "\n".join(wrong)
    r = httpx.post(server + E, data=EDIT_OK, files={"image": ("a.png", PNG, "image/png")}, timeout=60)
    assert r.status_code == 200 and r.json()["size"] == "32x32", r.text
    with httpx.Client(base_url=server, timeout=30) as c:
        for method, path in [("GET", p) for p in ("/", "/health", "/metrics", "/v1/models", "/v1/loras")]:
            assert not (why := _is_openai_error(c.request(method, path))), (path, why)


# ------------------------------------------------------------------------------------------ status endpoints
def test_health_models_and_metrics_name_the_model_type(server):
    h = httpx.get(server + "/health").json()
    assert h["model_type"] == "qwen-image-2.1" and h["kind"] == "text-to-image+edit"
    assert h["tasks"] == ["txt2img", "edit"] and h["max_images"] == 10 and h["limits"]["max_images"] == 10
    assert h["size_multiple"] == 32 and h["lora_support"]
    card = httpx.get(server + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny21" and card["model_type"] == "qwen-image-2.1"
    assert httpx.get(server + "/v1/models/tiny21").json()["model_type"] == "qwen-image-2.1"
    text = httpx.get(server + "/metrics").text
    assert metric(text, 'qwenfast_model_info{model="tiny21",type="qwen-image-2.1",kind="text-to-image+edit"}') == 1


def test_a_lower_image_limit_applies(pipe):
    with running(pipe, limits=Limits(max_images=2)) as (base, _):
        assert httpx.get(base + "/health").json()["max_images"] == 2
        r = httpx.post(base + E, data={"prompt": "x"}, files=[("image[]", ("a.png", PNG, "image/png"))] * 3)
        assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"], r.text


def test_ray_ingress_describes_the_same_model(folder, pipe):
    """Ray Serve's ingress holds no pipeline, only an engine replica's `describe()`: built from it, the app
    answers /health as the local one, and sizes (default, from the last image) come out the same."""
    pytest.importorskip("ray")
    from fastapi.testclient import TestClient

    from qwenfast.server.app import create_app
    from qwenfast.server.options import ServerConfig, config_from_args
    from qwenfast.server.ray_app import EngineReplica, args_from_dict
    from qwenfast.server.ray_remote import RemotePipe

    a = args_from_dict({"model": str(folder), "device": "cpu", "dtype": "fp32"})
    eng = EngineReplica(a, config_from_args(a))
    try:
        remote = RemotePipe(eng.describe())
    finally:
        eng.sched.stop(10)
    call = {"image": [Image.new("RGBA", (64, 40))], "height": None, "width": None}
    assert remote.output_size({}) == pipe.output_size({}) == (RES, RES)
    assert remote.output_size(call) == pipe.output_size(call) != (RES, RES)
    keys = ("kind", "model_type", "tasks", "max_images", "size_multiple", "defaults", "lora_support")
    health = []
    for p in (remote, pipe):
        with TestClient(create_app(p, ServerConfig())) as c:
            health.append({k: c.get("/health").json()[k] for k in keys})
    assert health[0] == health[1] and health[0]["model_type"] == "qwen-image-2.1"


# ------------------------------------------------------------------------------------------ start-up and CLI
def test_cli_2_1_takes_lora_and_turbo_presets(folder, pipe, lora_dir, tmp_path, capsys):
    from qwenfast.cli import main

    out = tmp_path / "x.png"
    lora = lora_dir / "style.safetensors"
    argv = ["generate", "a dog", "--model", str(folder), "--device", "cpu", "--dtype", "fp32", "--size", "64x64",
            "--seed", "3", "--preset", "turbo-8", "--lora", f"{lora}:0.5", "-o", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    im = Image.open(out)
    assert im.mode == "RGBA" and json.loads(im.text["loras"])[0]["strength"] == 0.5 and im.text["steps"] == "8"


def test_web_page_offers_reference_images(server, pipe, browser):  # noqa: F811 - the fixture
    """On a 2.1 server the page offers optional images (up to 10, from /health), no mask brush and no
    img2img strength; two uploads make an edit with the pipeline's pixels."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(server + "/")
        page.wait_for_function("() => document.getElementById('edit-note').textContent.includes('1 to 10')")
        assert not page.is_disabled("#images") and page.get_attribute("#width", "placeholder") == "auto"
        page.set_input_files("#images", [{"name": f"{i}.png", "mimeType": "image/png", "buffer": _png(48, 40, i)}
                                         for i in range(2)])  # fmt: skip
        assert not page.is_visible("#mask-box")
        page.fill("#prompt", "put them side by side")
        page.fill("#steps", "2")
        page.fill("#seed", "6")
        page.click("#generate")
        page.wait_for_selector(".result img", timeout=60_000)
        src = page.get_attribute(".result img", "src")
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))))
        images = [Image.open(io.BytesIO(_png(48, 40, i))).convert("RGB") for i in range(2)]
        assert_same_image(got, direct(pipe, 6, prompt="put them side by side", image=images), "web page edit")
        assert not errors, errors
    finally:
        page.context.close()
