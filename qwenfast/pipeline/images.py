"""Image and mask inputs read as diffusers 0.42.1 reads them (`VaeImageProcessor.preprocess` with the
settings each Qwen-Image pipeline gives it), so that an array, a tensor or a PIL image means the same
picture, or the same mask, in qwenfast as in diffusers:

- PIL images (and paths): Lanczos-resized to height x width (floored to a multiple of 16), then
  /255 -> [0, 1], normalised to [-1, 1] for images; masks are converted to grayscale after the resize.
- numpy arrays are *values*, not bytes: floats in [0, 1] (diffusers does not divide by 255), HxW,
  HxWxC or BxHxWxC; resized with nearest-neighbour interpolation (not Lanczos).
- torch tensors: CHW or BCHW in [0, 1] (normalised to [-1, 1]) or already in [-1, 1] (any negative
  value: taken as it is, as diffusers does with a FutureWarning); nearest-neighbour resize. A tensor
  with the latent channel count is taken as latents (img2img).
- masks are binarised at 0.5 after the resize: a uint8 0/1 mask and a 0/255 mask both mean
  keep/repaint, and so does a float [0, 1] mask; a soft mask becomes hard at half.

Where qwenfast differs, it is on purpose and only where diffusers would fail or silently compute a
wrong picture: PIL images of another mode (RGBA, L, P) are converted to RGB (diffusers hands them to
the VAE and fails); integer image arrays and tensors (uint8 0..255 pixels) are refused, because
diffusers takes their values as if they were [0, 1] and encodes a blown-out picture; boolean masks
are read as 0/1 (diffusers fails on them); an HxWx3 mask array, which diffusers reads as a batch of
H masks, is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ImageSpec:
    """How one diffusers pipeline configures a `VaeImageProcessor` (`vae_latent_channels` 4 is its
    default; the img2img and inpaint pipelines give the VAE's 16)."""

    normalize: bool = True
    binarize: bool = False
    grayscale: bool = False
    latent_channels: int = 4


IMAGE = ImageSpec()
IMAGE_LATENTS = ImageSpec(latent_channels=16)  # img2img / inpaint: a 16-channel tensor is image latents
MASK = ImageSpec(normalize=False, binarize=True, grayscale=True)


def open_image(item, where: str):
    """A path -> the PIL image (loaded, in its own mode); anything else as it is."""
    if not isinstance(item, (str, Path)):
        return item
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(item) as f:
            f.load()
            return f.copy()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file {str(item)!r}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: {str(item)!r} is not a readable image ({e})") from None


def _is_image(x) -> bool:
    from PIL import Image

    return isinstance(x, Image.Image) or (isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim in (2, 3))


def _check_values(x, spec: ImageSpec, where: str):
    """qwenfast's refusals (see the module docstring); masks: bool -> 0/1."""
    dt = x.dtype
    is_bool = dt == torch.bool if isinstance(x, torch.Tensor) else dt == np.bool_
    if is_bool:
        if not spec.binarize:
            raise ValueError(f"{where}: a boolean array is not an image; give float values in [0, 1]")
        return x.to(torch.uint8) if isinstance(x, torch.Tensor) else x.astype(np.uint8)
    is_int = not (x.is_floating_point() if isinstance(x, torch.Tensor) else np.issubdtype(dt, np.floating))
    if is_int and not spec.binarize:
        raise ValueError(
            f"{where}: an integer ({dt}) image array is taken by diffusers as values in [0, 1], not "
            "0..255 pixels, which gives a blown-out picture: pass `arr / 255` as float, or "
            "`PIL.Image.fromarray(arr)`"
        )
    return x


def preprocess(
    image, height: int, width: int, spec: ImageSpec = IMAGE, *, mult: int = 16, where: str = "image"
) -> torch.Tensor:
    """diffusers' `VaeImageProcessor(vae_scale_factor=mult, ...).preprocess(image, height, width)`:
    one image or a list (PIL / path / array / tensor), or a batch array/tensor -> (k, C, H, W) float32,
    H x W = height x width floored to `mult` (a latents tensor keeps its own size)."""
    from PIL import Image

    if isinstance(image, tuple):
        image = list(image)
    if isinstance(image, list):
        if not image:
            raise ValueError(f"{where} is an empty list")
        image = [open_image(im, f"{where}[{k}]") for k, im in enumerate(image)]
    else:
        image = open_image(image, where)
    # a 3-D mask array/tensor: diffusers adds the missing axis (BxHxW -> channels, HxWx1 -> batch)
    if spec.grayscale and isinstance(image, (torch.Tensor, np.ndarray)) and image.ndim == 3:
        if isinstance(image, torch.Tensor):
            image = image.unsqueeze(1)
        elif image.shape[-1] == 1:
            image = image[None]
        elif image.shape[-1] in (3, 4):
            raise ValueError(
                f"{where}: an HxWx{image.shape[-1]} mask array is read by diffusers as a batch of "
                f"{image.shape[0]} masks; give HxW (one channel)"
            )
        else:
            image = image[..., None]
    if isinstance(image, list) and isinstance(image[0], (np.ndarray, torch.Tensor)) and image[0].ndim == 4:
        image = np.concatenate(image) if isinstance(image[0], np.ndarray) else torch.cat(image)
    valid = (
        (isinstance(image, (np.ndarray, torch.Tensor)) and image.ndim == 4)
        or _is_image(image)
        or (isinstance(image, list) and all(_is_image(im) for im in image))
    )
    if not valid:
        got = type(image).__name__ if not isinstance(image, list) else f"a list of {type(image[0]).__name__}"
        raise TypeError(
            f"{where} must be a PIL image, a path, a numpy array or a torch tensor (or a list of them), "
            f"got {got} of shape {getattr(image, 'shape', '?')}"
        )
    items = image if isinstance(image, list) else [image]
    if len({type(im).__name__ for im in items}) > 1 and not all(isinstance(im, Image.Image) for im in items):
        raise TypeError(f"{where}: a list must hold one kind of image (all PIL, all arrays or all tensors)")
    h, w = height // mult * mult, width // mult * mult
    if isinstance(items[0], Image.Image):
        arrs = []
        for im in items:
            im = im.resize((w, h), resample=Image.LANCZOS)
            mode = "L" if spec.grayscale else "RGB"
            arrs.append(np.asarray(im if im.mode == mode else im.convert(mode)).astype(np.float32) / 255.0)
        x = _numpy_to_pt(np.stack(arrs))
    elif isinstance(items[0], np.ndarray):
        arr = np.concatenate(items) if items[0].ndim == 4 else np.stack(items)
        x = _resize(_numpy_to_pt(_check_values(arr, spec, where)), h, w)
    else:
        x = torch.cat(items) if items[0].ndim == 4 else torch.stack(items)
        x = _check_values(x, spec, where)
        if spec.grayscale and x.ndim == 3:
            x = x.unsqueeze(1)
        if x.shape[1] == spec.latent_channels:  # latents: no resize, no normalisation
            return x
        x = _resize(x, h, w)
    x = x.to(torch.float32)
    if spec.normalize:
        if x.min() < 0:
            warnings.warn(
                "Passing `image` as torch tensor with value range in [-1,1] is deprecated. The expected value "
                "range for image tensor is [0,1] when passing as pytorch tensor or numpy Array. You passed "
                f"`image` with value range [{x.min()},{x.max()}]",
                FutureWarning,
                stacklevel=3,
            )
        else:
            x = 2.0 * x - 1.0
    if spec.binarize:
        x = (x >= 0.5).to(torch.float32)
    return x


def _numpy_to_pt(a: np.ndarray) -> torch.Tensor:
    """(B, H, W[, C]) -> (B, C, H, W), values as they are (diffusers' `numpy_to_pt`)."""
    if a.ndim == 3:
        a = a[..., None]
    return torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))


def _resize(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """diffusers' tensor resize: nearest-neighbour `F.interpolate` to (h, w), in float32 (nearest
    picks the same pixels in any dtype; integer masks interpolate too)."""
    return F.interpolate(x.to(torch.float32), size=(h, w))


def pil_image(image, where: str):
    """For the pipelines whose diffusers counterpart takes PIL images only (Layered): a path / PIL
    image / HxW[xC] uint8 array -> PIL image in its own mode (arrays as `PIL.Image.fromarray` reads
    them, the convention of diffusers' Qwen-Image-2.1 pipeline)."""
    from PIL import Image

    image = open_image(image, where)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"{where}: arrays must be HxW or HxWxC uint8, got {image.dtype} {image.shape}")
        return Image.fromarray(image)
    if isinstance(image, Image.Image):
        return image
    raise TypeError(f"{where} must be a PIL image, a path or a uint8 array, got {type(image).__name__}")
