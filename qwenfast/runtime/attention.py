"""Joint attention backend: one switch, chosen once, that tests can flip.

Why not let PyTorch pick: on H100/H200 PyTorch's default SDPA order prefers FlashAttention-2, but
cuDNN's fused attention measured 659 TFLOP/s against FA2's 355 at Qwen-Image shapes (B=1, 24 heads,
4224 tokens, d=128), and FA2 refuses boolean masks entirely. So on CUDA we ask for cuDNN first and
keep the exact fallbacks behind it. FlashAttention-3 goes first where it is installed (the full
`flash_attn_interface` build, or the forward-only `fa3-fwd` wheel for bf16) and the GPU is a Hopper
(sm_90, the only architecture its kernels are built for): on an H200 it is the faster kernel at 1328²'s
7017 tokens (`qwenfast bench attention micro`, bench/results/attention.jsonl); Q/K/V layouts do not matter.

`QWENFAST_ATTENTION` = auto | cudnn | flash | efficient | math | fa3 | fp8 (read once), or
`set_attention()`. All backends but "fp8" are exact attention (no approximation); they differ in
rounding only. "fp8" (off by default, lossy) quantises Q, K, V to e4m3 and runs an FP8 attention
kernel (cuDNN's FP8 SDPA or FlashAttention-3's): see `runtime/attention_fp8.py`; it runs cuDNN bf16
(and warns once) where it cannot, e.g. for calls with a padding mask.

The seam: every attention call of the model goes through `attention()`, and `wrap_attention(w)`
puts a wrapper around it for the duration of a `with` block: `w(inner, q, k, v, mask)` may reshape
the inputs (e.g. a sequence-parallel all-to-all of heads <-> sequence), call `inner`, and reshape
back. Wrappers nest; the innermost `with` is outermost in the call.

`joint_attention(streams, ...)` is the same seam one step earlier, for blocks whose Q/K/V come from
fused projections ([text; image] streams, each (B, L, 3*H*D)): by default the streams' QK-norm +
RoPE kernel writes one joint buffer and `attention()` runs on it; a single active wrapper with a
`joint` method (the peer-memory Ulysses exchange) takes the call instead, so that the kernel can
write each head group straight into the rank that attends over it.

Padded text without a mask (`KeyLengths`): a server pads prompts to a few lengths (`text_bucket`), so
that one captured CUDA graph serves every prompt of a length bucket. A boolean key mask would make
attention slower (cuDNN's masked path; FA2/FA3 take none), so the joint sequence is laid out [image;
text] instead and each row's keys are its first `lens[b]` (image + real text; the padding at the end):
FlashAttention-3 reads only those (`flash_attn_with_kvcache`'s `cache_seqlens`, a device tensor, so
graphs replay any lengths); elsewhere the same lengths become a boolean mask. Each query's output is
the one of the unpadded sequence (attention does not depend on the keys' order, up to rounding). The
padding's values must be finite (the kernel weighs them by exactly 0, and 0 * NaN is NaN): zero text
embeddings, as `TextCond.bucketed` writes, are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .arch import arch

CHOICES = ("auto", "cudnn", "flash", "efficient", "math", "fa3", "fp8")
_choice: str | None = None


try:  # resolved at import, never inside a compiled region
    import flash_attn_interface as _FA3
except Exception:
    _FA3 = None


_FA3_FWD = None  # the forward-only `fa3-fwd` wheel (bf16 kernels only), imported on first use


def fa3_runs(device: torch.device) -> bool:
    """Whether FA3's kernels run on `device`'s architecture (the arch table: sm_90 only)."""
    return arch(device).fa3


def _fa3(allow_fwd: bool = False):
    """FA3's module: `flash_attn_interface`, else (allow_fwd: bf16 inputs) `fa3_fwd_interface`, else None."""
    global _FA3_FWD
    if _FA3 is not None or not allow_fwd:
        return _FA3
    if _FA3_FWD is None:
        try:
            import fa3_fwd_interface as mod
        except Exception:
            mod = False
        _FA3_FWD = mod
    return _FA3_FWD or None


