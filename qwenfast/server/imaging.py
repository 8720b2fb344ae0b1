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
    """A PIL image as a base64 JPEG (the streamed previews; an RGBA one loses its alpha)."""
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=quality)
    return b64(buf.getvalue())


def load_upload(
    data: bytes, what: str, allowed: tuple[str, ...], max_pixels: int, keep_alpha: bool = False
) -> Image.Image:
    """Untrusted bytes -> RGB PIL image (RGBA when `keep_alpha` and the image has transparency: Qwen-Image-2.1
    sees the alpha channel), or APIError(400) naming the upload and the reason."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise APIError(400, f"{what} is empty", param="image", code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=list(allowed))
            w, h = im.size
            if w * h > max_pixels:
                raise APIError(
                    400,
                    f"{what} is {w}x{h} pixels; the limit is {max_pixels} pixels",
                    param="image",
                    code="image_too_large",
                )
            im.load()
            alpha = keep_alpha and (
                im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
            )
            rgb = im.convert("RGBA" if alpha else "RGB")
    except APIError:
        raise
    except UnidentifiedImageError:
        raise APIError(
            400,
            f"{what} is not a {', '.join(allowed)} image (checked from its bytes)",
            param="image",
            code="invalid_image",
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(
            400, f"{what} declares too many pixels", param="image", code="image_too_large"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt file
        raise APIError(
            400, f"{what} could not be decoded: {str(e)[:120]}", param="image", code="invalid_image"
        ) from None
    return rgb


def load_mask(
    data: bytes, what: str, allowed: tuple[str, ...], max_pixels: int, size: tuple[int, int]
) -> Image.Image:
    """An OpenAI edit mask -> greyscale PIL mask in diffusers' convention (white = repaint), or APIError(400).

    OpenAI semantics: the mask is an image with an alpha channel and the input image's size; its
    (fully) transparent pixels are repainted. Partly transparent pixels count as transparent below
    half opacity (diffusers binarises its masks at 0.5), so a soft brush edge is fine.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise APIError(400, f"{what} is empty", param="mask", code="invalid_mask")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=list(allowed))
            if im.size[0] * im.size[1] > max_pixels:
                raise APIError(
                    400,
                    f"{what} is {im.size[0]}x{im.size[1]} pixels; the limit is {max_pixels} pixels",
                    param="mask",
                    code="image_too_large",
                )
            im.load()
    except APIError:
        raise
    except UnidentifiedImageError:
        raise APIError(
            400,
            f"{what} is not a {', '.join(allowed)} image (checked from its bytes)",
            param="mask",
            code="invalid_mask",
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(
            400, f"{what} declares too many pixels", param="mask", code="image_too_large"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise APIError(
            400, f"{what} could not be decoded: {str(e)[:120]}", param="mask", code="invalid_mask"
        ) from None
    if not (im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info):
        raise APIError(
            400,
            f"{what} has no alpha channel ({im.mode}); the mask must be a PNG whose transparent "
            "pixels mark the area to repaint",
            param="mask",
            code="invalid_mask",
        )
    if im.size != tuple(size):
        raise APIError(
            400,
            f"{what} is {im.size[0]}x{im.size[1]} but the image is {size[0]}x{size[1]}; the mask "
            "must have the image's size",
            param="mask",
            code="invalid_mask",
        )
    alpha = im.convert("RGBA").getchannel("A")
    if alpha.getextrema()[0] >= 128:
        raise APIError(
            400,
            f"{what} has no transparent pixels, so there is nothing to repaint (transparent = "
            "repaint, opaque = keep)",
            param="mask",
            code="invalid_mask",
        )
    return alpha.point(lambda a: 255 - a)  # white where transparent: diffusers' "repaint"
