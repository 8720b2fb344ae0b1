"""Hostile and malformed requests against a live server: each gets the right 4xx with an OpenAI-shaped
error that says what is wrong, and the server keeps serving. Plus the API key."""

from __future__ import annotations

import struct
import zlib

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwenfast.server.options import Limits  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from tests.test_server import OK, G, _image_bytes, _one_torch_thread, metric, running, write_lora  # noqa: E402, F401

E = "/v1/images/edits"


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory):
    """Small body limits (64 KiB JSON, 256 KiB uploads) keep the oversized cases cheap."""
    d = tmp_path_factory.mktemp("loras")
    write_lora(pipe, d / "style.safetensors")
    (d / "notes.txt").write_text("not a LoRA")
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with running(pipe, max_batch=4, lora_dir=str(d), limits=lim) as (base, app):
        yield base, app


def _png_bomb() -> bytes:
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 999))
        + chunk(b"IEND", b"")
    )


PNG = _image_bytes()
HOSTILE = [
    # (name, method, path, request kwargs, expected status)
    ("empty body", "POST", G, {"content": b"", "headers": {"content-type": "application/json"}}, 400),
    ("broken json", "POST", G, {"content": b'{"prompt": "x",', "headers": {"content-type": "application/json"}}, 400),
    ("json array", "POST", G, {"json": ["a cat"]}, 400),
    ("json null", "POST", G, {"json": None}, 400),
    ("json string", "POST", G, {"json": "a cat"}, 400),
    ("NaN literal", "POST", G, {"content": b'{"prompt": "x", "true_cfg_scale": NaN}', "headers": {"content-type": "application/json"}}, 400),
    ("inf number", "POST", G, {"content": b'{"prompt": "x", "true_cfg_scale": 1e999}', "headers": {"content-type": "application/json"}}, 400),
    ("deep nesting", "POST", G, {"content": b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", "headers": {"content-type": "application/json"}}, 400),
    ("not utf-8", "POST", G, {"content": b'{"prompt": "\xff\xfe"}', "headers": {"content-type": "application/json"}}, 400),
    ("lone surrogate", "POST", G, {"content": b'{"prompt": "a \\ud800 cat"}', "headers": {"content-type": "application/json"}}, 400),
    ("missing prompt", "POST", G, {"json": {"size": "32x32"}}, 400),
    ("prompt int", "POST", G, {"json": {"prompt": 5}}, 400),
    ("prompt list", "POST", G, {"json": {"prompt": ["a", "b"]}}, 400),
    ("prompt null", "POST", G, {"json": {"prompt": None}}, 400),
    ("prompt blank", "POST", G, {"json": {"prompt": "   "}}, 400),
    ("prompt too long", "POST", G, {"json": {"prompt": "cat " * 400}}, 400),
    ("negative int", "POST", G, {"json": {**OK, "negative_prompt": 3}}, 400),
    ("n string", "POST", G, {"json": {**OK, "n": "2"}}, 400),
    ("n bool", "POST", G, {"json": {**OK, "n": True}}, 400),
    ("n float", "POST", G, {"json": {**OK, "n": 2.0}}, 400),
    ("n zero", "POST", G, {"json": {**OK, "n": 0}}, 400),
    ("n negative", "POST", G, {"json": {**OK, "n": -1}}, 400),
    ("n huge", "POST", G, {"json": {**OK, "n": 10**30}}, 400),
    ("steps zero", "POST", G, {"json": {**OK, "steps": 0}}, 400),
    ("steps negative", "POST", G, {"json": {**OK, "steps": -5}}, 400),
    ("steps huge", "POST", G, {"json": {**OK, "steps": 10**6}}, 400),
    ("steps string", "POST", G, {"json": {**OK, "steps": "8"}}, 400),
    ("seed negative", "POST", G, {"json": {**OK, "seed": -1}}, 400),
    ("seed 2^64", "POST", G, {"json": {**OK, "seed": 2**64}}, 400),
    ("seed float", "POST", G, {"json": {**OK, "seed": 1.5}}, 400),
    ("cfg string", "POST", G, {"json": {**OK, "true_cfg_scale": "4"}}, 400),
    ("cfg negative", "POST", G, {"json": {**OK, "true_cfg_scale": -1}}, 400),
    ("cfg huge", "POST", G, {"json": {**OK, "true_cfg_scale": 1e9}}, 400),
    ("size garbage", "POST", G, {"json": {**OK, "size": "big"}}, 400),
    ("size zero", "POST", G, {"json": {**OK, "size": "0x0"}}, 400),
    ("size huge", "POST", G, {"json": {**OK, "size": "100000x100000"}}, 400),
    ("size too wide", "POST", G, {"json": {**OK, "size": "4096x16"}}, 400),
    ("size not multiple", "POST", G, {"json": {**OK, "size": "65x64"}}, 400),
    ("size int", "POST", G, {"json": {**OK, "size": 512}}, 400),
    ("size negative", "POST", G, {"json": {**OK, "size": "-64x64"}}, 400),
    ("response_format xml", "POST", G, {"json": {**OK, "response_format": "xml"}}, 400),
    ("output_format gif", "POST", G, {"json": {**OK, "output_format": "gif"}}, 400),
    ("compression 101", "POST", G, {"json": {**OK, "output_format": "jpeg", "output_compression": 101}}, 400),
    ("compression on png", "POST", G, {"json": {**OK, "output_compression": 50}}, 400),
    ("stream string", "POST", G, {"json": {**OK, "stream": "yes"}}, 400),
    ("partial_images 9", "POST", G, {"json": {**OK, "stream": True, "partial_images": 9}}, 400),
    ("transparent background", "POST", G, {"json": {**OK, "background": "transparent"}}, 400),
    ("unknown field", "POST", G, {"json": {**OK, "stepz": 3}}, 400),
    ("input_fidelity on generations", "POST", G, {"json": {**OK, "input_fidelity": "high"}}, 400),
    ("unknown model", "POST", G, {"json": {**OK, "model": "dall-e-3"}}, 404),
    ("lora not a list", "POST", G, {"json": {**OK, "lora": "style"}}, 400),
    ("lora path traversal", "POST", G, {"json": {**OK, "lora": [{"name": "../../../etc/passwd"}]}}, 400),
    ("lora absolute path", "POST", G, {"json": {**OK, "lora": [{"name": "/etc/passwd"}]}}, 400),
    ("lora subfolder", "POST", G, {"json": {**OK, "lora": [{"name": "a/b"}]}}, 400),
    ("lora dotdot", "POST", G, {"json": {**OK, "lora": [{"name": ".."}]}}, 400),
    ("lora hidden", "POST", G, {"json": {**OK, "lora": [{"name": ".style"}]}}, 400),
    ("lora backslash", "POST", G, {"json": {**OK, "lora": [{"name": "..\\style"}]}}, 400),
    ("lora NUL", "POST", G, {"json": {**OK, "lora": [{"name": "style\u0000.txt"}]}}, 400),
    ("lora encoded dots", "POST", G, {"json": {**OK, "lora": [{"name": "%2e%2e%2fstyle"}]}}, 400),
    ("lora non-lora file", "POST", G, {"json": {**OK, "lora": [{"name": "notes"}]}}, 404),
    ("lora unknown", "POST", G, {"json": {**OK, "lora": [{"name": "nope"}]}}, 404),
    ("lora strength huge", "POST", G, {"json": {**OK, "lora": [{"name": "style", "strength": 1e9}]}}, 400),
    ("lora twice", "POST", G, {"json": {**OK, "lora": [{"name": "style"}, {"name": "style"}]}}, 400),
    ("lora extra key", "POST", G, {"json": {**OK, "lora": [{"name": "style", "path": "/etc"}]}}, 400),
    ("text/plain", "POST", G, {"content": b'{"prompt": "x"}', "headers": {"content-type": "text/plain"}}, 415),
    ("form-urlencoded", "POST", G, {"data": {"prompt": "x"}}, 415),
    ("body too large", "POST", G, {"json": {"prompt": "x" * (70 << 10)}}, 413),
    ("chunked body too large", "POST", G, {"content": iter([b'{"prompt": "', b"x" * (40 << 10), b"x" * (40 << 10), b'"}']),
                                           "headers": {"content-type": "application/json"}}, 413),  # fmt: skip
    ("GET on POST endpoint", "GET", G, {}, 405),
    ("unknown path", "GET", "/v1/nothing", {}, 404),
    ("unknown model card", "GET", "/v1/models/gpt-4", {}, 404),
    ("edits with json", "POST", E, {"json": {"prompt": "x"}}, 415),
    ("edits without image", "POST", E, {"data": {"prompt": "x"}, "files": {"unused": ("a.txt", b"x", "text/plain")}}, 400),
    ("edits non-image", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.png", b"hello world", "image/png")}}, 400),
    ("edits gif", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.gif", _image_bytes("GIF"), "image/gif")}}, 400),
    ("edits pixel bomb", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.png", _png_bomb(), "image/png")}}, 400),
    ("edits truncated png", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.png", PNG[: len(PNG) // 2], "image/png")}}, 400),
    ("edits oversized upload", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.png", b"\0" * (300 << 10), "image/png")}}, 413),
    ("edits 4 images", "POST", E, {"data": {"prompt": "x"}, "files": [("image[]", ("a.png", PNG, "image/png"))] * 4}, 400),
    ("edits mask", "POST", E, {"data": {"prompt": "x"}, "files": {"image": ("a.png", PNG, "image/png"), "mask": ("m.png", PNG, "image/png")}}, 400),
    ("edits n not a number", "POST", E, {"data": {"prompt": "x", "n": "two"}, "files": {"image": ("a.png", PNG, "image/png")}}, 400),
    ("edits lora bad json", "POST", E, {"data": {"prompt": "x", "lora": "[{"}, "files": {"image": ("a.png", PNG, "image/png")}}, 400),
    ("edits missing prompt", "POST", E, {"files": {"image": ("a.png", PNG, "image/png")}}, 400),
    ("edits on a text-to-image model", "POST", E, {"data": {"prompt": "x", "size": "32x32"}, "files": {"image": ("a.png", PNG, "image/png")}}, 501),
]  # fmt: skip


def test_hostile_requests_get_the_right_4xx_and_the_server_keeps_serving(server):
    base, app = server
    assert len(HOSTILE) >= 50
    wrong = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for name, method, path, kw, want in HOSTILE:
            try:
                r = c.request(method, path, **kw)
                status, body = r.status_code, r.json()
            except httpx.TransportError as e:  # the server may close the socket on a huge upload
                wrong.append(f"{name}: transport error {e!r}")
                continue
            err = body.get("error", {}) if isinstance(body, dict) else {}
            if status != want or not err.get("message") or not err.get("type"):
                wrong.append(f"{name}: {status} {body}")
        assert not wrong, "\n".join(wrong)
        ok = c.post(G, json={**OK, "seed": 1})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    text = httpx.get(base + "/metrics").text
    assert metric(text, 'qwenfast_requests_total{endpoint="generations",status="400"}') >= 40


def test_api_key(pipe):
    with running(pipe, api_key="s3cret") as (base, _):
        body = {**OK, "seed": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "Bearer"}, {"Authorization": "s3cret"}):  # fmt: skip
            r = httpx.post(base + G, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/health").status_code == 200  # health and metrics stay open for probes
        r = httpx.post(base + G, json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
