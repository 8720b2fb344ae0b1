"""FP8 weights straight into `FP8Linear` layers while a transformer streams in: no bf16 copy on the GPU.

Why: a full-size Qwen-Image transformer is 38 GiB in bf16 and ~20 GiB with its block Linears in FP8.
Quantising after loading (`enable_fp8()` on a resident bf16 model) needs the 38 GiB first; loading an
FP8 file by dequantising it (what `loading.fp8` does for bf16 compute) needs them too. Here the model
is built on meta with empty `FP8Linear`s (`quantize_model(empty=True)`), and each checkpoint tensor
that belongs to one is turned into (`weight_fp8`, `weight_scale`) on the device as it arrives:

- a float tensor (bf16 folder + `fp8=True`): cast to the model dtype, then quantised per output row
  exactly as `enable_fp8()` quantises the resident weight (`quantize_rows_ref`), so both paths give
  bitwise the same layers (rowwise scales make the separate Q/K/V pieces quantise like their fusion);
- a stored e4m3 weight (`QuantizedWeight`, from a ComfyUI FP8 file: plain cast, `scale_weight`,
  `weight_scale`): kept as stored, its scale (none = 1, a scalar, or one per row) spread to one per
  row — the file's own values, no requantisation; e5m2 weights are dequantised and requantised.

GPU peak during the load: the FP8 model plus the tensor being converted (and up to two Q/K/V pieces
of FP8 waiting for their third).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.fp8_linear import FP8, FP8Linear, quantize_rows_ref
from ..runtime.contract import BlockModel

__all__ = ["QuantizedWeight", "FP8Weights", "fp8_rows"]


@dataclass
class QuantizedWeight:
    """An FP8 weight as stored in a file, with its fp32 scale (None: 1; a scalar; or one per output row)."""

    w8: torch.Tensor  # (N, K) float8
    scale: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.w8.shape


def fp8_rows(t: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Any weight -> (e4m3 (N, K), fp32 scales (N, 1)), as `FP8Linear` stores it."""
    if isinstance(t, QuantizedWeight):
        w8, s = t.w8, t.scale
        N = w8.shape[0]
        s = (
            torch.ones((), dtype=torch.float32, device=w8.device)
            if s is None
            else s.to(w8.device, torch.float32)
        )
        if w8.dtype == FP8:
            if s.numel() == 1:
                return w8, s.reshape(1, 1).expand(N, 1).contiguous()
            return w8, s.reshape(N, 1).contiguous()
        t = (w8.float() * s.reshape(-1, 1) if s.numel() > 1 else w8.float() * s).to(dtype)  # e5m2: requantise
    return quantize_rows_ref(t.to(dtype))


class FP8Weights:
    """A `load_streaming` convert step: `<layer>.weight` of an FP8Linear -> its `weight_fp8` and
    `weight_scale`, each passed on to `then` (the Q/K/V fuser); every other tensor goes to `then` as is.

    The layers are those the model declares (`fp8_linears()`, the list `quantize_model` replaced) and
    holds as FP8Linear. `fuse_key(name)` maps a separate Q/K/V name to its fused one, to know which
    layer a piece belongs to.
    """

    def __init__(
        self,
        model: BlockModel,
        dtype: torch.dtype,
        then: Callable,
        fuse_key: Callable[[str], tuple[str, int] | None] = lambda k: None,
    ):
        self.layers = {n for n in model.fp8_linears() if isinstance(model.get_submodule(n), FP8Linear)}
        self.dtype, self.then, self.fuse_key = dtype, then, fuse_key
        if hasattr(then, "check_done"):
            self.check_done = then.check_done

    def wants(self, name: str) -> bool:
        if not name.endswith(".weight"):
            return False
        hit = self.fuse_key(name)
        return (hit[0] if hit else name).removesuffix(".weight") in self.layers

    def __call__(self, name: str, t):
        if not self.wants(name):
            return self.then(name, t)
        w8, s = fp8_rows(t, self.dtype)
        out = [self.then(name + "_fp8", w8), self.then(name + "_scale", s)]
        return [o for o in out if o is not None] or None
