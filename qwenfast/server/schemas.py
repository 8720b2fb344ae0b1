"""Request parsing and validation, and the OpenAI error shape.

Why strict: a request that says `"n": "2"` or `"step": 8` (typo) is far more often a client bug
than an intent, and silently coercing or ignoring it hides the bug. So types are strict, unknown
fields are refused by name, and every refusal says which parameter and why, in OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) so OpenAI clients raise a readable exception.
OpenAI parameters that do not apply here (`quality`, `style`, `moderation`, `user`, ...) are
accepted and ignored, so existing clients work unchanged.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .. import validation as V
from ..validation import MAX_SEED
from .errors import ERRORS, default_code
from .options import Limits

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 501: "not_implemented_error",
          503: "server_error", 504: "timeout_error"}  # fmt: skip


class APIError(Exception):
    """An error answered to the client as OpenAI-shaped JSON with `status`; `code` is one of errors.ERRORS
    (None: the table's code for `status`), never null in the answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        code = code or default_code(status)
        if code not in ERRORS:  # a bug: every code lives in qwenfast/server/errors.py (tested)
            raise ValueError(f"error code {code!r} is not in qwenfast/server/errors.py's ERRORS table")
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class LoraRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    strength: float = 1.0


class ImageRequest(BaseModel):
    """Fields of /v1/images/generations and /v1/images/edits (OpenAI's, then qwenfast's own)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = None
    stream: bool | None = None
    partial_images: int | None = None
    background: Literal["auto", "opaque"] | None = None  # no transparency: the VAE makes RGB
    # accepted and ignored (they steer OpenAI's models, not this one)
    quality: Literal["low", "medium", "high", "auto", "standard", "hd"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["low", "auto"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    input_fidelity: Literal["low", "high"] | None = None  # edits only
    # qwenfast extensions
    progress: bool | None = None  # stream: also send queued/started/progress events (not OpenAI types)
    negative_prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    true_cfg_scale: float | None = None
    lora: list[LoraRef] | None = None
    cache: Literal["off", "balanced", "fast"] | None = None  # step cache for this request (lossy)
    strength: float | None = (
        None  # edits: img2img / inpainting, 0..1 of the schedule run (default 1 with a mask)
    )


FORM_TYPES: dict[str, type] = {"n": int, "output_compression": int, "partial_images": int, "seed": int, "steps": int,
                               "true_cfg_scale": float, "stream": bool, "progress": bool, "lora": list,
                               "strength": float}  # fmt: skip


@dataclass
class Params:
    """A validated request, with every default filled in."""

    prompt: str
    negative: str | None
    width: int
    height: int
    steps: int
    cfg: float
    n: int
    seed: int
    response_format: str = "b64_json"
    output_format: str = "png"
    compression: int | None = None
    stream: bool = False
    progress: bool = False
    partial_images: int = 0
    loras: list[tuple[str, float]] = field(default_factory=list)
    size_auto: bool = False  # edits: size taken from the input image
    cache: str | None = None  # step-cache preset; None = the server's default (--cache)
    strength: float | None = None  # edits on a text-to-image model (img2img) or with a mask (inpainting)

    def seeds(self) -> list[int]:
        """Image i's seed: seed + i (validation.image_seeds, the CLI's and the ComfyUI nodes' rule too)."""
        return V.image_seeds(self.seed, self.n, MAX_SEED)


def parse_json_body(raw: bytes) -> dict:
    """JSON object or APIError(400). NaN/Infinity and absurd nesting are refused, not crashed on."""
    if not raw.strip():
        raise APIError(
            400,
            'the request body is empty; send a JSON object such as {"prompt": "a red fox"}',
            code="invalid_json",
        )

    def no_constants(c):
        raise ValueError(f"{c} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError) as e:
        raise APIError(
            400, f"the request body is not acceptable JSON: {str(e)[:200]}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object, got a JSON {type(body).__name__}",
            code="invalid_json",
        )
    return body


def form_to_dict(fields: dict[str, str]) -> dict[str, Any]:
    """Multipart text fields -> typed values (forms carry only strings)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        t = FORM_TYPES.get(k)
        try:
            if t is int:
                out[k] = int(v.strip())
            elif t is float:
                out[k] = float(v.strip())
            elif t is bool:
                if v.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[k] = v.strip().lower() in ("true", "1")
            elif t is list:
                out[k] = json.loads(v)
            else:
                out[k] = v
        except (ValueError, json.JSONDecodeError, RecursionError):
            kind = {int: "a whole number", float: "a number", bool: "true or false", list: "a JSON list"}[t]
            raise APIError(
                400, f"`{k}` must be {kind}, got {v[:50]!r}", param=k, code="invalid_type"
            ) from None
    return out


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "body"
    top = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        return APIError(
            400,
            f"unknown parameter `{loc}` (see the API docs for the accepted fields)",
            param=top,
            code="unknown_parameter",
        )
    if err["type"] == "missing":
        return APIError(
            400, f"missing required parameter `{loc}`", param=top, code="missing_required_parameter"
        )
    got = err.get("input")
    got = (
        ""
        if isinstance(got, (dict, list))
        else f", got {json.dumps(got)[:60] if _jsonable(got) else repr(got)[:60]}"
    )
    return APIError(400, f"invalid `{loc}`: {err['msg']}{got}", param=top, code="invalid_value")


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


def _check_text(name: str, s: str, limit: int) -> None:
    if len(s) > limit:
        raise APIError(
            400,
            f"`{name}` is {len(s)} characters; the limit is {limit}",
            param=name,
            code="string_above_max_length",
        )
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400, f"`{name}` holds invalid Unicode (a lone surrogate)", param=name, code="invalid_value"
        ) from None


def _range(name: str, v, lo, hi, what: str = "") -> None:
    try:
        V.check_range(f"`{name}`", v, lo, hi, what)  # the rules the CLI applies too (qwenfast/validation.py)
    except ValueError as e:
        raise APIError(400, str(e), param=name, code="invalid_value") from None


def _rule(check, name: str, v, *limits) -> None:
    """One of qwenfast/validation.py's rules (shared with the CLI) as a 400 naming `name`."""
    try:
        check(v, *limits, name=f"`{name}`")
    except ValueError as e:
        raise APIError(400, str(e), param=name, code="invalid_value") from None


def validate(body: dict, limits: Limits, defaults: dict, *, multiple: int = 16, edit: bool = False) -> Params:
    """Check `body` (a JSON object or typed form fields) against `limits`; fill in the model's defaults."""
    try:
        r = ImageRequest.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    if not edit and r.input_fidelity is not None:
        raise APIError(
            400,
            "`input_fidelity` applies to /v1/images/edits only",
            param="input_fidelity",
            code="unsupported_parameter",
        )
    if not edit and r.strength is not None:
        raise APIError(
            400,
            "`strength` applies to /v1/images/edits only (img2img and inpainting of an uploaded image)",
            param="strength",
            code="unsupported_parameter",
        )
    _range("strength", r.strength, 0, 1)
    _check_text("prompt", r.prompt, limits.max_prompt_chars)
    if not r.prompt.strip():
        raise APIError(
            400, "`prompt` is empty; describe the image you want", param="prompt", code="invalid_value"
        )
    if r.negative_prompt is not None:
        _check_text("negative_prompt", r.negative_prompt, limits.max_prompt_chars)
    for name in ("user", "safety_identifier"):
        if (v := getattr(r, name)) is not None:
            _check_text(name, v, 256)
    _rule(V.check_n, "n", r.n, limits.max_n)
    _rule(V.check_steps, "steps", r.steps, limits.max_steps)
    _rule(V.check_cfg, "true_cfg_scale", r.true_cfg_scale, limits.max_cfg)
    _rule(V.check_seed, "seed", r.seed)
    _range("output_compression", r.output_compression, 0, 100)
    _range("partial_images", r.partial_images, 0, 3)
    if r.output_compression is not None and r.output_format in (None, "png"):
        raise APIError(
            400,
            "`output_compression` applies to jpeg and webp output only",
            param="output_compression",
            code="unsupported_parameter",
        )

    size_auto = False
    if r.size is None or r.size == "auto":
        if edit:
            size_auto, width, height = True, 0, 0
        elif defaults.get("width") and defaults.get("height"):
            width, height = defaults["width"], defaults["height"]
        else:  # a model without a default size (edit models follow their input image)
            raise APIError(
                400,
                '`size` is required: this model has no default size (give e.g. "1024x1024")',
                param="size",
                code="missing_required_parameter",
            )
    else:
        m = _SIZE.match(r.size)
        if not m:
            raise APIError(
                400,
                f'`size` must look like "1024x768" (WIDTHxHEIGHT) or "auto", got {r.size[:40]!r}',
                param="size",
                code="invalid_size",
            )
        width, height = int(m.group(1)), int(m.group(2))
        try:
            V.check_size(
                width,
                height,
                min_side=limits.min_side,
                max_side=limits.max_side,
                max_pixels=limits.max_pixels,
                multiple=multiple,
                name="`size`",
            )
        except ValueError as e:
            raise APIError(400, str(e), param="size", code="invalid_size") from None

    loras: list[tuple[str, float]] = []
    for i, ref in enumerate(r.lora or []):
        _range(f"lora[{i}].strength", ref.strength, -limits.max_lora_strength, limits.max_lora_strength)
        loras.append((ref.name, float(ref.strength)))
    if len(loras) > limits.max_loras:
        raise APIError(
            400,
            f"`lora` names {len(loras)} LoRAs; the limit is {limits.max_loras}",
            param="lora",
            code="invalid_value",
        )
    if len({n for n, _ in loras}) != len(loras):
        raise APIError(
            400,
            "`lora` names the same LoRA twice; give each once with its strength",
            param="lora",
            code="invalid_value",
        )

    cfg = float(defaults.get("true_cfg_scale", 1.0) if r.true_cfg_scale is None else r.true_cfg_scale)
    negative = r.negative_prompt if r.negative_prompt is not None else (" " if cfg > 1 else None)
    return Params(
        prompt=r.prompt,
        negative=negative,
        width=width,
        height=height,
        steps=int(defaults.get("num_inference_steps", 50) if r.steps is None else r.steps),
        cfg=cfg,
        n=1 if r.n is None else r.n,
        seed=secrets.randbelow(2**31) if r.seed is None else r.seed,
        response_format=r.response_format or "b64_json",
        output_format=r.output_format or "png",
        compression=r.output_compression,
        stream=bool(r.stream),
        progress=bool(r.progress),
        partial_images=r.partial_images or 0,  # OpenAI's default: no previews unless asked for
        loras=sorted(loras),
        size_auto=size_auto,
        cache=r.cache,
        strength=r.strength,
    )