def attention_backend() -> str:
    global _choice
    if _choice is None:
        set_attention(os.environ.get("QWENFAST_ATTENTION", "auto"))
    return _choice


def set_attention(name: str) -> None:
    global _choice
    name = name.strip().lower()
    if name not in CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {CHOICES}")
    _choice = name


@contextmanager
def use_attention(name: str):
    global _choice
    old = attention_backend()
    set_attention(name)
    try:
        yield
    finally:
        _choice = old


def _sdpa_backends(choice: str, has_mask: bool):
    from torch.nn.attention import SDPBackend

    order = {
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
    }
    if choice in order:
        return order[choice]
    # auto: cuDNN first; FA2 cannot take a mask; math always works
    fallbacks = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.CUDNN_ATTENTION] + ([] if has_mask else [SDPBackend.FLASH_ATTENTION]) + fallbacks


@dataclass(frozen=True)
class KeyLengths:
    """A right-padded joint sequence's keys: row b attends over its first `lens[b]` of `total` tokens
    (`lens` (B,) int32 on the device; see the module docstring). Passed where a mask goes."""

    lens: torch.Tensor
    total: int

    @classmethod
    def of_text(cls, txt_mask: torch.Tensor, n_img: int) -> KeyLengths:
        """[image; text] with text mask (B, L_txt) (1 = real, right-padded): image + real text tokens."""
        return cls((txt_mask.sum(dim=1) + n_img).to(torch.int32), n_img + txt_mask.shape[1])

    def mask(self) -> torch.Tensor:
        """The same keys as a (B, 1, 1, total) boolean mask (no host sync)."""
        pos = torch.arange(self.total, device=self.lens.device)
        return (pos[None, :] < self.lens[:, None])[:, None, None, :]


