"""`qwenfast serve --parallel`: one engine over several (CPU, gloo) processes; rank 0 answers HTTP and the
other ranks follow its calls (qwenfast/server/parallel.py). The images equal the one-process pipeline's.
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


def _serve(layout: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "qwenfast.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--parallel", layout, "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait(proc: subprocess.Popen, url: str, timeout: float = 240) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
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
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
