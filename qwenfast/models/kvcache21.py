"""Qwen-Image-2.1's query/key/value buffers: the token-major layout, the prefix KV cache the "cached"
steps attend over, and the Q|K|V projection that writes V straight into it (models/transformer21.py
runs the blocks)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["qkv_buffer", "PrefixKVCache", "project_qkv"]


def qkv_buffer(B: int, H: int, S: int, Dh: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A (B, H, S, Dh) query/key/value buffer stored token-major, (B, S, H, Dh) in memory: the fused
    QK-norm + RoPE kernel writes each token's H*Dh values as one contiguous run, the attention
    kernels read their native layout, and their output (allocated in q's layout) reaches the out
    projection as a view (no transpose copy)."""
    return torch.empty(B, S, H, Dh, dtype=dtype, device=device).transpose(1, 2)


class PrefixKVCache:
    """Per-call store of the keys/values of every block (diffusers' `QwenImage21KVCache`).

    Each layer holds (B, H, S, Dh) key and value buffers over the whole joint sequence (S = prefix
    P + target N): the "extract" step writes all S positions, every "cached" step rewrites the
    target part [P, S), so attention reads one buffer without concatenating. `q` is one (B, H, S,
    Dh) query scratch shared by all layers. `ensure` keeps buffers of the same shape, so a cache
    reused across calls keeps its addresses (what a captured CUDA graph of the cached step reads).
    """

    def __init__(self, num_layers: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers  # (k, v) per layer
        self.q: torch.Tensor | None = None
        self.prefix: int | None = None
        self.ready = False

    def ensure(self, B: int, H: int, S: int, Dh: int, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)allocate the buffers unless they already have this shape, dtype and device."""
        q = self.q
        if q is not None and tuple(q.shape) == (B, H, S, Dh) and q.dtype == dtype and q.device == device:
            return
        self.ready = False
        self.q = qkv_buffer(B, H, S, Dh, dtype, device)
        self.layers = [
            (qkv_buffer(B, H, S, Dh, dtype, device), qkv_buffer(B, H, S, Dh, dtype, device))
            for _ in self.layers
        ]

    def check(self, B: int, S: int, prefix: int) -> None:
        """A "cached" step must continue the layout its "extract" step stored."""
        if not self.ready:
            raise RuntimeError("kv_cache_mode='cached' before an 'extract' step filled the cache")
        if self.prefix != prefix or self.q.shape[0] != B or self.q.shape[2] != S:
            raise ValueError(
                f"kv cache holds a batch of {self.q.shape[0]} x {self.q.shape[2]} tokens (prefix "
                f"{self.prefix}), this step has {B} x {S} (prefix {prefix}): run 'extract' again"
            )


def project_qkv(
    lin: nn.Module, h: torch.Tensor, vb: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused Q|K|V Linear on h (B, L, D) for `qk_norm_rope` -> (projection, the V buffer it still
    has to fill, or None).

    V needs no norm: when `lin` is a plain bias-free Linear and each batch row's positions
    [offset, offset + L) of the token-major `vb` are one contiguous (L, H*Dh) run, V's GEMM writes
    them in place (a row slice of the weight, no copy) and only Q|K pass through the norm kernel,
    which then moves 2/3 of the bytes: one (L, H*Dh) read and write fewer per block. FP8 and other
    wrapped Linears (and autograd, which `out=` cannot record) project all three as one GEMM.
    """
    w = getattr(lin, "weight", None)
    if (
        type(lin) is not nn.Linear
        or lin.bias is not None
        or h.dim() != 3
        or not w.dtype == vb.dtype == h.dtype
        or (torch.is_grad_enabled() and w.requires_grad)
    ):
        return lin(h), vb
    B, L, _ = h.shape
    rows = vb.transpose(1, 2)[:, offset : offset + L]  # (B, L, H, Dh)
    if not rows[0].is_contiguous():  # a head-major buffer
        return lin(h), vb
    hd = w.shape[0] // 3
    wv = w[2 * hd :].t()
    for b in range(B):  # (the target rows of a batch row are contiguous; across rows the prefix sits between)
        torch.mm(h[b], wv, out=rows[b].view(L, hd))
    return F.linear(h, w[: 2 * hd]), None
