"""The raw ASGI layer in front of the app: the API key, checked before the body is read (a constant-time
compare of digests), and the body-size limits, enforced while the bytes arrive (Content-Length is not
trusted, chunked bodies are counted), before anything is buffered or parsed. Both look at the path inside
the app (`app_path`), never at the raw one a mount point prefixes."""

from __future__ import annotations

import hashlib
import hmac

from fastapi.responses import JSONResponse

from .options import ServerConfig
from .schemas import APIError

EDITS = "/v1/images/edits"  # the one endpoint that takes uploads (multipart), under their larger limit


class BodyTooLarge(Exception):
    pass


def app_path(scope) -> str:
    """The path inside this app: without `root_path`, which a mount point (Ray Serve's route prefix, a
    proxy's --root-path) leaves in `path`. Auth and limits must look at this one, never at the raw path."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Guard:
    """Raw ASGI middleware: API key (before the body is read) and body-size limits (while it arrives)."""

    def __init__(self, app, cfg: ServerConfig):
        self.app, self.cfg = app, cfg
        self._key = hashlib.sha256(cfg.api_key.encode()).digest() if cfg.api_key else None

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        # hash both sides: compare_digest on equal-length digests leaks neither content nor length
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = app_path(scope)
        if self._key is not None and path.startswith("/v1/") and not self._authorized(scope):
            e = APIError(
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await error_response(e)(scope, receive, send)
        limit = body_limit(self.cfg, path)
        for k, v in scope.get("headers") or []:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await error_response(
                        APIError(400, "bad Content-Length header", code="invalid_request")
                    )(scope, receive, send)
                if n > limit:
                    return await error_response(too_large(limit))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return msg

        return await self.app(scope, counted, send)


def body_limit(cfg: ServerConfig, path: str) -> int:
    """The most bytes a request to `path` may send: an upload's for the edits endpoint, else a JSON body's."""
    return cfg.limits.max_upload_bytes if path == EDITS else cfg.limits.max_json_bytes


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
