"""The image server (`qwenfast serve`) on the embedded tiny model, CPU: the official `openai` client
against a live uvicorn server, hostile input, queue limits, cancellation, timeouts, graceful shutdown,
LoRA names and batching, edits, metrics, and whether a batched image equals the same request alone.

Servers run in-process (uvicorn in a thread, port 0) except the shutdown test, which needs a real
process to send SIGTERM to. `GatedPipe` holds the pipeline at its first step until the test opens
the gate, which makes queue states (running / queued / full) deterministic instead of timed.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from qwenfast.pipeline.tasks import task_class  # noqa: E402
from qwenfast.server.app import create_app  # noqa: E402
from qwenfast.server.loras import LoraResolver  # noqa: E402
from qwenfast.server.metrics import Metrics, gpu_memory  # noqa: E402
from qwenfast.server.options import Limits, ServerConfig  # noqa: E402
from qwenfast.server.run import load_pipeline, start_server, stop_server  # noqa: E402
from qwenfast.server.schemas import APIError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

G = "/v1/images/generations"
OK = {"prompt": "a cat", "size": "32x32", "steps": 1}


# ------------------------------------------------------------------------------------------ helpers
class GatedPipe:
    """A pipeline that waits for `gate` inside its first step callback; counts the steps it ran."""

    def __init__(self, pipe):
        self._pipe = pipe
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.steps: list[int] = []  # steps run, per call
        self.calls: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __call__(self, *args, callback=None, **kw):
        seen = []
        self.calls.append(
            {"prompts": kw.get("prompt"), "loras": dict(getattr(self._pipe, "loras", {}) or {})}
        )

        def cb(i, n, x):
            self.entered.set()
            assert self.gate.wait(60), "test gate never opened"
            seen.append(i)
            if callback is not None:
                callback(i, n, x)

        try:
            return self._pipe(*args, callback=cb, **kw)
        finally:
            self.steps.append(len(seen))


class LoggedPipe(GatedPipe):
    """A `GatedPipe` that logs (call, step) in the order the steps ended; with `hold_call`, that call's
    first step also waits for `release` (after setting `held`)."""

    def __init__(self, pipe, hold_call: int | None = None):
        super().__init__(pipe)
        self.log: list[tuple[int, int]] = []
        self.hold_call = hold_call
        self.held, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, callback=None, **kw):
        n = len(self.calls)

        def cb(i, k, x):
            if n == self.hold_call and i == 0:
                self.held.set()
                assert self.release.wait(60), "test gate never opened"
            self.log.append((n, i))
            if callback is not None:
                callback(i, k, x)

        return super().__call__(*args, callback=cb, **kw)


@contextlib.contextmanager
def running(pipe, **cfg):
    """(base URL, app) of a live server for `pipe`, stopped afterwards."""
    app = create_app(pipe, ServerConfig(**cfg))
    server, th, base = start_server(app)
    try:
        yield base, app
    finally:
        if isinstance(pipe, GatedPipe):
            pipe.gate.set()
        stop_server(server, th)


def png_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def alone(pipe, prompt, seed, w, h, steps=2, cfg=None, negative=" ") -> np.ndarray:
    """The request run by itself (batch of one) straight through the pipeline, as uint8 pixels."""
    cfg = pipe.defaults["true_cfg_scale"] if cfg is None else cfg  # the server's default too
    out = pipe(prompt=[prompt], negative_prompt=[negative] if negative is not None else None, height=h, width=w,
               num_inference_steps=steps, true_cfg_scale=cfg, generator=[torch.Generator("cpu").manual_seed(seed)],
               output_type="pil")  # fmt: skip
    return np.asarray(out.images[0])


def assert_same_image(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Equal, or (batch-variance of CPU BLAS in the transformer, see test_batched_equals_alone) off by
    one 8-bit level on a few pixels."""
    assert got.shape == want.shape, what
    d = np.abs(got.astype(int) - want.astype(int))
    assert d.max() <= 1 and (d > 0).mean() < 1e-3, (
        f"{what}: max diff {d.max()}, {(d > 0).sum()} values differ"
    )


def metric(text: str, series: str) -> float:
    """The value of one Prometheus series (name with its labels) in /metrics text; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def write_lora(pipe, path: Path, seed: int = 0) -> Path:
    """A small LoRA for the tiny model's transformer (module-name keys, as Lightning LoRAs ship)."""
    from safetensors.torch import save_file

    g, sd = torch.Generator().manual_seed(seed), {}
    for n in ("img_in", "txt_in", "proj_out", "transformer_blocks.0.img_mlp.net.2"):
        m = pipe.transformer.get_submodule(n)
        sd[f"{n}.lora_down.weight"] = torch.randn(4, m.in_features, generator=g) / m.in_features**0.5
        sd[f"{n}.lora_up.weight"] = torch.randn(m.out_features, 4, generator=g) * 0.3
        sd[f"{n}.alpha"] = torch.tensor(4.0)
    save_file(sd, str(path))
    return path


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models on CPU: one intra-op thread. With two, every small op waits for the second core,
    which on a shared 2-core runner makes these tests ~10x slower (measured 0.16 s vs 0.011 s per image)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, pipe):
    d = tmp_path_factory.mktemp("loras")
    write_lora(pipe, d / "style.safetensors")
    (d / "notes.txt").write_text("not a LoRA")
    return d


