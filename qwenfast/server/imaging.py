"""Image bytes in and out: encoding results, live previews, and checking uploads.

Uploads are untrusted: the format is sniffed from the bytes (not the file name or content type),
only `Limits.image_formats` are opened, and the pixel count is read from the header and refused
*before* decoding, so a 50 kB PNG that claims 100k x 100k pixels costs nothing.
"""

from __future__ import annotations

import base64
import io
import warnings
from typing import TYPE_CHECKING

from .schemas import APIError

if TYPE_CHECKING:
    from PIL import Image

MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(
    img: Image.Image, fmt: str, compression: int | None = None, meta: dict[str, str] | None = None
) -> bytes:
    """PIL image -> PNG (with the settings as iTXt, like `qwenfast generate`), JPEG or WebP bytes.

    `compression` is OpenAI's output_compression (0-100, higher = smaller file), so quality = 100 - it.
    """
    buf = io.BytesIO()
    if fmt == "png":
        from PIL import PngImagePlugin

        info = PngImagePlugin.PngInfo()
        for k, v in (meta or {}).items():
            info.add_itxt(k, v)
        img.save(buf, format="PNG", pnginfo=info)
    elif fmt == "jpeg":
        img.convert("RGB").save(
            buf, format="JPEG", quality=max(1, 100 - (compression if compression is not None else 10))
        )
    elif fmt == "webp":
        img.save(buf, format="WEBP", quality=max(1, 100 - (compression if compression is not None else 10)))
    else:  # validated earlier; a bug if reached
        raise ValueError(f"unknown output format {fmt!r}")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def jpeg_b64(img: Image.Image, quality: int = 70) -> str:
    """A PIL image as a base64 JPEG (the streamed previews)."""
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return b64(buf.getvalue())


def load_upload(data: bytes, what: str, allowed: tuple[str, ...], max_pixels: int) -> Image.Image:
    """Untrusted bytes -> RGB PIL image, or APIError(400) naming the upload and the reason."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise APIError(400, f"{what} is empty", param="image", code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=list(allowed))
            w, h = im.size
            if w * h > max_pixels:
                raise APIError(400, f"{what} is {w}x{h} pixels; the limit is {max_pixels} pixels", param="image",
                               code="image_too_large")  # fmt: skip
            im.load()
            rgb = im.convert("RGB")
    except APIError:
        raise
    except UnidentifiedImageError:
        raise APIError(400, f"{what} is not a {', '.join(allowed)} image (checked from its bytes)", param="image",
                       code="invalid_image_format") from None  # fmt: skip
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(
            400, f"{what} declares too many pixels", param="image", code="image_too_large"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt file
        raise APIError(400, f"{what} could not be decoded: {str(e)[:120]}", param="image",
                       code="invalid_image") from None  # fmt: skip
    return rgb
