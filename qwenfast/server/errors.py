"""Every error code `qwenfast serve` can answer, in one table: code -> (HTTP status, meaning).

Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}` and `code` is always
one of these (never null): `APIError` refuses a code that is not in the table, and
tests/test_server_errors.py checks that every code the server's source names is here and that the
hostile-request suites never see a null code. docs/serving-errors.md is this table for readers.

A 4xx means the request can never succeed as sent (the OpenAI SDK does not retry it); 429, 503 and
504 are worth retrying; 500 is a server bug or a failed generation (details in the server log only).
"""

from __future__ import annotations

ERRORS: dict[str, tuple[int, str]] = {
    # 400: the request itself
    "invalid_request": (
        400,
        "a malformed request: bad Content-Length, a malformed multipart form, a form field "
        "given twice, an unexpected file field",
    ),
    "invalid_json": (
        400,
        "the body is empty, not UTF-8, not valid JSON (NaN and Infinity included), or not a JSON object",
    ),
    "invalid_type": (
        400,
        "a multipart form field is not of its type (a whole number, a number, true/false, a JSON list)",
    ),
    "invalid_value": (
        400,
        "a field is out of range or not allowed (`n`, `steps`, `true_cfg_scale`, `seed`, "
        "`strength`, an empty `prompt`, text with a lone surrogate, a LoRA strength, too many or repeated LoRAs)",
    ),
    "invalid_size": (
        400,
        "`size` is not WIDTHxHEIGHT, breaks the size rule (multiples of 16, sides in "
        "16..--max-size; the message names the nearest valid sizes), or the size an input image "
        "implies is beyond the limits",
    ),
    "missing_required_parameter": (
        400,
        "a required field is missing (`prompt`; `size` on a model without a default "
        "size; `image` on /v1/images/edits)",
    ),
    "unknown_parameter": (400, "a field this API does not have (typos are refused, not ignored)"),
    "unsupported_parameter": (
        400,
        "a field that does not apply here: `strength` or `input_fidelity` on "
        "/v1/images/generations, `output_compression` with png, `cache` on a model "
        "without a step cache, `strength` without a `mask` on an edit model, a `mask` "
        "on a server that cannot inpaint",
    ),
    "string_above_max_length": (
        400,
        "`prompt`, `negative_prompt`, `user` or `safety_identifier` is longer than "
        "the limit (--max-prompt-chars; 256 for the last two)",
    ),
    "invalid_image": (
        400,
        "an uploaded image is empty, not PNG / JPEG / WEBP (checked from its bytes), or cannot be decoded",
    ),
    "image_too_large": (
        400,
        "an uploaded image or mask has more pixels than the server accepts (checked before decoding)",
    ),
    "too_many_images": (
        400,
        "more input images than the model (or the server) takes per edit request; img2img "
        "and inpainting take exactly one",
    ),
    "invalid_mask": (
        400,
        "the `mask` is not one image with an alpha channel of the image's size and at least one "
        "transparent pixel",
    ),
    "wrong_endpoint": (
        400,
        "generations on an edit model, or edits on a text-to-image model without `mask` or `strength`",
    ),
    "cfg_required": (
        400,
        "a server that splits true CFG over two GPUs (--parallel cfg=2) got a request without "
        "`negative_prompt` or with `true_cfg_scale` <= 1",
    ),
    "lora_not_enabled": (400, "the request names a LoRA but the server runs without --lora-dir"),
    "lora_not_supported": (
        400,
        "a LoRA on a task that cannot take one per request (--row-loras: text-to-image only)",
    ),
    "invalid_lora_name": (400, "a LoRA name that is not a plain file name (no folders)"),
    "lora_unsupported": (400, "the server's pipeline cannot apply LoRAs"),
    "invalid_lora": (400, "the named LoRA file exists but is not a LoRA this model can use"),
    # 401, 404, 405, 413, 415
    "invalid_api_key": (401, "missing or wrong `Authorization: Bearer <key>` (--api-key)"),
    "model_not_found": (404, "`model` names a model this server does not serve (GET /v1/models)"),
    "lora_not_found": (404, "no LoRA of that name in --lora-dir (GET /v1/loras)"),
    "expired": (404, "a response_format=url image that expired (--url-ttl) or never existed"),
    "not_found": (404, "no such endpoint"),
    "method_not_allowed": (405, "the endpoint exists but not for this HTTP method"),
    "request_too_large": (
        413,
        "the body is larger than the limit (1 MiB of JSON; --max-upload-mb for edits)",
    ),
    "unsupported_media_type": (
        415,
        "generations need `Content-Type: application/json`, edits multipart/form-data",
    ),
    # retry these
    "queue_full": (429, "the queue is full (--max-queue); retry after the `Retry-After` seconds"),
    "shutting_down": (503, "the server is shutting down; retry on another instance"),
    "replicas_lost": (503, "Ray Serve: the request lost its engine replica several times in a row"),
    "timeout": (504, "the request did not finish within --timeout seconds (queue wait included)"),
    # server side
    "generation_failed": (
        500,
        "the pipeline failed on this batch (details in the server log, never in the answer)",
    ),
    "internal_error": (500, "a bug in the server (details in the server log)"),
}

# the code of an error that names none (an HTTP error raised by the framework, say), by status
DEFAULT_CODE = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                413: "request_too_large", 415: "unsupported_media_type", 429: "queue_full", 503: "shutting_down",
                504: "timeout"}  # fmt: skip


def default_code(status: int) -> str:
    """The table's code for an error raised without one (any other status: invalid_request / internal_error)."""
    return DEFAULT_CODE.get(status, "internal_error" if status >= 500 else "invalid_request")


def markdown_table() -> str:
    """The table as Markdown (docs/serving-errors.md is made from it)."""
    rows = ["| code | status | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{code}` | {status} | {meaning} |" for code, (status, meaning) in ERRORS.items()]
    return "\n".join(rows)