@pytest.fixture(scope="module")
def server(pipe, lora_dir):
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with running(pipe, max_batch=4, lora_dir=str(lora_dir), limits=lim) as (base, app):
        yield base, app


# ------------------------------------------------------------------------------------------ tests
def test_openai_client_generations(server, pipe):
    openai = pytest.importorskip("openai")
    base, _ = server
    cl = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in cl.models.list().data] == [Path(pipe.model_path).name]

    r = cl.images.generate(prompt="a red cat", size="48x32", n=2, extra_body={"steps": 2, "seed": 11})
    assert r.size == "48x32" and len(r.data) == 2
    for i, d in enumerate(r.data):
        im = Image.open(io.BytesIO(base64.b64decode(d.b64_json)))
        assert im.size == (48, 32) and im.text["seed"] == str(11 + i) and im.text["prompt"] == "a red cat"
        assert_same_image(
            np.asarray(im.convert("RGB")), alone(pipe, "a red cat", 11 + i, 48, 32), f"image {i}"
        )

    r = cl.images.generate(prompt="a red cat", size="32x32", response_format="url", output_format="jpeg",
                           extra_body={"steps": 2})  # fmt: skip
    got = httpx.get(r.data[0].url)
    assert got.status_code == 200 and got.headers["content-type"] == "image/jpeg"
    assert httpx.get(base + "/files/nope.png").status_code == 404

    kinds = []
    for ev in cl.images.generate(prompt="a red cat", size="64x64", stream=True, partial_images=2,
                                 extra_body={"steps": 6, "seed": 3}):  # fmt: skip
        kinds.append(ev.type)
        if ev.type == "image_generation.completed":
            final = png_pixels(ev.b64_json)
        else:
            assert Image.open(io.BytesIO(base64.b64decode(ev.b64_json))).format == "JPEG"
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert_same_image(final, alone(pipe, "a red cat", 3, 64, 64, steps=6), "streamed")

    with pytest.raises(openai.BadRequestError, match="multiples of 16"):
        cl.images.generate(prompt="x", size="50x64")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        cl.images.generate(prompt="x", model="dall-e-3")


