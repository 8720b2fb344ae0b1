"""The FastAPI app: OpenAI-compatible image endpoints, the web page, health and metrics.

Robustness rules this file follows:
- every request is parsed by hand (not by FastAPI's body binding), so every malformed input gets an
  OpenAI-shaped 4xx that names the parameter, and nothing a client sends can raise out of a handler;
- the body size is enforced in a raw ASGI middleware while bytes arrive (Content-Length is not
  trusted, chunked bodies are counted), before anything is buffered or parsed; the API key is checked
  before the body is read, with a constant-time compare (both in guard.py);
- GPU work happens on the scheduler's worker thread; image encoding on a thread-pool thread; the
  event loop only waits, so /health and /metrics answer while a batch runs;
- a client that disconnects or times out cancels its job (queued images are dropped, a batch with
  nobody left stops at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import validation as V
from ..validation import round_size
from .batcher import Scheduler
from .capabilities import capabilities
from .guard import EDITS, BodyTooLarge, Guard, app_path, body_limit, error_response, too_large
from .imaging import load_mask, load_upload
from .jobs import Job
from .loras import LoraResolver
from .metrics import Metrics, gpu_memory, model_info
from .options import ServerConfig
from .responses import Responder, UrlStore
from .schemas import APIError, Params, form_to_dict, parse_json_body, validate

log = logging.getLogger("qwenfast.server")
STATIC = Path(__file__).resolve().parent / "static"


def create_app(
    pipe: Any, cfg: ServerConfig | None = None, scheduler: Callable[[Metrics], Any] | None = None
) -> FastAPI:
    """The app for `pipe`. `scheduler(metrics)` replaces the local batcher with another one that has its
    methods (start, submit, cancel, depth, stop; optionally `health()` for /health and `render_metrics()`
    for /metrics): Ray Serve's ingress passes one that forwards to engine replicas (ray_remote.py), with a
    `pipe` that describes the remote pipeline, so every endpoint, limit and stream stays this code."""
    cfg = cfg or ServerConfig()
    metrics = Metrics()
    sched = scheduler(metrics) if scheduler is not None else Scheduler(pipe, cfg, metrics)
    per_row = bool(cfg.row_loras and cfg.lora_dir)  # (the Scheduler enabled them: --row-loras)
    loras = LoraResolver(cfg.lora_dir)
    urls = UrlStore(cfg.url_ttl_s, cfg.url_store_bytes)
    caps = capabilities(pipe)  # what the model can do (its pipeline's declaration; Ray: the replica's answer)
    can_inpaint, tasks = caps.inpaint, list(caps.tasks)
    # input images per edit request: the model's own limit, lowered by the server's `Limits.max_images`
    max_images = min(caps.max_images, cfg.limits.max_images or caps.max_images)
    model_id = cfg.model_name or Path(pipe.model_path or "qwen-image").name
    responder = Responder(sched, cfg, metrics, urls, model_id)
    noted: set[tuple[int, int]] = set()

    def size_note(p: Params) -> None:
        """Log once per size when a request is far from the size the model was trained at (the demo's 128²)."""
        if p.size_auto or (p.width, p.height) in noted:
            return
        noted.add((p.width, p.height))
        note = pipe.size_note(p.width, p.height)
        if note:
            log.warning("%s", note)

    multiple = 2 * pipe.vae_scale_factor
    gen_defaults = dict(pipe.defaults)
    if caps.generations and not gen_defaults.get("width"):  # Qwen-Image-2.1: output_resolution² by default
        gen_defaults["height"], gen_defaults["width"] = pipe.output_size({})
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    icon = _favicon()
    state = {"stopping": False}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        state["stopping"] = True  # uvicorn has already waited (up to its graceful timeout) for open requests
        await asyncio.to_thread(sched.stop, 30.0)

    app = FastAPI(title="qwenfast", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.scheduler, app.state.metrics, app.state.config = sched, metrics, cfg

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(BodyTooLarge)
    async def _bodytoo_large(request, e):
        return error_response(too_large(body_limit(cfg, app_path(request.scope))))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return error_response(APIError(400, f"invalid request: {str(e)[:300]}", code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        msg = {
            404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, msg, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    # ------------------------------------------------------------------ pages and status
    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(
            page,
            headers={
                "Cache-Control": "no-cache",
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
                "script-src 'self' 'unsafe-inline'",
            },
        )

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(icon, media_type="image/png", headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/health")
    async def health():
        q, qi, run = sched.depth()
        body = {
            "status": "shutting_down" if state["stopping"] else "ok",
            "model": model_id,
            "kind": caps.kind,
            "model_type": caps.model_type,
            "device": str(pipe.device),
            "dtype": str(pipe.dtype),
            "queue": {"requests": q, "images": qi, "running": run, "max": cfg.max_queue},
            "max_batch": cfg.max_batch,
            "auth": cfg.api_key is not None,
            "loras": loras.dir is not None,
            "lora_support": caps.lora,
            "defaults": dict(pipe.defaults),
            "size_multiple": multiple,
            "tasks": tasks,
            "max_images": max_images,
            "limits": {**vars(cfg.limits), "max_images": max_images},
        }
        if getattr(sched, "warm_state", None) is not None:  # --warm-up: its progress (server/warmup.py)
            body["warm_up"] = dict(sched.warm_state)
        if hasattr(sched, "health"):  # Ray Serve: replicas up/total; none up -> 503
            body.update(await asyncio.to_thread(sched.health))
        if body["status"] != "ok":
            return JSONResponse(body, status_code=503)
        return JSONResponse(body, status_code=503 if state["stopping"] else 200)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        if hasattr(sched, "render_metrics"):  # Ray Serve: every replica's series, summed and per replica
            text = await asyncio.to_thread(sched.render_metrics)
        else:
            q, qi, run = sched.depth()
            text = metrics.render(q, qi, run, gpu_memory(pipe.device))
        text += model_info(model_id, caps.model_type, caps.kind)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_id, metrics.started, caps)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise APIError(
                404,
                f"model {name[:80]!r} is not served here; this server serves {model_id!r}",
                code="model_not_found",
                param="model",
            )
        return _model_card(model_id, metrics.started, caps)

    @app.get("/v1/loras")
    async def list_loras():
        names = await asyncio.to_thread(loras.available)
        return {"object": "list", "data": [{"id": n, "object": "lora"} for n in names]}

    @app.get("/files/{token}", include_in_schema=False)
    async def files(token: str):
        hit = urls.get(token)
        if hit is None:
            raise APIError(
                404,
                "this image URL has expired or never existed (URLs live "
                f"{cfg.url_ttl_s:g} s; use response_format=b64_json to keep images)",
                code="expired",
            )
        return Response(hit[0], media_type=hit[1], headers={"Cache-Control": "private, max-age=3600"})

    # ------------------------------------------------------------------ image endpoints
    def _check_common(body: dict, p, endpoint: str) -> tuple:
        name = body.get("model")
        if name is not None and name != model_id:
            raise APIError(
                404,
                f"model {str(name)[:80]!r} is not served here; this server serves {model_id!r} "
                "(GET /v1/models)",
                code="model_not_found",
                param="model",
            )
        par = pipe.options.parallel
        if par is not None and par.cfg == 2 and (p.negative is None or p.cfg <= 1):
            raise APIError(
                400,
                f"this server splits true CFG over two GPUs (--parallel {par}): send a "
                '`negative_prompt` (" " is fine) and `true_cfg_scale` > 1',
                param="true_cfg_scale",
                code="cfg_required",
            )
        if p.cache not in (None, "off") and not caps.request_cache:
            raise APIError(
                400,
                f'this model ({caps.model_type}) has no step cache: leave `cache` out (or "off")',
                param="cache",
                code="unsupported_parameter",
            )
        if p.loras and not caps.lora:  # 400, not 501: clients must not retry it
            raise APIError(
                400,
                f"this model ({caps.model_type}) cannot apply LoRAs: leave `lora` out",
                param="lora",
                code="lora_unsupported",
            )
        return loras.resolve_all(p.loras)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        t0 = time.monotonic()
        try:
            if not caps.generations:  # first: no body of any shape can succeed here
                raise APIError(
                    400,
                    f"the loaded model ({model_id}) is an edit model; use POST /v1/images/edits",
                    code="wrong_endpoint",
                )
            ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise APIError(
                    415,
                    f"send the request as JSON with `Content-Type: application/json` (got {ctype[:60]!r})",
                    code="unsupported_media_type",
                )
            body = parse_json_body(await request.body())
            p = validate(body, cfg.limits, gen_defaults, multiple=multiple)
            size_note(p)
            resolved = _check_common(body, p, "generations")
            job = Job(p, asyncio.get_running_loop(), loras=resolved, stream_events=p.stream, per_row=per_row)
            return await responder.respond(request, job, "generations", t0)
        except APIError as e:
            metrics.request("generations", e.status)
            raise

    @app.post(EDITS)
    async def edits(request: Request):
        t0 = time.monotonic()
        try:
            if (
                not caps.edits and not can_inpaint
            ):  # first: no form of any shape can succeed here (400: no retries)
                why = (
                    f"the loaded model ({model_id}) is a text-to-image model; use POST /v1/images/generations, "
                    "or start `qwenfast serve --model` with a Qwen-Image-Edit or Qwen-Image-2.1 folder to edit images"
                )
                raise APIError(400, f"image edits are not available: {why}", code="wrong_endpoint")
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "multipart/form-data":
                raise APIError(
                    415,
                    "send edits as multipart/form-data with the image in `image` (or `image[]`)",
                    code="unsupported_media_type",
                )
            lim = cfg.limits
            try:
                form = await request.form(max_files=max_images + 2, max_fields=64, max_part_size=1 << 20)
            except BodyTooLarge:
                raise
            except StarletteHTTPException as e:
                raise APIError(400, f"malformed multipart form: {e.detail}", code="invalid_request") from None
            except Exception as e:
                raise APIError(
                    400,
                    f"malformed multipart form: {type(e).__name__}: {str(e)[:200]}",
                    code="invalid_request",
                ) from None
            files, fields, mask = [], {}, None
            for k, v in form.multi_items():
                if k == "mask":
                    if not hasattr(v, "read") or mask is not None:
                        raise APIError(
                            400,
                            "`mask` must be one PNG file whose transparent pixels mark the area to repaint",
                            param="mask",
                            code="invalid_mask",
                        )
                    mask = v
                elif hasattr(v, "read"):
                    if k not in ("image", "image[]"):
                        raise APIError(
                            400,
                            f"unexpected file field `{k[:40]}`; send images as `image` or `image[]`",
                            param=k[:40],
                            code="invalid_request",
                        )
                    files.append(v)
                elif k in fields:
                    raise APIError(400, f"`{k[:40]}` is given twice", param=k[:40], code="invalid_request")
                else:
                    fields[k] = v
            if not files:
                n = "1 image" if max_images == 1 else f"1 to {max_images} images"
                raise APIError(
                    400,
                    f"missing `image`: attach {n} as `image` or `image[]`",
                    param="image",
                    code="missing_required_parameter",
                )
            if len(files) > max_images:
                who = caps.model_type if max_images == caps.max_images else "this server"
                raise APIError(
                    400,
                    f"{len(files)} images attached; {who} takes at most {max_images} per request",
                    param="image",
                    code="too_many_images",
                )
            body = form_to_dict(fields)
            p = validate(body, lim, pipe.defaults, multiple=multiple, edit=True)
            kind = _edit_task(p, mask is not None, len(files))
            size_note(p)
            datas = [await f.read() for f in files]
            images = [
                await asyncio.to_thread(
                    load_upload,
                    d,
                    f"image {i + 1} ({(f.filename or '')[:40]!r})",
                    lim.image_formats,
                    lim.max_input_pixels,
                    caps.rgba,
                )
                for i, (f, d) in enumerate(zip(files, datas))
            ]
            mask_image = None
            if mask is not None:
                mask_image = await asyncio.to_thread(
                    load_mask,
                    await mask.read(),
                    f"mask ({(mask.filename or '')[:40]!r})",
                    lim.image_formats,
                    lim.max_input_pixels,
                    images[0].size,
                )
            resolved = _check_common(body, p, "edits")
            if kind != "edit":
                _task_size(p, images[0], kind)
            elif p.size_auto:  # the size follows the last image: hold it to the same limits as a given size
                h, w = pipe.output_size({"image": images, "height": None, "width": None})
                _within_limits(w, h, "the input image's aspect")
            job = Job(
                p,
                asyncio.get_running_loop(),
                kind=kind,
                loras=resolved,
                images=images,
                stream_events=p.stream,
                mask=mask_image,
            )
            return await responder.respond(request, job, "edits", t0)
        except APIError as e:
            metrics.request("edits", e.status)
            raise

    def _edit_task(p: Params, masked: bool, n_images: int) -> str:
        """Which pipeline an edits request runs: edit, edit-inpaint, inpaint or img2img (or a 400 saying why none)."""
        if caps.edits and caps.generations:  # one model for both (Qwen-Image-2.1): reference edits only
            if masked or p.strength is not None:
                what = "a `mask`" if masked else "`strength`"
                raise APIError(
                    400,
                    f"this model ({caps.model_type}) does not inpaint or run img2img: send the "
                    f"images and a prompt without {what}",
                    param="mask" if masked else "strength",
                    code="unsupported_parameter",
                )
            return "edit"
        if caps.edits:
            kind = "edit-inpaint" if masked else "edit"
            if kind == "edit" and p.strength is not None:
                raise APIError(
                    400,
                    "`strength` applies to inpainting (with a `mask`) on an edit model",
                    param="strength",
                    code="unsupported_parameter",
                )
        elif masked or p.strength is not None:
            kind = "inpaint" if masked else "img2img"
        else:
            raise APIError(
                400,
                f"the loaded model ({model_id}) is a text-to-image model: send a `mask` (its "
                "transparent pixels are repainted) to inpaint, or a `strength` (0..1) for img2img; "
                "or use POST /v1/images/generations",
                code="wrong_endpoint",
            )
        if kind != "edit" and not can_inpaint:
            raise APIError(
                400,
                f"this model ({caps.model_type}) does not inpaint or run img2img",
                param="mask",
                code="unsupported_parameter",
            )
        if kind != "edit" and n_images != 1:
            raise APIError(
                400, f"{kind} takes exactly 1 image; got {n_images}", param="image", code="too_many_images"
            )
        return kind

    def _within_limits(w: int, h: int, what: str) -> None:
        lim = cfg.limits
        if max(w, h) > lim.max_side or w * h > lim.max_pixels or min(w, h) < lim.min_side:
            raise APIError(
                400,
                f"the output size follows {what} ({w}x{h}), which is beyond this server's limits "
                f"(sides {lim.min_side} to {lim.max_side}, {lim.max_pixels} pixels); give `size`",
                param="size",
                code="invalid_size",
            )

    def _task_size(p: Params, image, kind: str) -> None:
        """Fill in the output size of img2img / inpainting (the image's, unless given) and the default strength."""
        if kind == "edit-inpaint":  # the output follows the image at the model's area, as diffusers
            h, w = pipe.for_task("edit-inpaint").output_size({"image": [image]})
            if not p.size_auto and (p.width, p.height) != (w, h):
                raise APIError(
                    400,
                    f'with a mask, an edit model\'s output follows the image: give size "auto" '
                    f"(here {w}x{h})",
                    param="size",
                    code="invalid_size",
                )
            _within_limits(w, h, "the input image's aspect")
        elif p.size_auto:
            w, h = round_size(image.width, image.height, multiple)
            _within_limits(w, h, "the input image")
        else:
            w, h = p.width, p.height
        p.width, p.height, p.size_auto = w, h, False
        if p.strength is None:
            p.strength = 1.0  # a mask repaints its area from scratch (OpenAI's meaning)
        try:  # the CLI's rule (validation.py), naming this API's fields
            V.check_strength(p.strength, p.steps, name="`strength`", steps_name="`steps`")
        except ValueError as e:
            raise APIError(400, str(e), param="strength", code="invalid_value") from None

    app.add_middleware(Guard, cfg=cfg)
    return app


def _favicon() -> bytes:
    """A 32x32 PNG in the demo model's world: a red circle on blue (browsers ask for /favicon.ico)."""
    import io

    from PIL import Image, ImageDraw

    im = Image.new("RGB", (32, 32), (40, 70, 200))
    ImageDraw.Draw(im).ellipse((5, 5, 26, 26), fill=(220, 40, 40))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _model_card(model_id: str, created: float, caps) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": int(created),
        "owned_by": "qwenfast",
        "model_type": caps.model_type,
        "tasks": list(caps.tasks),
    }
