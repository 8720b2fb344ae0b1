"""Hostile and malformed requests against a live server: each gets the right 4xx with an OpenAI-shaped
error that says what is wrong, and the server keeps serving. Plus the API key; every ImageRequest field
wrong on both image endpoints of a text-to-image and an edit server; and no host paths in any answer.

The tests on `server`, `t2i_server` and `edit_server` run twice: against plain `qwenfast serve`
("local") and against the same app on a Ray Serve cluster ("ray": ingress + engine replica, see
qwenfast/server/ray_app.py and the `ray_serve` fixture in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import re
import struct
import tempfile
import types
import typing
import zlib
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwenfast.server.options import Limits, ServerConfig  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from qwenfast.server.schemas import ImageRequest, validate  # noqa: E402
from tests.test_server import OK, G, _image_bytes, _one_torch_thread, metric, running, write_lora  # noqa: E402, F401

E = "/v1/images/edits"


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module", params=["local", "ray"])
def backend(request):
    """Where the server fixtures run: one process (`running`) or a Ray Serve cluster (`ray_serve`)."""
    return request.getfixturevalue("ray_serve") if request.param == "ray" else None


RAY_FLAGS = {"device": "cpu", "dtype": "fp32", "num_cpus": 0.5, "ingress_cpus": 0.25}
RAY_PREFIX = {"hostile-t2i": "/", "hostile-edit": "/hostile-edit"}  # "/": paths like /files/../../x land in an app


@contextlib.contextmanager
def serving(backend, pipe, name: str, model: str | None = None, **cfg):
    """(base URL, app or None) of `pipe` served with ServerConfig(**cfg), in one process or on Ray as app
    `name` (deployed once per session: the first fixture to ask decides its LoRA folder)."""
    if backend is None:
        with running(pipe, **cfg) as (base, app):
            yield base, app
        return
    flags = {**RAY_FLAGS, "model": model, "lora_dir": cfg.get("lora_dir")}
    yield backend.deploy(name, flags, ServerConfig(**cfg), prefix=RAY_PREFIX[name]), None


@pytest.fixture(scope="module")
def server(pipe, backend, tmp_path_factory):
    """Small body limits (64 KiB JSON, 256 KiB uploads) keep the oversized cases cheap."""
    d = tmp_path_factory.mktemp("loras")
    write_lora(pipe, d / "style.safetensors")
    (d / "notes.txt").write_text("not a LoRA")
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with serving(backend, pipe, "hostile-t2i", max_batch=4, lora_dir=str(d), limits=lim) as (base, app):
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
    ("chunked body too large", "POST", G, {"content": (b'{"prompt": "', b"x" * (40 << 10), b"x" * (40 << 10), b'"}'),  # a tuple: chunked, and re-sent whole by each backend
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
    ("edits on a text-to-image model", "POST", E, {"data": {"prompt": "x", "size": "32x32"}, "files": {"image": ("a.png", PNG, "image/png")}}, 400),
]  # fmt: skip


ON_T2I = [c for c in HOSTILE if c[2] != E or c[0] == "edits on a text-to-image model"]
ON_EDIT = [c for c in HOSTILE if c[2] == E and c[0] != "edits on a text-to-image model"]


def _send_all(base: str, cases: list) -> list[str]:
    wrong = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for name, method, path, kw, want in cases:
            try:
                r = c.request(method, path, **kw)
                status, body = r.status_code, r.json()
            except httpx.TransportError as e:  # the server may close the socket on a huge upload
                wrong.append(f"{name}: transport error {e!r}")
                continue
            err = body.get("error", {}) if isinstance(body, dict) else {}
            if status != want or not err.get("message") or not err.get("type"):
                wrong.append(f"{name}: {status} {body}")
    return wrong


def test_hostile_requests_get_the_right_4xx_and_the_server_keeps_serving(server):
    base, app = server
    assert len(ON_T2I) >= 50
    wrong = _send_all(base, ON_T2I)
    assert not wrong, "\n".join(wrong)
    ok = httpx.post(base + G, json={**OK, "seed": 1}, timeout=60)
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


# ------------------------------------------------------------------ every field, every endpoint, both kinds
# Driven by ImageRequest's field list, so a field added there is covered here without editing this file.

DEMO_EDIT = Path(__file__).resolve().parent.parent / "qwenfast" / "assets" / "demo-edit"
EDIT_OK = {"prompt": "make the circle green", "size": "32x32", "steps": "1"}


def _kind(name: str):
    """'str' | 'int' | 'float' | 'bool' | 'literal' | 'list' for an ImageRequest field (Optional unwrapped)."""
    ann = ImageRequest.model_fields[name].annotation
    union = typing.get_origin(ann) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]
    (t,) = args
    if typing.get_origin(t) is typing.Literal:
        return "literal"
    if typing.get_origin(t) is list:
        return "list"
    return t.__name__


def _json_bad_values(name: str) -> list:
    """Wrong-typed and out-of-range JSON values for a field; none of them can be valid."""
    common = [{"x": 1}, [[1]]]
    k = _kind(name)
    if k == "str":  # too long for every text limit (prompt 4000, user 256), an unknown model, a bad size
        return [*common, 5, 1.5, True, "x" * 5000] + ([None, "", "   "] if name == "prompt" else [])
    if k == "int":
        return [*common, "1", 1.5, True, -1, 10**30, 2**63]
    if k == "float":
        return [*common, "2", True, -1, -1e300, 1e300]
    if k == "bool":
        return [*common, "true", 1, 0]
    if k == "literal":
        return [*common, "nope", "", 1, True]
    if k == "list":
        return [{"name": "style"}, "style", [1], [{}], [None], [{"name": 5}], [{"name": "style", "strength": "1"}],
                [{"name": "style", "strength": 1e300}], [{"name": "style", "extra": 1}], [{"name": "../x"}],
                [{"name": "nope"}], [{"name": "style"}] * 30]  # fmt: skip
    raise AssertionError(f"no bad values for {name} ({k}): add its kind to _json_bad_values")


def _form_bad_values(name: str) -> list[str]:
    """The same for a multipart text field (forms carry strings)."""
    k = _kind(name)
    if k == "str":
        return ["x" * 5000] + (["", "   "] if name == "prompt" else [])
    if k == "int":
        return ["", "abc", "1.5", "-1", "9" * 30, "9" * 5000, "1e3", "0x10"]
    if k == "float":
        return ["", "abc", "nan", "inf", "-inf", "-1", "1e300"]
    if k == "bool":
        return ["", "maybe", "2", "yes"]
    if k == "literal":
        return ["", "nope", "1"]
    if k == "list":
        return ["", "[{", "style", "[1]", "{}", '[{"name": 5}]', '[{"name": "style", "strength": NaN}]', "[" * 100000,
                '[{"name": "../x"}]']  # fmt: skip
    raise AssertionError(f"no bad values for {name} ({k})")


@pytest.fixture(scope="module")
def edit_model_pipe():
    return load_pipeline(str(DEMO_EDIT), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def t2i_server(pipe, backend, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras-matrix")
    write_lora(pipe, d / "style.safetensors")
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with serving(backend, pipe, "hostile-t2i", lora_dir=str(d), limits=lim) as (base, _):
        yield base


@pytest.fixture(scope="module")
def edit_server(edit_model_pipe, backend, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras-edit")
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    with serving(backend, edit_model_pipe, "hostile-edit", str(DEMO_EDIT), lora_dir=str(d), limits=lim) as (base, _):
        yield base


def test_hostile_edit_requests_on_an_edit_server(edit_server):
    """The multipart cases of HOSTILE, against a server that can edit (on a text-to-image server every
    edit request is 400 wrong_endpoint before its body is read)."""
    assert len(ON_EDIT) >= 12
    wrong = _send_all(edit_server, ON_EDIT)
    assert not wrong, "\n".join(wrong)


def _is_openai_error(r) -> str | None:
    """None if `r` is a < 500 answer whose body (for a 4xx) is OpenAI's error JSON; else what is wrong."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} without an OpenAI error body: {r.text[:200]}"
        if not (isinstance(err.get("message"), str) and err["message"] and isinstance(err.get("type"), str)
                and "code" in err and "param" in err):  # fmt: skip
            return f"{r.status_code} with a malformed error: {err}"
    return None