def test_stream_progress_events_and_health(server):
    base, _ = server
    body = {"prompt": "a blue dog", "size": "32x32", "steps": 4, "stream": True, "progress": True}
    with httpx.stream("POST", base + "/v1/images/generations", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    types = [ln[6:].split('"type": "')[1].split('"')[0] for ln in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert types[0] == "image_generation.queued" and types[1] == "image_generation.started"
    assert types.count("image_generation.progress") == 4 and types[-1] == "image_generation.completed"
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["queue"] == {"requests": 0, "images": 0, "running": 0, "max": 64}
    page = httpx.get(base + "/")
    assert page.status_code == 200 and "<title>qwenfast</title>" in page.text


def _image_bytes(fmt="PNG", size=(40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "red").save(buf, format=fmt)
    return buf.getvalue()


def test_lora_names_resolve_only_inside_the_folder(tmp_path, lora_dir):
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x")
    r = LoraResolver(lora_dir)
    assert r.available() == ["style"]
    assert r.resolve("style") == lora_dir.resolve() / "style.safetensors"
    assert r.resolve("style.safetensors") == r.resolve("style")
    for bad in ("../secret", str(outside), "style/../../secret", "", " style", "sty le", "..", "~root"):
        with pytest.raises(APIError) as e:
            r.resolve(bad)
        assert e.value.status in (400, 404), bad
    with pytest.raises(APIError, match="without --lora-dir"):
        LoraResolver(None).resolve("style")
    assert r.resolve_all([("style", 0.5)]) == ((str(lora_dir.resolve() / "style.safetensors"), 0.5),)


def test_more_loras_than_max_loras_is_a_400(pipe, tmp_path):
    """max_loras + 1 distinct LoRAs that all exist: refused by the count limit (not by the duplicate-name
    check, nor as unknown names); exactly max_loras of them run."""
    n = Limits().max_loras
    for i in range(n + 1):
        write_lora(pipe, tmp_path / f"style{i}.safetensors", seed=i)
    names = [{"name": f"style{i}", "strength": 0.1} for i in range(n + 1)]
    try:
        with running(pipe, lora_dir=str(tmp_path)) as (base, _):
            r = httpx.post(base + G, json={**OK, "lora": names}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "lora" and f"names {n + 1} LoRAs; the limit is {n}" in err["message"], err
            ok = httpx.post(base + G, json={**OK, "lora": names[:n]}, timeout=60)
            assert ok.status_code == 200, ok.text
    finally:
        pipe.set_loras([])


def test_lora_requests_apply_and_never_share_a_batch(pipe, lora_dir):
    gated = GatedPipe(pipe)
    with running(gated, max_batch=4, lora_dir=str(lora_dir)) as (base, _):
        gated.gate.clear()
        send = Senders(base)
        send.start("first", {**OK, "seed": 9})
        assert gated.entered.wait(30)
        for k, b in (("plain", {**OK, "seed": 1}), ("lora", {**OK, "seed": 1, "lora": [{"name": "style", "strength": 0.7}]}),
                     ("plain2", {**OK, "seed": 2}), ("lora2", {**OK, "seed": 2, "lora": [{"name": "style", "strength": 0.7}]})):  # fmt: skip
            send.start(k, b)
        _wait(lambda: httpx.get(base + "/health").json()["queue"]["images"] == 4)
        gated.gate.set()
        send.join()
    res = send.res
    assert all(r.status_code == 200 for r in res.values()), {k: r.text[:200] for k, r in res.items()}
    # batches: [first], then [plain, plain2] without LoRA and [lora, lora2] with it, in arrival order
    calls = [(len(c["prompts"]), sorted(c["loras"].items())) for c in gated.calls]
    assert calls[0] == (1, []) and sorted(calls[1:]) == [(2, []), (2, [("style", 0.7)])]
    got = {k: png_pixels(r.json()["data"][0]["b64_json"]) for k, r in res.items()}
    assert not np.array_equal(got["plain"], got["lora"])
    pipe.set_loras([(str(lora_dir / "style.safetensors"), 0.7)])
    try:
        assert_same_image(got["lora2"], alone(pipe, OK["prompt"], 2, 32, 32, steps=1), "lora2")
    finally:
        pipe.set_loras([])
    assert_same_image(got["plain2"], alone(pipe, OK["prompt"], 2, 32, 32, steps=1), "plain2")


def _wait(cond, timeout=30.0):
    """Poll `cond` until true. A hang guard counted in polls, not a wall-clock limit: at most timeout/0.02
    polls 0.02 s apart, so a loaded machine, where each poll takes longer, gets longer, never flakes."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        time.sleep(0.02)
    assert cond(), f"condition not reached in {int(timeout / 0.02)} polls"


def test_queue_full_gives_429_with_retry_after(pipe):
    gated = GatedPipe(pipe)
    with running(gated, max_batch=1, max_queue=1) as (base, app):
        gated.gate.clear()
        res = []
        ts = [
            threading.Thread(
                target=lambda: res.append(httpx.post(base + G, json={**OK, "seed": 1}, timeout=60))
            )
        ]
        ts[0].start()
        assert gated.entered.wait(30)  # first request running (held), queue empty
        ts.append(
            threading.Thread(
                target=lambda: res.append(httpx.post(base + G, json={**OK, "seed": 2}, timeout=60))
            )
        )
        ts[1].start()
        _wait(lambda: app.state.scheduler.depth()[0] == 1)  # second queued: the queue is full
        r = httpx.post(base + G, json=OK)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        gated.gate.set()
        for t in ts:
            t.join()
    assert [x.status_code for x in res] == [200, 200]


def _raw_post(base: str, body: dict) -> socket.socket:
    """Send a request on a bare socket and return it unread: closing it is a client hanging up."""
    import json

    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {G} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return s


def test_timeout_and_disconnect_cancel_the_work(pipe):
    gated = GatedPipe(pipe)
    with running(gated, max_batch=1, timeout_s=2.0) as (base, app):
        gated.gate.clear()
        r = httpx.post(base + G, json={**OK, "steps": 30})  # held at step 1 past its 2 s timeout
        assert r.status_code == 504 and "did not finish within 2 s" in r.json()["error"]["message"]
        gated.gate.set()
        _wait(lambda: len(gated.steps) == 1)
        assert gated.steps == [1]  # the batch stopped at the first step after its only client left
        gated.entered.clear()
        gated.gate.clear()
        running_one = _raw_post(base, {**OK, "steps": 30, "seed": 1})
        assert gated.entered.wait(30)
        queued_one = _raw_post(base, {**OK, "steps": 30, "seed": 2})
        _wait(lambda: app.state.scheduler.depth() == (1, 1, 1))
        queued_one.close()
        _wait(lambda: app.state.scheduler.depth() == (0, 0, 1))  # the queued one is gone
        running_one.close()
        _wait(lambda: 'qwenfast_rejected_total{reason="disconnect"} 2' in httpx.get(base + "/metrics").text)
        gated.gate.set()
        _wait(lambda: len(gated.steps) == 2)
        assert gated.steps[1] == 1  # and the running one stopped at its next step
        assert metric(httpx.get(base + "/metrics").text, 'qwenfast_rejected_total{reason="timeout"}') == 1
        assert httpx.post(base + G, json={**OK, "seed": 1}).status_code == 200


def test_a_stream_client_gone_leaves_no_waiting_task(pipe):
    """A streaming client that hangs up while its request runs: the handler's wait on the job's event queue
    goes with it (was: the get task stayed pending after the handler was cancelled, and the garbage
    collector destroyed it later: "Task was destroyed but it is pending!" in a soak's log)."""
    import asyncio
    import gc

    gated = GatedPipe(pipe)
    gated.gate.clear()
    gc.disable()  # (a pending task in a garbage cycle stays visible until the collector runs)
    server, th, base = start_server(create_app(gated, ServerConfig(max_batch=1)))
    loop = server.servers[0].get_loop()

    def gets() -> int:  # the event-queue gets pending on the server's loop
        async def count():
            return sum("Queue.get" in repr(t.get_coro()) for t in asyncio.all_tasks())

        return asyncio.run_coroutine_threadsafe(count(), loop).result(10)

    try:
        client = _raw_post(base, {**OK, "steps": 30, "stream": True})
        assert gated.entered.wait(30)
        _wait(lambda: gets() == 1)  # the handler waits on its events
        client.close()
        _wait(lambda: 'qwenfast_rejected_total{reason="disconnect"} 1' in httpx.get(base + "/metrics").text)
        _wait(lambda: gets() == 0, timeout=5)
    finally:
        gc.enable()
        gated.gate.set()
        stop_server(server, th)


def test_n_images_split_over_batches_keep_their_seeds(pipe):
    with running(pipe, max_batch=2) as (base, _):
        r = httpx.post(base + G, json={"prompt": "three cats", "size": "32x48", "steps": 2, "n": 3, "seed": 40},
                       timeout=60)  # fmt: skip
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["seed"] for d in data] == [40, 41, 42]
    for d in data:
        assert_same_image(
            png_pixels(d["b64_json"]), alone(pipe, "three cats", d["seed"], 32, 48), str(d["seed"])
        )


def test_batched_equals_alone(pipe, monkeypatch):
    """Why a batched image may differ from the same request alone in the last bit, and that the
    server adds nothing to it.

    On CPU (MKL sgemm) a row of a small matrix product depends on how many rows the product has
    (M = 1..5 take other kernels than M >= 8): the transformer's per-image modulation and timestep
    linears have M = batch size. Prompts of different token lengths are padded and masked in a
    batch, which changes the attention reduction. Both are inside the model: ~3e-6 in [0, 1]
    pixels, i.e. an 8-bit level on ~0.01% of pixels. The VAE's convolutions are batch-variant too;
    the server decodes per image, so they do not count. With the small products computed row by
    row and equal-length prompts, a batch of 3 through the server is bit-identical to each alone.
    """
    gated = GatedPipe(pipe)

    def batch_of_three(prompts):
        with running(gated, max_batch=3) as (base, _):
            gated.gate.clear()
            gated.entered.clear()
            res = {}
            ts = [threading.Thread(target=lambda i=i, p=p: res.__setitem__(i, httpx.post(
                base + G, json={"prompt": p, "size": "64x32", "steps": 2, "seed": 100 + i}, timeout=60)))
                for i, p in enumerate(["warm-up", *prompts])]  # fmt: skip
            ts[0].start()
            assert gated.entered.wait(30)
            for t in ts[1:]:
                t.start()
            _wait(lambda: httpx.get(base + "/health").json()["queue"]["images"] == 3)
            gated.gate.set()
            for t in ts:
                t.join()
        assert len(gated.calls[-1]["prompts"]) == 3
        return {i: png_pixels(res[i].json()["data"][0]["b64_json"]) for i in (1, 2, 3)}

    mixed = ["a cat", "a very small blue cat on a long red road", "two dogs"]
    got = batch_of_three(mixed)
    for i, p in enumerate(mixed, 1):
        assert_same_image(got[i], alone(pipe, p, 100 + i, 64, 32), p)

    import torch.nn.functional as F

    linear = F.linear

    def rowwise(x, w, b=None):
        if x.dim() == 2 and x.shape[0] <= 64:
            return torch.cat([linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", rowwise)
    same_len = ["a red cat"] * 3
    got = batch_of_three(same_len)
    for i, p in enumerate(same_len, 1):
        assert np.array_equal(got[i], alone(pipe, p, 100 + i, 64, 32)), f"request {i} differs"


def test_metrics(server, pipe):
    base, _ = server
    httpx.post(base + G, json={**OK, "seed": 5}, timeout=60)
    text = httpx.get(base + "/metrics").text
    for name in ("qwenfast_queue_depth", "qwenfast_in_flight_requests", "qwenfast_request_duration_seconds_bucket",
                 "qwenfast_images_per_second", "qwenfast_batch_size_bucket", "qwenfast_images_generated_total",
                 "qwenfast_batch_duration_seconds_count"):  # fmt: skip
        assert name in text, name
    assert metric(text, "qwenfast_batch_size_count") >= 1
    assert metric(text, 'qwenfast_request_duration_seconds_count{endpoint="generations"}') >= 1
    # each successful request's latency split into its phases, which add up to it
    total = metric(text, 'qwenfast_request_duration_seconds_sum{endpoint="generations"}')
    count = metric(text, 'qwenfast_request_duration_seconds_count{endpoint="generations"}')
    parts = {ph: metric(text, f'qwenfast_request_phase_seconds_sum{{endpoint="generations",phase="{ph}"}}')
             for ph in ("queue", "generate", "encode", "other")}  # fmt: skip
    for ph in parts:
        assert (
            metric(text, f'qwenfast_request_phase_seconds_count{{endpoint="generations",phase="{ph}"}}')
            == count
        )
    assert parts["generate"] > 0 and parts["encode"] > 0
    assert sum(parts.values()) == pytest.approx(total, rel=1e-4, abs=1e-4 * count)
    # GPU memory gauges appear when the serving device is a CUDA one only (this server's pipe is on the CPU)
    assert ("qwenfast_gpu_memory_allocated_bytes" in text) == (torch.device(pipe.device).type == "cuda")
    assert gpu_memory("cpu") == {} and gpu_memory(None) == {}
    gauges = Metrics().render(0, 0, 0, {"allocated": 3 << 20, "total": 80 << 30})
    assert f"qwenfast_gpu_memory_allocated_bytes {3 << 20}\n" in gauges
    assert f"qwenfast_gpu_memory_total_bytes {80 << 30}\n" in gauges


@pytest.fixture(scope="module")
def edit_pipe(tmp_path_factory):
    assert task_class(None, "edit") is not None  # a registered pipeline runs edits: the server serves them
    pytest.importorskip("diffusers")
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny-edit-plus"
    build_tiny_pipeline(path, seed=0, edit="edit-plus")
    return load_pipeline(str(path), device="cpu", dtype="fp32")


def test_openai_client_edits(edit_pipe):
    """One image, one output: each edit call VAE-encodes its inputs at ~1024² area, seconds on CPU.
    (Several images arrive as `image[]`, parsed by the same code the hostile 4-image case checks.)"""
    openai = pytest.importorskip("openai")
    a = _image_bytes("JPEG", (48, 40))
    with running(edit_pipe, max_batch=4) as (base, _):
        cl = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = cl.images.edit(image=("a.jpg", a, "image/jpeg"), prompt="make it blue", size="32x32",
                           extra_body={"steps": 2, "seed": 4})  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="edit model"):
            cl.images.generate(prompt="x", size="32x32")
    assert len(r.data) == 1 and r.size == "32x32"
    want = edit_pipe(image=[Image.open(io.BytesIO(a)).convert("RGB")], prompt="make it blue", negative_prompt=" ",
                     height=32, width=32, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(4))  # fmt: skip
    assert_same_image(png_pixels(r.data[0].b64_json), np.asarray(want.images[0]), "edit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_graceful_shutdown_finishes_in_flight_work(tmp_path):
    """SIGTERM while 3 requests are queued or running: all 3 get their image, then the process exits."""
    port, log = _free_port(), tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "qwenfast.server", "--port", str(port), "--max-batch", "1",
                             "--log-level", "info", "--device", "cpu"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _health(base) is not None, timeout=120)
        res = []
        body = {"prompt": "a lighthouse", "size": "64x64", "steps": 60}
        ts = [threading.Thread(target=lambda s=s: res.append(httpx.post(base + G, json={**body, "seed": s}, timeout=120)))
              for s in range(3)]  # fmt: skip
        for t in ts:
            t.start()
        _wait(
            lambda: (h := _health(base)) is not None and h["queue"]["requests"] + h["queue"]["running"] == 3
        )
        proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join()
        # uvicorn re-raises the signal after its graceful shutdown, so "killed by SIGTERM" is the normal exit
        assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()
        assert "Application shutdown complete" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [r.status_code for r in res] == [200] * 3 and all(len(r.json()["data"]) == 1 for r in res)


def _health(base):
    try:
        return httpx.get(base + "/health", timeout=2).json()
    except httpx.TransportError:
        return None


# the page's placeholder prompt: one the embedded demo model draws
DEMO_PROMPT = "a small red circle at the top left, blue background"
BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium: playwright's own build if installed, else the system's (Debian: apt install
    chromium). Skipped only when neither exists; one that exists but cannot start fails the test."""
    pw = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    with pw.sync_playwright() as p:
        exe = None if Path(p.chromium.executable_path).exists() else next(
            (x for x in BROWSERS if Path(x).exists()), False
        )  # fmt: skip
        if exe is False:
            pytest.skip("no headless Chromium here: `playwright install chromium` or `apt install chromium`")
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _open(browser, url: str, model: str):
    """A fresh page (own storage) on `url`, once it has shown `model` from /health; and its JS errors."""
    ctx = browser.new_context(viewport={"width": 1100, "height": 700})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function(f"() => document.getElementById('model').textContent.includes({model!r})")
    return page, errors


BROKEN_IMAGES = """() => [...document.images].filter((i) => i.getClientRects().length > 0
    && !(i.complete && i.naturalWidth > 0)).length"""


def test_web_page_in_headless_chromium(server, browser, tmp_path):
    """Idle page: no broken image, a prompt the demo can draw, a favicon. Then type that prompt, see
    progress and previews, get the image (which the demo analyser checks against the prompt). The
    screenshot goes to tmp_path ($QWENFAST_ARTIFACTS too, if set); with QWENFAST_UPDATE_SCREENSHOT=1
    it replaces docs/server-page.png, the README's screenshot."""
    from qwenfast.demo import score

    base, _ = server
    page, errors = _open(browser, base + "/", "demo-t2i")
    try:
        assert page.evaluate(BROKEN_IMAGES) == 0  # was: a broken-image icon labelled "live preview"
        assert not page.is_visible("#preview") and page.is_visible("#no-preview")
        assert page.get_attribute("#prompt", "placeholder") == DEMO_PROMPT
        icon = page.get_attribute("link[rel=icon]", "href")
        r = httpx.get(base + icon)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(r.content)).size == (32, 32)
        assert (
            page.input_value("#width") == "128" and page.input_value("#steps") == "20"
        )  # the demo's defaults
        page.evaluate("""() => { window.seen = []; new MutationObserver(() => window.seen.push(
            document.getElementById('status').textContent)).observe(document.getElementById('status'),
            {childList: true, characterData: true, subtree: true}); }""")
        page.fill("#prompt", DEMO_PROMPT)
        page.fill("#seed", "7")
        page.click("#generate")
        page.wait_for_selector(".result img", timeout=60_000)
        seen = page.evaluate("window.seen")
        assert any(s.startswith("step ") for s in seen) and seen[-1] == "done", seen
        assert page.evaluate("document.getElementById('progress').value") == 20
        assert page.is_visible("#preview") and not page.is_visible("#no-preview")
        assert page.evaluate("document.getElementById('preview').src").startswith("data:image/")
        assert page.evaluate(BROKEN_IMAGES) == 0
        src = page.get_attribute(".result img", "src")
        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")
        assert img.size == (128, 128)
        checks = score.check(img, score.parse_prompt(DEMO_PROMPT))
        assert all(checks.values()), checks  # the placeholder is a prompt the demo model draws
        meta = page.inner_text(".result .meta")
        assert DEMO_PROMPT in meta and "seed 7" in meta and "128x128" in meta
        assert not errors, errors
        shot = tmp_path / "server-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 5000
        if os.environ.get("QWENFAST_UPDATE_SCREENSHOT") == "1":
            (ROOT / "docs" / shot.name).write_bytes(shot.read_bytes())
        if os.environ.get("QWENFAST_ARTIFACTS"):
            Path(os.environ["QWENFAST_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["QWENFAST_ARTIFACTS"]) / shot.name).write_bytes(shot.read_bytes())
    finally:
        page.context.close()


def test_web_page_with_api_key_asks_for_the_key_before_listing_loras(pipe, lora_dir, browser):
    """Was: "LoRA list: HTTP 401" on the idle page. Now the page says to enter the key, and lists the
    LoRAs once a key is typed; a wrong key is named as such."""
    with running(pipe, api_key="s3cret", lora_dir=str(lora_dir)) as (base, _):
        page, errors = _open(browser, base + "/", "demo-t2i")
        try:
            page.wait_for_function("() => document.getElementById('lora-note').textContent !== ''")
            body = page.inner_text("body")
            assert "401" not in body and "API key" in page.inner_text("#lora-note"), body
            assert page.is_visible("#api-key") and page.locator("#lora option").count() == 1
            page.fill("#api-key", "wrong")
            page.wait_for_function(
                "() => document.getElementById('lora-note').textContent.includes('not accepted')"
            )
            assert "401" not in page.inner_text("body")
            page.fill("#api-key", "s3cret")
            page.wait_for_function("() => document.getElementById('lora').options.length === 2")
            assert page.evaluate("[...document.getElementById('lora').options].map((o) => o.value)") == [
                "",
                "style",
            ]
            assert page.inner_text("#lora-note") == ""
            assert not errors, errors
        finally:
            page.context.close()


def test_web_page_on_an_edit_model_suggests_an_edit(browser):
    edit = load_pipeline(str(ROOT / "qwenfast" / "assets" / "demo-edit"), device="cpu", dtype="fp32")
    with running(edit) as (base, _):
        page, errors = _open(browser, base + "/", "demo-edit")
        try:
            page.wait_for_function(
                "() => document.getElementById('prompt').placeholder === 'make the circle green'"
            )
            assert page.evaluate(BROKEN_IMAGES) == 0 and not errors, errors
            assert (
                page.input_value("#width") == ""
                and page.get_attribute("#width", "placeholder") == "from image"
            )
        finally:
            page.context.close()


def test_previews_are_decoded_only_for_streaming_clients(pipe, monkeypatch):
    """partial_images without stream: nobody receives previews, so none is decoded (was: one VAE
    decode per preview, thrown away)."""
    calls = []
    real = pipe.preview_images

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(pipe, "preview_images", counting)
    with running(pipe) as (base, _):
        r = httpx.post(base + G, json={**OK, "steps": 4, "partial_images": 2}, timeout=60)
        assert r.status_code == 200 and calls == []
        r = httpx.post(base + G, json={**OK, "steps": 4, "partial_images": 2, "stream": True}, timeout=60)
        assert r.text.count("event: image_generation.partial_image") == 2 and len(calls) == 2


def test_step_cache_per_request(pipe):
    """`cache` per request: a cached image equals the pipeline's with that preset; requests with and
    without a cache never share a batch; the server's own default stays as it was."""
    body = {**OK, "steps": 12, "size": "64x64"}
    with running(pipe, max_batch=4) as (base, _):
        res = {k: httpx.post(base + G, json=b, timeout=120) for k, b in (
            ("off", {**body, "seed": 3}), ("fast", {**body, "seed": 3, "cache": "fast"}),
            ("bad", {**body, "cache": "fastest"}), ("off2", {**body, "seed": 3}))}  # fmt: skip
    assert res["bad"].status_code == 400 and res["bad"].json()["error"]["param"] == "cache"
    got = {k: png_pixels(res[k].json()["data"][0]["b64_json"]) for k in ("off", "fast", "off2")}
    assert not np.array_equal(got["off"], got["fast"])
    np.testing.assert_array_equal(got["off2"], got["off"])  # each batch sets its own policy back
    assert pipe.options.cache is None
    assert_same_image(got["off"], alone(pipe, OK["prompt"], 3, 64, 64, steps=12), "off")
    pipe.configure(cache="fast")
    try:
        assert_same_image(got["fast"], alone(pipe, OK["prompt"], 3, 64, 64, steps=12), "fast")
    finally:
        pipe.configure(cache=None)


class Senders:
    """Requests sent from threads against a running server: `start(key, body, queued=n)` sends one and,
    with `queued`, returns once the server's queue holds n images; `join()` waits for all; `res` holds the
    answers by key and `done` the keys in the order they were answered."""

    def __init__(self, base: str):
        self.base, self.res, self.done, self.threads = base, {}, [], []

    def start(self, key: str, body: dict, queued: int | None = None) -> None:
        def send():
            self.res[key] = httpx.post(self.base + G, json=body, timeout=60)
            self.done.append(key)

        self.threads.append(threading.Thread(target=send))
        self.threads[-1].start()
        if queued is not None:
            _wait(lambda: httpx.get(self.base + "/health").json()["queue"]["images"] == queued)

    def join(self) -> None:
        for t in self.threads:
            t.join()
        self.threads.clear()


def test_a_short_request_runs_between_two_steps_of_a_long_batch(pipe):
    """Interleaving (batcher._interleave): a 1-step request that arrives while a 4-step batch runs is
    answered before it, between two of its steps, and both images equal their requests run alone."""
    gated = GatedPipe(pipe)
    with running(gated, max_batch=4) as (base, app):
        gated.gate.clear()
        send = Senders(base)
        send.start("long", {**OK, "seed": 3, "steps": 4})
        assert gated.entered.wait(30)  # in the long batch's first step
        send.start("short", {**OK, "seed": 5, "steps": 1}, queued=1)
        gated.gate.set()
        send.join()
        metrics = httpx.get(base + "/metrics").text
    res = send.res
    assert res["long"].status_code == 200 and res["short"].status_code == 200
    assert send.done == ["short", "long"] and gated.steps == [1, 4]  # the short one ended first, inside
    assert "qwenfast_interleaved_batches_total 1" in metrics
    for k, seed, steps in (("long", 3, 4), ("short", 5, 1)):
        got = png_pixels(res[k].json()["data"][0]["b64_json"])
        assert_same_image(got, alone(pipe, OK["prompt"], seed, 32, 32, steps=steps), k)


def test_every_waiting_short_batch_runs_in_one_pause(pipe):
    """Two short requests that cannot share a batch (1 and 2 steps), queued while a 4-step batch runs:
    both run between its first and second steps, not one per step (which held the second for a whole
    step of the long batch); all three images as alone."""

    gated = LoggedPipe(pipe)
    with running(gated, max_batch=4) as (base, app):
        gated.gate.clear()
        send = Senders(base)
        send.start("long", {**OK, "seed": 3, "steps": 4})
        assert gated.entered.wait(30)
        send.start("one", {**OK, "seed": 5, "steps": 1}, queued=1)
        send.start("two", {**OK, "seed": 6, "steps": 2}, queued=2)
        gated.gate.set()
        send.join()
        interleaved = app.state.metrics.interleaved
    assert interleaved == 2 and send.done == ["one", "two", "long"]
    assert gated.log == [(0, 0), (1, 0), (2, 0), (2, 1), (0, 1), (0, 2), (0, 3)], gated.log
    for k, seed, steps in (("long", 3, 4), ("one", 5, 1), ("two", 6, 2)):
        assert send.res[k].status_code == 200
        got = png_pixels(send.res[k].json()["data"][0]["b64_json"])
        assert_same_image(got, alone(pipe, OK["prompt"], seed, 32, 32, steps=steps), k)


def test_a_short_request_runs_inside_a_batch_that_runs_inside_a_long_one(pipe):
    """Two levels of interleaving (`Scheduler.nesting`): a 3-step batch runs between two steps of an
    8-step one, and a 1-step request queued during the 3-step batch's first step runs between two of its
    steps (one level deep, it waited for the 3-step batch's whole run); all three images as alone."""

    held = LoggedPipe(pipe, hold_call=1)  # the nested batch waits in its first step for the short request
    with running(held, max_batch=4) as (base, app):
        held.gate.clear()
        send = Senders(base)
        send.start("long", {**OK, "seed": 3, "steps": 8})
        assert held.entered.wait(30)
        send.start("mid", {**OK, "seed": 5, "steps": 3}, queued=1)
        held.gate.set()
        assert held.held.wait(30)
        send.start("short", {**OK, "seed": 6, "steps": 1}, queued=1)
        held.release.set()
        send.join()
        interleaved = app.state.metrics.interleaved
    assert interleaved == 2 and send.done == ["short", "mid", "long"], send.done
    assert held.log[:5] == [(0, 0), (1, 0), (2, 0), (1, 1), (1, 2)], held.log
    assert held.log[5:] == [(0, i) for i in range(1, 8)], held.log
    for k, seed, steps in (("long", 3, 8), ("mid", 5, 3), ("short", 6, 1)):
        assert send.res[k].status_code == 200
        got = png_pixels(send.res[k].json()["data"][0]["b64_json"])
        assert_same_image(got, alone(pipe, OK["prompt"], seed, 32, 32, steps=steps), k)


def test_the_pause_budget_bounds_interleaving_not_the_long_requests_age(pipe):
    """The bound on interleaving is the time a running batch has spent paused for shorter ones
    (`--age-bound`), not how long its request waited: a long batch whose request is older than the bound
    still lets a short request through; with the budget at zero it never pauses. Images as alone."""
    gated = GatedPipe(pipe)
    for bound, want in ((0.3, ["short", "long"]), (0.0, ["long", "short"])):
        with running(gated, max_batch=4, age_bound_s=bound) as (base, app):
            gated.gate.clear()
            gated.entered.clear()
            send = Senders(base)
            send.start("long", {**OK, "seed": 3, "steps": 4})
            assert gated.entered.wait(30)
            time.sleep(0.5)  # the long request is now older than the 0.3 s bound
            send.start("short", {**OK, "seed": 5, "steps": 1}, queued=1)
            gated.gate.set()
            send.join()
            interleaved = app.state.metrics.interleaved
        assert send.done == want, (bound, send.done)
        assert interleaved == (1 if bound else 0)
        for k, seed, steps in (("long", 3, 4), ("short", 5, 1)):
            assert send.res[k].status_code == 200
            got = png_pixels(send.res[k].json()["data"][0]["b64_json"])
            assert_same_image(got, alone(pipe, OK["prompt"], seed, 32, 32, steps=steps), f"{k} at {bound}")


def test_a_short_request_runs_between_two_cached_steps_and_short_ones_start_first(pipe):
    """A long batch with the step cache (`cache: fast`) is interleaved too, its cache bypassed for the
    short request (pipe.step_cache_bypassed): both images equal their requests run alone. And when the
    GPU frees up, the waiting request with the fewest steps starts first, not the oldest."""
    gated = GatedPipe(pipe)
    long_body = {**OK, "seed": 3, "steps": 12, "cache": "fast"}
    with running(gated, max_batch=4) as (base, app):
        gated.gate.clear()
        send = Senders(base)
        send.start("long", long_body)
        assert gated.entered.wait(30)
        send.start("short", {**OK, "seed": 5, "steps": 2}, queued=1)
        gated.gate.set()
        send.join()
        # shortest first at a batch boundary: hold the worker in a 3-step batch, queue a 3-step then a
        # 2-step request (no interleaving: neither is shorter than what the running batch has left)
        gated.gate.clear()
        gated.entered.clear()
        send.start("hold", {**OK, "seed": 1, "steps": 3})
        assert gated.entered.wait(30)
        send.done.clear()
        send.start("older", {**OK, "seed": 2, "steps": 3, "prompt": "a dog"}, queued=1)
        send.start("newer", {**OK, "seed": 4, "steps": 2, "prompt": "a fox"}, queued=2)
        gated.gate.set()
        send.join()
    res, done = send.res, send.done
    assert all(r.status_code == 200 for r in res.values())
    assert gated.steps[:2] == [2, 12]  # the short one ran inside the cached one
    assert done.index("newer") < done.index("older") and gated.steps[2:] == [3, 2, 3]
    pipe.configure(cache="fast")
    try:
        want_long = alone(pipe, OK["prompt"], 3, 32, 32, steps=12)
    finally:
        pipe.configure(cache=None)
    assert_same_image(png_pixels(res["long"].json()["data"][0]["b64_json"]), want_long, "long")
    assert_same_image(
        png_pixels(res["short"].json()["data"][0]["b64_json"]),
        alone(pipe, OK["prompt"], 5, 32, 32, steps=2),
        "short",
    )
