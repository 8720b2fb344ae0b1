"""`qwenfast serve --parallel`: one engine over several (CPU, gloo) processes; rank 0 answers HTTP and the
other ranks follow its calls (qwenfast/server/parallel.py). The images equal the one-process pipeline's,
for the demo model and for a Qwen-Image-2.1 folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from qwenfast.server.run import load_pipeline  # noqa: E402
from qwenfast.testing.parallel import free_port  # noqa: E402
from tests.test_server import alone, assert_same_image, png_pixels  # noqa: E402


def _serve(layout: str, port: int, model=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    where = [] if model is None else ["--model", str(model)]
    return subprocess.Popen([sys.executable, "-m", "qwenfast.cli", "serve", *where, "--device", "cpu", "--port",
                             str(port), "--parallel", layout, "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wait(proc: subprocess.Popen, url: str, timeout: float = 240) -> None:
    for _ in range(int(timeout / 0.5)):  # a hang guard counted in polls, not a wall-clock limit
        if proc.poll() is not None:
            raise AssertionError(f"serve --parallel exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("serve --parallel did not come up")


@pytest.mark.parametrize("layout", ["cfg=2", "ulysses=3"])  # the demo model has 3 heads
def test_serve_parallel_equals_one_process(layout):
    port = free_port()
    proc = _serve(layout, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, url)
        pipe = load_pipeline(None, "cpu", torch.float32)
        reqs = [dict(prompt="a small red circle at the top left, blue background", seed=3, negative_prompt=" "),
                dict(prompt="a large yellow star, black background", seed=11, negative_prompt=" ")]
        for body in reqs:
            r = httpx.post(url + "/v1/images/generations", timeout=300,
                           json={**body, "size": "64x64", "steps": 2, "response_format": "b64_json"})  # fmt: skip
            assert r.status_code == 200, r.text
            got = png_pixels(r.json()["data"][0]["b64_json"])
            want = alone(pipe, body["prompt"], body["seed"], 64, 64, negative=body["negative_prompt"])
            assert_same_image(got, want, f"{layout} {body['prompt']}")
        if layout == "cfg=2":  # CFG off = nothing to split: a clear 400, not a 500 or a hang
            r = httpx.post(url + "/v1/images/generations", timeout=60,
                           json={"prompt": "a circle", "size": "64x64", "steps": 2, "true_cfg_scale": 1})  # fmt: skip
            assert r.status_code == 400 and "cfg=2" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # the followers are still in step
    finally:
        _stop(proc)


def test_serve_parallel_qwen_image_2_1(tmp_path):
    """A Qwen-Image-2.1 folder served over 2 processes (ulysses=2; its prefix of text and condition
    tokens is whole on every rank): a generation with CFG and a 2-image RGBA edit equal the
    one-process pipeline's."""
    import io
    import json

    from PIL import Image

    from qwenfast.testing.tiny21 import build_tiny21_pipeline
    from tests.test_server21 import _differs, _pixels, _png, direct

    folder = tmp_path / "tiny21"
    build_tiny21_pipeline(folder, seed=0)
    (folder / "qwenfast.json").write_text(json.dumps({"defaults": {"output_resolution": 64}}))
    port = free_port()
    proc = _serve("ulysses=2", port, model=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, url)
        pipe = load_pipeline(str(folder), "cpu", torch.float32)
        body = {"prompt": "a red circle", "seed": 3, "size": "64x64", "steps": 2, "negative_prompt": " ",
                "true_cfg_scale": 2.0, "response_format": "b64_json"}  # fmt: skip
        r = httpx.post(url + "/v1/images/generations", json=body, timeout=300)
        assert r.status_code == 200, r.text
        want = direct(pipe, 3, prompt="a red circle", negative_prompt=" ", true_cfg_scale=2.0, height=64, width=64)
        assert_same_image(_pixels(r.json()["data"][0]["b64_json"])[0], want, "2.1 generation")
        a, b = _png(64, 48, seed=1, mode="RGBA"), _png(40, 40, seed=2)
        r = httpx.post(url + "/v1/images/edits", data={"prompt": "blend", "steps": "2", "seed": "4"},
                       files=[("image[]", ("a.png", a, "image/png")), ("image[]", ("b.png", b, "image/png"))],
                       timeout=300)  # fmt: skip
        assert r.status_code == 200, r.text
        images = [Image.open(io.BytesIO(a)), Image.open(io.BytesIO(b)).convert("RGB")]
        want = direct(pipe, 4, prompt="blend", image=images)
        got, mode = _pixels(r.json()["data"][0]["b64_json"])
        assert mode == "RGBA"
        assert_same_image(got, want, "2.1 edit")
        assert _differs(direct(pipe, 5, prompt="blend", image=images), want)  # the comparison could fail
    finally:
        _stop(proc)