def _matrix_generations(base: str, ok: dict) -> list[str]:
    wrong = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for name in ImageRequest.model_fields:
            cases = [("missing", {k: v for k, v in ok.items() if k != name})] if name in ok else []
            cases += [(f"={json.dumps(v)[:40]}", {**ok, name: v}) for v in _json_bad_values(name)]
            for what, body in cases:
                if what == "missing" and name != "prompt":
                    continue  # optional: leaving it out is a valid request (it runs; covered by the other tests)
                r = c.post(G, json=body)
                if (why := _is_openai_error(r)) or r.status_code < 400:
                    wrong.append(f"{name} {what}: {why or r.status_code}")
    return wrong


def _matrix_edits(base: str) -> list[str]:
    wrong = []
    img = {"image": ("a.png", PNG, "image/png")}
    with httpx.Client(base_url=base, timeout=60) as c:
        cases = [("no image", EDIT_OK, {}), ("no prompt", {k: v for k, v in EDIT_OK.items() if k != "prompt"}, img),
                 ("mask", EDIT_OK, {**img, "mask": ("m.png", PNG, "image/png")}),
                 ("file in a text field", EDIT_OK, {**img, "prompt": ("p.txt", b"x", "text/plain")}),
                 ("unknown field", {**EDIT_OK, "stepz": "1"}, img)]  # fmt: skip
        for name in ImageRequest.model_fields:
            cases += [(f"{name}={v[:30]!r}", {**EDIT_OK, name: v}, img) for v in _form_bad_values(name)]
        for what, data, files in cases:
            r = c.post(E, data=data, files=files)
            if (why := _is_openai_error(r)) or r.status_code < 400:
                wrong.append(f"{what}: {why or r.status_code}")
        r = c.post(E, data=EDIT_OK, files=[("image", ("a.png", PNG, "image/png"))], headers={"x-test": "1"})
        r2 = c.post(E, content=b"--x\r\nbroken", headers={"content-type": "multipart/form-data; boundary=x"})
        r3 = c.post(E, content=b"", headers={"content-type": "multipart/form-data"})  # no boundary
        for what, rr in (("valid", r), ("truncated form", r2), ("no boundary", r3)):
            if why := _is_openai_error(rr):
                wrong.append(f"{what}: {why}")
    return wrong


