"""Decoding: packed latents to images (the batch in one decode, or one image at a time replaying CUDA
graphs: `decode_per_image`), the VAE brought on the device for it when offloaded, and cheap previews for
step callbacks.

A mixin of `PipelineBase`: it reads the pipeline's state (`self.vae`, `self.vae_dtype`, `self._options`,
`self._decode_graphs`, `self._vae_offloader`, `self.vae_scale_factor`) and calls the lower layers
(runtime/oom.py's `vae_decode`, runtime/cuda_graphs.py's `DecodeGraphs`), never the other way round.
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime.oom import vae_decode
from . import sampling as S
from .common import postprocess


class DecodeMethods:
    """Latents to images and previews (see the module docstring)."""

    def decode_latents(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Packed latents (B, h/2*w/2, 64) -> images (B, 3, 8h, 8w) in [-1, 1]. Splits / tiles on CUDA OOM.

        The batch in one decode, as diffusers does; with the `decode_per_image` option one image at a
        time, so that an image does not depend on its batch-mates (batched convolutions pick kernels
        by batch size): what a server wants, so a batched request gets the image it gets alone. Those
        one-image decodes replay CUDA graphs when `cuda_graphs` is on (`_decode_one`).
        """
        vcfg, vdt = self.vae.cfg, self.vae_dtype
        z = S.unpack_latents(x, h, w).to(vdt)  # (B, 16, h, w)
        mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1).to(z.device, vdt)
        inv_std = 1.0 / torch.tensor(vcfg.latents_std).view(1, -1, 1, 1).to(z.device, vdt)
        z = z / inv_std + mean
        with self._vae_resident():
            if not self._options.decode_per_image:
                return vae_decode(self.vae, z)
            return torch.cat([self._decode_one(z[r : r + 1]) for r in range(z.shape[0])])

    def _decode_one(self, z: torch.Tensor) -> torch.Tensor:
        """One image's decode (1, z, h, w): replayed from a CUDA graph per latent shape when graphs are on
        (`runtime.cuda_graphs.DecodeGraphs`: the same kernels, so the same image, with no allocation
        of its working set per image); eager when the decode would tile, the VAE is offloaded, or a
        capture runs out of memory (`vae_decode` then splits / tiles as usual)."""
        g = self._decode_graphs
        if (
            not (self._options.cuda_graphs and g.enabled and z.is_cuda)
            or self._vae_offloader is not None
            or self.vae.decode_tiles(z)
        ):
            return vae_decode(self.vae, z)
        try:
            return g(z)
        except torch.OutOfMemoryError:
            return vae_decode(self.vae, z)

    def _vae_resident(self):
        return (
            self._vae_offloader.on_device() if self._vae_offloader is not None else contextlib.nullcontext()
        )

    def preview_images(self, latents: torch.Tensor, height: int, width: int, max_px: int = 192) -> list:
        """PIL previews (long side <= max_px) of a step callback's latents for a `height` x `width` call.

        Decodes a shrunken latent with the real VAE: true colours at ~1/16 of a full decode's cost.
        """
        import torch.nn.functional as F

        h, w = S.latent_hw(height, width, self.vae_scale_factor)
        z = S.unpack_latents(latents, h, w)  # (B, 16, h, w)
        lim = max(2, max_px // self.vae_scale_factor)
        scale = min(1.0, lim / max(h, w))
        if scale < 1.0:
            z = F.interpolate(
                z.float(), size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area"
            )
        hh, ww = z.shape[-2:]
        hh, ww = hh - hh % 2, ww - ww % 2
        z = z[..., :hh, :ww]
        with torch.no_grad():
            img = self.decode_latents(S.pack_latents(z.to(latents.dtype)), hh, ww)
        return postprocess(img, "pil")
