"""Image bytes in and out: encoding results, live previews, and checking uploads.

Uploads are untrusted: the format is sniffed from the bytes (not the file name or content type),
only `Limits.image_formats` are opened, and the pixel count is read from the header and refused
*before* decoding, so a 50 kB PNG that claims 100k x 100k pixels costs nothing.
"""

from __future__ import annotations

import base64
import io
import warnings

from .schemas import APIError

MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(img, fmt: str, compression: int | None = None, meta: dict[str, str] | None = None) -> bytes:
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


def preview_images(pipe, latents, h: int, w: int, max_px: int) -> list[str]:
    """Base64 JPEGs of what the packed `latents` (B, h/2*w/2, 64) look like now.

    Decodes a shrunken latent (long side <= max_px/8) with the real VAE: true colours at ~1/16 of a
    full decode's cost, and nothing model-specific to maintain. Runs on the worker thread between
    steps; the result does not feed back into generation.
    """
    import torch
    import torch.nn.functional as F

    from ..pipeline import scheduler as S
    from ..pipeline.text_to_image import postprocess

    f = pipe.vae_scale_factor
    z = S.unpack_latents(latents, h, w)  # (B, 16, h, w), h/w in latent pixels
    lim = max(2, max_px // f)
    scale = min(1.0, lim / max(h, w))
    if scale < 1.0:
        z = F.interpolate(z.float(), size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area")
    hh, ww = z.shape[-2:]
    hh, ww = hh - hh % 2, ww - ww % 2
    z = z[..., :hh, :ww]
    with torch.no_grad():
        img = pipe.decode_latents(S.pack_latents(z.to(latents.dtype)), hh, ww)
    out = []
    for im in postprocess(img, "pil"):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=70)
        out.append(b64(buf.getvalue()))
    return out


def load_upload(data: bytes, what: str, allowed: tuple[str, ...], max_pixels: int):
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