def trim_padding(emb: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Text (B, L, D) + key mask (B, L) -> the same rows without the right padding they all share, and
    no mask when no row is padded: what a batch of just these rows would run (a mask costs ~1.6x)."""
    if mask is None:
        return emb, None
    n = int(mask.sum(dim=1).max())
    emb, mask = emb[:, :n], mask[:, :n]
    return emb, (None if bool(mask.all()) else mask)


class RowTrim:
    """`trim_padding` of rows `rows` of a batch whose mask stays the same tensor from step to step (the
    denoise core's): the mask is read on the host once per mask (and rows), not once per step, where
    the read would stall the GPU queue (~0.3 ms idle per step on an H200). A new or changed mask
    (another tensor, or the same one written in place) is read again."""

    def __init__(self):
        self._seen: tuple | None = None  # (mask, its version, rows, text length kept, mask kept?)

    def __call__(
        self, emb: torch.Tensor, mask: torch.Tensor | None, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is None:
            return emb[rows], None
        c = self._seen
        if c is None or c[0] is not mask or c[1] != mask._version or c[2] != rows:
            e, m = trim_padding(emb[rows], mask[rows])
            c = self._seen = (mask, mask._version, rows, e.shape[1], m is not None)
        return emb[rows, : c[3]], (mask[rows, : c[3]] if c[4] else None)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_wrappers: list[Callable[..., torch.Tensor]] = []


@contextmanager
def wrap_attention(wrapper: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Route every `attention()` call through `wrapper(inner, q, k, v, mask)` inside the block."""
    _wrappers.append(wrapper)
    try:
        yield
    finally:
        _wrappers.remove(wrapper)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q, k, v (B, H, S, Dh) (any strides with Dh contiguous); mask (B, 1, 1, S) bool or None -> (B, H, S, Dh)."""
    fn: AttentionFn = _attention
    for w in _wrappers:  # the first registered ends up innermost
        fn = _bind(w, fn)
    return fn(q, k, v, mask)


JointStream = tuple  # (qkv (B, L, 3*H*D), q-norm gain (D,), k-norm gain (D,), cos (L, D/2), sin (L, D/2))


def joint_attention(
    streams: list[JointStream],
    heads: int,
    head_dim: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention over the concatenated streams (sequence order = list order), from their fused QKV
    projections: QK RMSNorm + RoPE (`kernels.qk_norm_rope`) then `attention()`. -> (B, H, S, D), a
    view of (B, S, H, D) memory (the out projections reshape it without a copy). The result may live
    in a buffer that the next `joint_attention` call reuses: consume it before calling again."""
    wrapped = len(_wrappers) == 1 and hasattr(_wrappers[0], "joint")
    fp8 = attention_backend() == "fp8" and not _wrappers and not isinstance(mask, KeyLengths)
    if wrapped:
        return _wrappers[0].joint(streams, heads, head_dim, mask, _attention)
    if fp8:  # Q, K written in e4m3 by the norm kernel (when an engine runs)
        from .attention_fp8 import fp8_joint_attention

        out = fp8_joint_attention(streams, heads, head_dim, mask, fallback=_cudnn_bf16)
        if out is not None:
            return out
    from ..kernels.qk_norm_rope import joint_qkv

    return attention(*joint_qkv(streams, heads, head_dim), mask)


def _bind(wrapper, inner: AttentionFn) -> AttentionFn:
    return lambda q, k, v, mask: wrapper(inner, q, k, v, mask)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    choice = attention_backend()
    if isinstance(mask, KeyLengths):
        out = _fa3_key_lengths(q, k, v, mask) if choice in ("fa3", "auto") else None
        if out is not None:
            return out
        mask = mask.mask()
    if choice == "fp8":  # CPU: its torch reference; CUDA: an FP8 kernel, or cuDNN bf16 (said once)
        from .attention_fp8 import fp8_attention

        return fp8_attention(q, k, v, mask, fallback=_cudnn_bf16)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if (
        choice in ("fa3", "auto")
        and mask is None
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and fa3_runs(q.device)
    ):
        fa3 = _fa3(allow_fwd=q.dtype == torch.bfloat16)  # fa3-fwd ships no fp16 kernels
        if fa3 is not None:
            out = fa3.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            out = out[0] if isinstance(out, tuple) else out
            return out.transpose(1, 2)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backends(choice, mask is not None), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def key_lengths_free(device: torch.device) -> bool:
    """Whether padded text attended by `KeyLengths` costs (next to) nothing on `device` (bf16
    FlashAttention-3 runs there); elsewhere it becomes a boolean mask, which slows attention."""
    if torch.device(device).type != "cuda" or attention_backend() not in ("auto", "fa3"):
        return False
    fa3 = _fa3(allow_fwd=True) if fa3_runs(torch.device(device)) else None
    return fa3 is not None and hasattr(fa3, "flash_attn_with_kvcache")


AUTO_TEXT_BUCKET = 64  # tokens: what text_bucket="auto" pads to where that is free


def auto_text_bucket(
    cuda_graphs: bool, parallel: object, model: torch.nn.Module, device: torch.device
) -> int:
    """`EngineOptions.text_bucket="auto"`: AUTO_TEXT_BUCKET with CUDA graphs (one graph then serves every
    prompt of a bucket: the mixed serving load captured a few graphs per level instead of about one per
    request, docs/serving.md) where the model takes key lengths and they cost attention nothing
    (`key_lengths_free`); 0 elsewhere (a mask would slow attention) and without graphs or with parallel."""
    ok = cuda_graphs and parallel is None and getattr(model, "takes_key_lengths", False)
    return AUTO_TEXT_BUCKET if ok and key_lengths_free(device) else 0


def _fa3_key_lengths(q, k, v, keys: KeyLengths) -> torch.Tensor | None:
    """FlashAttention-3 over each row's first `keys.lens[b]` keys, or None where it cannot run."""
    if not (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and fa3_runs(q.device)
    ):
        return None
    fa3 = _fa3(allow_fwd=q.dtype == torch.bfloat16)
    if fa3 is None or not hasattr(fa3, "flash_attn_with_kvcache"):
        return None
    out = fa3.flash_attn_with_kvcache(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=keys.lens
    )  # (B, S, H, D) in
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def _cudnn_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The "fp8" backend's fallback: what "auto" runs minus FA3 (cuDNN first, exact fallbacks after it)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backends("auto", mask is not None), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