def test_every_field_wrong_on_a_text_to_image_server(t2i_server):
    """Each ImageRequest field missing / wrong-typed / out of range, on both image endpoints: a 4xx
    with OpenAI's error JSON, never a 500 (edits on this server: 400 wrong_endpoint)."""
    assert len(ImageRequest.model_fields) >= 20
    wrong = _matrix_generations(t2i_server, OK) + _matrix_edits(t2i_server)
    assert not wrong, "\n".join(wrong)
    r = httpx.post(t2i_server + E, data=EDIT_OK, files={"image": ("a.png", PNG, "image/png")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_endpoint", r.text
    assert httpx.post(t2i_server + G, json={**OK, "seed": 1}, timeout=60).status_code == 200


def test_every_field_wrong_on_an_edit_server(edit_server):
    wrong = _matrix_generations(edit_server, {"prompt": "a red circle"}) + _matrix_edits(edit_server)
    assert not wrong, "\n".join(wrong)
    r = httpx.post(edit_server + E, data=EDIT_OK, files={"image": ("a.png", PNG, "image/png")}, timeout=60)
    assert r.status_code == 200 and r.json()["size"] == "32x32", r.text


def test_generations_on_an_edit_model_is_400_wrong_endpoint_with_or_without_size(edit_server):
    """Was: without `size`, a 500 `internal error: KeyError` (edit models have no default size)."""
    openai = pytest.importorskip("openai")
    for body in ({"prompt": "a red circle"}, {"prompt": "a red circle", "size": "32x32"}, {"prompt": 5}, {}):
        r = httpx.post(edit_server + G, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_endpoint", (body, r.text)
        assert "/v1/images/edits" in r.json()["error"]["message"]
    before = metric(
        httpx.get(edit_server + "/metrics").text,
        'qwenfast_requests_total{endpoint="generations",status="400"}',
    )
    cl = openai.OpenAI(base_url=edit_server + "/v1", api_key="x", max_retries=2)
    with pytest.raises(openai.BadRequestError, match="edit model"):
        cl.images.generate(prompt="a red circle")
    after = metric(
        httpx.get(edit_server + "/metrics").text,
        'qwenfast_requests_total{endpoint="generations",status="400"}',
    )
    assert after - before == 1  # the SDK did not retry


def test_validate_without_a_default_size_needs_size():
    from qwenfast.server.schemas import APIError

    with pytest.raises(APIError) as e:
        validate({"prompt": "x"}, Limits(), {"num_inference_steps": 2, "true_cfg_scale": 1.0})
    assert e.value.status == 400 and e.value.param == "size"
    p = validate(
        {"prompt": "x", "size": "32x48"}, Limits(), {"num_inference_steps": 2, "true_cfg_scale": 1.0}
    )
    assert (p.width, p.height, p.steps) == (32, 48, 2)


def test_edit_auto_size_beyond_the_limits_is_400(edit_server):
    """A 4096x1 input makes an 8192x32 output at the demo's area: over --max-size, so refused, not run."""
    thin = _image_bytes("PNG", (4096, 1))
    r = httpx.post(edit_server + E, data={"prompt": "make the circle green", "steps": "1"},
                   files={"image": ("a.png", thin, "image/png")}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    r = httpx.post(edit_server + E, data={"prompt": "make the circle green", "steps": "1", "size": "64x32"},
                   files={"image": ("a.png", thin, "image/png")}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind", ["t2i", "edit"])
def test_other_endpoints_never_500(kind, t2i_server, edit_server):
    base = t2i_server if kind == "t2i" else edit_server
    weird = [
        "",
        "x" * 3000,
        "%00",
        "..",
        "../../etc/passwd",
        "%2e%2e%2f",
        "a/b/c",
        "\u00fc\u2603",
        "%ff",
        "nul%00.png",
    ]
    wrong = []
    with httpx.Client(base_url=base, timeout=30) as c:
        reqs = [("GET", p) for p in ("/", "/health", "/metrics", "/v1/models", "/v1/loras", "/favicon.ico")]
        reqs += [
            (m, p)
            for m in ("POST", "PUT", "DELETE")
            for p in ("/", "/health", "/metrics", "/v1/models", "/v1/loras")
        ]
        reqs += [("GET", "/v1/models/" + w) for w in weird] + [("GET", "/files/" + w) for w in weird]
        reqs += [("GET", G), ("GET", E), ("PATCH", G), ("OPTIONS", E), ("HEAD", "/health")]
        for method, path in reqs:
            r = c.request(method, path, headers={"content-type": "application/json"}, content=b"{")
            if (
                why := _is_openai_error(r)
                if method != "HEAD"
                else (r.status_code >= 500 and str(r.status_code))
            ):
                wrong.append(f"{method} {path[:50]}: {why}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ no host paths in any answer
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?!v1/|files/)[\w.-]+/[\w./-]+")


def _no_host_paths(text: str, *paths) -> None:
    for p in (*paths, tempfile.gettempdir(), str(Path.home()), str(Path(__file__).resolve().parent.parent)):
        assert str(p) not in text, (p, text)
    assert not _ABS_PATH.search(text), text


def test_broken_lora_file_is_a_4xx_without_host_paths(pipe, tmp_path):
    d = tmp_path / "loras"
    d.mkdir()
    write_lora(pipe, d / "style.safetensors")
    good = (d / "style.safetensors").read_bytes()
    (d / "random.safetensors").write_bytes(bytes(range(256)) * 40)
    (d / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    (d / "empty.safetensors").write_bytes(b"")
    with running(pipe, lora_dir=str(d)) as (base, _):
        for name in ("random", "truncated", "empty"):
            for stream in (False, True):
                r = httpx.post(base + G, json={**OK, "stream": stream, "lora": [{"name": name}]}, timeout=60)
                text = r.text
                if stream:  # the error arrives as an SSE event
                    assert r.status_code == 200 and '"type": "error"' in text, text
                    err = json.loads(next(ln[6:] for ln in text.splitlines() if '"type": "error"' in ln))[
                        "error"
                    ]
                else:
                    assert 400 <= r.status_code < 500, (name, text)
                    err = r.json()["error"]
                assert (
                    err["code"] == "invalid_lora" and err["param"] == "lora" and repr(name) in err["message"]
                ), err
                _no_host_paths(text, d, tmp_path)
        # the failed loads changed nothing: plain and good-LoRA requests still work
        assert httpx.post(base + G, json={**OK, "seed": 1}, timeout=60).status_code == 200
        r = httpx.post(base + G, json={**OK, "seed": 1, "lora": [{"name": "style"}]}, timeout=60)
        assert r.status_code == 200, r.text


class _FailingPipe:
    """The real pipeline, except that a call raises an error whose text names a host file."""

    def __init__(self, pipe, exc):
        self._pipe, self._exc = pipe, exc

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __call__(self, *a, **kw):
        raise self._exc


def test_generation_failure_does_not_echo_host_paths(pipe, tmp_path):
    secret = tmp_path / "private" / "weights.safetensors"
    for exc in (
        OSError(f"[Errno 5] Input/output error: '{secret}'"),
        RuntimeError(f"failed to mmap {secret}"),
    ):
        with running(_FailingPipe(pipe, exc)) as (base, _):
            r = httpx.post(base + G, json=OK, timeout=60)
            assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed", r.text
            assert type(exc).__name__ in r.json()["error"]["message"]
            _no_host_paths(r.text, secret, tmp_path)
            r = httpx.post(base + G, json={**OK, "stream": True}, timeout=60)
            assert '"generation_failed"' in r.text
            _no_host_paths(r.text, secret, tmp_path)


def test_lora_dir_removed_after_start_lists_nothing(pipe, tmp_path):
    d = tmp_path / "gone"
    d.mkdir()
    write_lora(pipe, d / "style.safetensors")
    with running(pipe, lora_dir=str(d)) as (base, _):
        assert [x["id"] for x in httpx.get(base + "/v1/loras").json()["data"]] == ["style"]
        (d / "style.safetensors").unlink()
        d.rmdir()
        r = httpx.get(base + "/v1/loras")
        assert r.status_code == 200 and r.json()["data"] == []
        r = httpx.post(base + G, json={**OK, "lora": [{"name": "style"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
        _no_host_paths(r.text, d)


class _NoLoraPipe:
    """The real pipeline as a pipeline class that cannot apply LoRAs would be: no set_loras, and its
    capabilities say so."""

    def __init__(self, pipe):
        self._pipe = pipe

    @property
    def capabilities(self):
        import dataclasses

        return dataclasses.replace(self._pipe.capabilities, lora=False)

    def __getattr__(self, name):
        if name == "set_loras":
            raise AttributeError(name)
        return getattr(self._pipe, name)

    def __call__(self, *a, **kw):
        return self._pipe(*a, **kw)


def test_requests_that_can_never_succeed_are_non_retried_4xx(pipe, edit_server, tmp_path):
    """LoRAs on a pipeline without set_loras (was 501, which the OpenAI SDK retries) and a `mask` without
    transparency on edits: 400 with a code a client can act on (masks: tests/test_server_inpaint.py)."""
    d = tmp_path / "loras"
    d.mkdir()
    write_lora(pipe, d / "style.safetensors")
    with running(_NoLoraPipe(pipe), lora_dir=str(d)) as (base, _):
        r = httpx.post(base + G, json={**OK, "lora": [{"name": "style"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_unsupported", r.text
        assert httpx.post(base + G, json=OK, timeout=60).status_code == 200
    r = httpx.post(edit_server + E, data=EDIT_OK, files={"image": ("a.png", PNG, "image/png"),
                                                         "mask": ("m.png", PNG, "image/png")})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_mask", r.text
    assert "alpha" in r.json()["error"]["message"]


def test_a_size_far_from_the_trained_one_is_logged_once(pipe, caplog):
    """The demo is trained at 128x128: a 256x256 request is answered, and the server log says once why
    it will look like noise."""
    import logging

    from fastapi.testclient import TestClient

    from qwenfast.server.app import create_app
    from qwenfast.server.options import ServerConfig

    with caplog.at_level(logging.WARNING, logger="qwenfast.server"):
        with TestClient(create_app(pipe, ServerConfig())) as c:
            for _ in range(2):
                r = c.post("/v1/images/generations", json={"prompt": "a red circle", "size": "256x256", "steps": 1})
                assert r.status_code == 200
            r = c.post("/v1/images/generations", json={"prompt": "a red circle", "steps": 1})
            assert r.status_code == 200
    notes = [rec.getMessage() for rec in caplog.records if "trained at 128x128" in rec.getMessage()]
    assert len(notes) == 1 and "256x256" in notes[0]
