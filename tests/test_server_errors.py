"""The server's error codes: one table (qwenfast/server/errors.py), every code the source uses is in it
with its status, no error is answered with `"code": null`, and docs/serving-errors.md is the table.
The hostile-request suites of tests/test_server_hostile.py run again here against local servers, and
every error answer they get is checked against the table."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from qwenfast.server.errors import DEFAULT_CODE, ERRORS, markdown_table  # noqa: E402
from qwenfast.server.schemas import APIError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "qwenfast" / "server"


def _api_error_calls():
    """(file, enclosing function, status or None, code or None) of every `APIError(...)` in the server."""
    for path in sorted(SERVER.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "APIError":
                fn = node
                while fn in parents and not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = parents[fn]
                status = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                code = next((k.value.value for k in node.keywords if k.arg == "code"
                             and isinstance(k.value, ast.Constant)), None)  # fmt: skip
                yield path.name, getattr(fn, "name", "<module>"), status, code


def test_every_code_the_server_uses_is_in_the_table_with_its_status():
    calls = list(_api_error_calls())
    assert len(calls) > 60
    wrong = [c for c in calls if c[3] is not None and (c[3] not in ERRORS or (c[2] is not None and ERRORS[c[3]][0] != c[2]))]
    assert not wrong, wrong
    # no code named: only where the status is not known in the source (framework HTTP errors, a replica's error)
    unnamed = {(f, fn) for f, fn, _, code in calls if code is None}
    assert unnamed == {("app.py", "_http"), ("ray_remote.py", "api_error")}, unnamed
    literal = [m for p in SERVER.glob("*.py") for m in __import__("re").findall(r'"code": "(\w+)"', p.read_text())]
    assert literal and all(c in ERRORS for c in literal), literal


def test_codes_are_never_null():
    for status, code in DEFAULT_CODE.items():
        assert ERRORS[code][0] == status
    for status in (400, 401, 404, 405, 409, 413, 415, 418, 422, 429, 500, 502, 503, 504):
        e = APIError(status, "x")
        assert e.code in ERRORS and e.body()["error"]["code"] == e.code
    with pytest.raises(ValueError, match="not in qwenfast/server/errors.py"):
        APIError(400, "x", code="invalid_image_format")  # the old name: README documents invalid_image


def test_the_docs_page_is_the_table():
    page = (ROOT / "docs" / "serving-errors.md").read_text(encoding="utf-8")
    assert markdown_table() in page


# ------------------------------------------------------------------------------------ live: no null codes
@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Every response the hostile suites get from a local text-to-image and a local edit server."""
    import tests.test_server_hostile as H
    from qwenfast.server.options import Limits
    from qwenfast.server.run import load_pipeline
    from tests.test_server import running, write_lora

    seen: list[httpx.Response] = []
    real = httpx.Client.send

    def send(self, request, **kw):
        r = real(self, request, **kw)
        seen.append(r)
        return r

    mp = pytest.MonkeyPatch()
    mp.setattr(httpx.Client, "send", send)
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    try:
        pipe = load_pipeline(None, device="cpu", dtype="fp32")
        d = tmp_path_factory.mktemp("loras")
        write_lora(pipe, d / "style.safetensors")
        (d / "notes.txt").write_text("not a LoRA")
        with running(pipe, max_batch=4, lora_dir=str(d), limits=lim) as (base, _):
            wrong = H._send_all(base, H.ON_T2I) + H._matrix_generations(base, H.OK)
            r = httpx.post(base + "/v1/images/edits", data={"prompt": "x", "strength": "0", "steps": "2"},
                           files={"image": ("a.png", H.PNG, "image/png")})  # fmt: skip
            strength = r.json()
        edit = load_pipeline(str(H.DEMO_EDIT), device="cpu", dtype="fp32")
        with running(edit, lora_dir=str(tmp_path_factory.mktemp("none")), limits=lim) as (base, _):
            wrong += H._send_all(base, H.ON_EDIT) + H._matrix_edits(base)
    finally:
        mp.undo()
    return seen, wrong, strength


def test_hostile_suites_never_see_a_null_code(answers):
    seen, wrong, _ = answers
    assert not wrong, "\n".join(wrong)
    errors = [r for r in seen if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json")]
    assert len(errors) > 150
    bad = []
    for r in errors:
        err = r.json()["error"]
        if err.get("code") not in ERRORS or ERRORS[err["code"]][0] != r.status_code:
            bad.append(f"{r.request.method} {r.request.url.path} {r.status_code}: {json.dumps(err)[:200]}")
    assert not bad, "\n".join(bad)
    codes = {r.json()["error"]["code"] for r in errors}
    assert {"invalid_image", "too_many_images", "missing_required_parameter", "string_above_max_length",
            "unsupported_parameter", "not_found", "method_not_allowed"} <= codes, codes  # fmt: skip


def test_server_names_its_fields_in_the_strength_rule(answers):
    *_, strength = answers
    err = strength["error"]
    assert err == {"message": "`strength` 0 with 2 steps leaves 0 denoising steps; raise `strength` or `steps`",
                   "type": "invalid_request_error", "param": "strength", "code": "invalid_value"}  # fmt: skip
