"""The Qwen-Image-2.1 transformer in plain torch: the same function as diffusers'
`QwenImage21Transformer2DModel` (single stream, block-causal, one shared modulation).

The joint sequence is the Qwen3-VL sequence with every image slot expanded to the 2x2 latent tokens
it stands for: text tokens (from `txt_in`) and condition-image latents (from `img_in`) interleave as
the prompt template put them, and the target image's tokens come last. Attention is block-causal:
causal over the sequence, bidirectional inside each image block. With `causal_condition` the text
and condition tokens are modulated with t = 0, so their keys and values do not depend on the step:
the first step can store them (`PrefixKVCache`, "extract") and later steps run only the target
tokens against the stored prefix ("cached").

Layout choices, made once at load time: Q|K|V in one Linear (`attn.to_qkv`), the SwiGLU gate and
up projections in one Linear (`img_mlp.gate_up`, gate rows first, as ComfyUI stores it); every
other tensor keeps its diffusers name. Host-side bookkeeping of a sequence (positions, RoPE tables,
block segments) is computed once per layout (`Layout21`) and cached, not per step.

Precision follows diffusers op for op (zero-centred RMSNorm and RoPE in fp32, LayerNorm in the
model dtype, tanh gates), because the reference path must reproduce diffusers' images. The
"cached" steps, where the time goes, also have a fused path (Triton LayerNorm+modulation, QK-norm +
RoPE written straight into the cache buffers, fused gated residual).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, fields
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels.adaln import layernorm_modulate
from ..kernels.gated_residual import gated_residual, gated_residual_layernorm_modulate
from ..kernels.qk_norm_rope import qk_norm_rope
from ..kernels.swiglu import silu_mul
from ..runtime.attention import attention
from ..runtime.blocks import StepContext
from ..runtime.contract import DenoisableTransformer
from .kvcache21 import PrefixKVCache, project_qkv, qkv_buffer
from .rope import _axis_angles, apply_rope
from .transformer import RMSNorm, block_linears

SLOT = 4  # latent tokens per vision-language image slot (2x2)
# the block Linears FP8 replaces (`fp8_linears`); the shared modulation and the embedders stay bf16
BLOCK_LINEARS21 = ("attn.to_qkv", "attn.to_out.0", "img_mlp.gate_up", "img_mlp.out")


@dataclass(frozen=True)
class Transformer21Config:
    """`QwenImage21Transformer2DModel` config (transformer/config.json)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        return self.out_channels or self.in_channels

    def __post_init__(self):
        if self.patch_size != 1:
            raise ConfigError(
                f"transformer config: patch_size {self.patch_size} is not supported (2.1 uses 1)"
            )
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(a % 2 for a in self.axes_dims_rope):
            raise ConfigError(
                f"transformer config: axes_dims_rope {tuple(self.axes_dims_rope)} must be even and sum "
                f"to attention_head_dim {self.attention_head_dim}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> Transformer21Config:
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in names)
        if unknown:
            raise ConfigError(
                f"transformer/config.json: unknown config fields {unknown}; is this Qwen-Image-2.1?"
            )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})

    def flops_per_forward(self, tokens: int, batch: int = 1) -> float:
        """Matmul + attention FLOPs of a forward over `tokens` tokens attending to themselves."""
        d, L = self.inner_dim, tokens
        per_block = 2 * L * (4 * d * d + 3 * d * d * self.mlp_ratio) + 2 * 2 * L * L * d
        return batch * self.num_layers * per_block


# ---------------------------------------------------------------------------------------------
# Host-side layout of one joint sequence


@dataclass(frozen=True)
class Layout21:
    """Where every token of the joint sequence comes from, for one (image-slot mask, img_shapes).

    S tokens = text positions (from the prompt embedding, in order) + image positions (condition
    latents in order, then the target's). `prefix` = tokens before the target block.
    """

    S: int
    prefix: int
    text_pos: torch.Tensor  # (Lt,) joint positions of text tokens
    vl_text: torch.Tensor  # (Lt,) the same tokens' positions in the prompt embedding
    img_pos: torch.Tensor  # (Ni,) joint positions of image tokens, latent order
    segments: tuple[tuple[int, int, bool], ...]  # prefix runs (start, end, is_text)
    cos: torch.Tensor  # (S, Dh/2) fp32
    sin: torch.Tensor


def _frame_positions(is_img: list[bool], img_shapes) -> tuple[list[int], list[int], list[int]]:
    """diffusers' QwenImage21Rope index bookkeeping: (frame, image h, image w) index lists."""
    frame, ih, iw = [], [], []
    cursor = position = 0
    for _, h, w in img_shapes:
        start = is_img.index(True, cursor)
        frame.extend(range(position, position + start - cursor))
        position += start - cursor
        cursor = start + h * w
        frame.extend([position] * (h * w))
        position += max(h, w)
        ih.extend(r for r in range(-(h - h // 2), h // 2) for _ in range(w))
        iw.extend(c for _ in range(h) for c in range(-(w - w // 2), w // 2))
    if cursor < len(is_img):
        frame.extend(range(position, position + len(is_img) - cursor))
    return frame, ih, iw


def build_layout(
    vl_mask: tuple[bool, ...], img_shapes: tuple[tuple[int, int, int], ...], axes: tuple[int, int, int]
) -> Layout21:
    """The layout of the sequence whose vision-language slots are `vl_mask` (text L + target slots)."""
    vm = torch.tensor(vl_mask, dtype=torch.bool)
    is_img = torch.repeat_interleave(vm, torch.where(vm, SLOT, 1))  # (S,)
    lengths = [f * h * w for f, h, w in img_shapes]
    img_pos = is_img.nonzero(as_tuple=True)[0]
    if sum(lengths) != img_pos.numel():
        raise ValueError(
            f"img_shapes account for {sum(lengths)} image tokens but the prompt's image slots hold "
            f"{img_pos.numel()}"
        )
    S = is_img.numel()
    prefix = S - lengths[-1]
    if not bool(is_img[prefix:].all()):
        raise ValueError("the target image's tokens must end the sequence")
    ids = torch.full((S,), -1, dtype=torch.long)
    ids[img_pos] = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
    runs, start, plist = [], 0, ids[:prefix].tolist()
    for i in range(1, prefix + 1):
        if i == prefix or plist[i] != plist[start]:
            runs.append((start, i, plist[start] < 0))
            start = i
    frame, ih, iw = _frame_positions(is_img.tolist(), img_shapes)
    f = torch.tensor(frame, dtype=torch.long)
    h, w = f.clone(), f.clone()
    h[is_img], w[is_img] = torch.tensor(ih, dtype=torch.long), torch.tensor(iw, dtype=torch.long)
    ang = torch.cat([_axis_angles(p, d) for p, d in zip((f, h, w), axes)], dim=-1)  # (S, Dh/2)
    return Layout21(
        S,
        prefix,
        (~is_img).nonzero(as_tuple=True)[0],
        (~vm).nonzero(as_tuple=True)[0],
        img_pos,
        tuple(runs),
        ang.cos(),
        ang.sin(),
    )


def shard_layout(lay: Layout21, start: int, end: int) -> Layout21:
    """The layout one sequence-parallel rank runs: the whole prefix (text and condition tokens,
    replicated: they never attend to the target), then only the target tokens [start, end)."""
    P, N = lay.prefix, lay.S - lay.prefix
    if not 0 <= start < end <= N:
        raise ValueError(f"shard [{start}, {end}) is not a non-empty part of the {N} target tokens")
    keep = torch.cat([torch.arange(P), torch.arange(P + start, P + end)])
    img_pos = torch.cat([lay.img_pos[: lay.img_pos.numel() - N], torch.arange(P, P + end - start)])
    return Layout21(
        P + end - start, P, lay.text_pos, lay.vl_text, img_pos, lay.segments, lay.cos[keep], lay.sin[keep]
    )


# ---------------------------------------------------------------------------------------------
# Layers


@lru_cache(maxsize=8)
def _sinusoid_freqs(half: int, device: str) -> torch.Tensor:
    # computed on the CPU, where diffusers computes its (non-persistent, fp32) `freqs` buffer at
    # construction: the same bits on every device. (A model cast with `.to(bf16)` would round that
    # buffer to bf16 and move t's embedding by ~10%; `from_pretrained(torch_dtype=...)` does not.)
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half)
    return freqs.to(device)


def timestep_sinusoid21(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """QwenImage21TemporalTimesteps: (B,) -> (B, dim) fp32, cos first, 1000 * t before the product."""
    freqs = _sinusoid_freqs(dim // 2, str(t.device))
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ZeroCenterRMSNorm(nn.Module):
    """RMSNorm with the gain stored as `scale - 1`, all in fp32 (2.1's `txt_in.text_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rrms = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + self.eps)
        return (xf * rrms * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    def __init__(self, context_in_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = ZeroCenterRMSNorm(context_in_dim, eps)
        self.in_layer = nn.Linear(context_in_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepEmbedder21(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(256, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeEmbed21(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder21(dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoid21(t).to(dtype))  # (B, D)


class SwiGLU(nn.Module):
    """out(silu(gate(x)) * up(x)); `gate_up` holds the gate rows then the up (`proj`) rows."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.out(F.silu(g) * u)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(silu_mul(self.gate_up(x)))  # silu(gate) * up in one pass


class Attention21(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.norm_q = RMSNorm(head_dim, eps)
        self.norm_k = RMSNorm(head_dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim, bias=False)])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, L, D) -> q, k, v (B, H, L, Dh): QK-norm (cast back to v's dtype) and RoPE, as diffusers."""
        B, L = x.shape[:2]
        q, k, v = self.to_qkv(x).view(B, L, 3, self.heads, self.head_dim).unbind(2)  # (B, L, H, Dh)
        q, k = self.norm_q(q).to(v.dtype), self.norm_k(k).to(v.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.to_out[0](o.transpose(1, 2).flatten(2))  # (B, H, L, Dh) -> (B, L, D)


def block_causal_attention(q, k, v, segments, prefix: int, key_valid: torch.Tensor | None) -> torch.Tensor:
    """The prefill's block-causal attention as diffusers' SDPA processor runs it: each prefix run
    attends to everything up to its own end (text runs causally inside), the target to all keys.
    q, k, v (B, H, S, Dh); key_valid (B, S) bool or None -> (B, H, S, Dh), stored token-major (each
    piece is written into its rows: no concatenation, and the out projection reads it as a view)."""
    B, H, S, Dh = q.shape
    o = qkv_buffer(B, H, S, Dh, q.dtype, q.device)
    for start, end, is_text in segments:
        mask = None
        if is_text:
            n = end - start
            mask = torch.cat(
                [
                    torch.ones(n, start, dtype=torch.bool, device=q.device),
                    torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device)),
                ],
                dim=1,
            )[None, None]
        if key_valid is not None:
            kv = key_valid[:, None, None, :end]
            mask = kv if mask is None else mask & kv
        o[:, :, start:end] = attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask)
    o[:, :, prefix:] = attention(
        q[:, :, prefix:], k, v, None if key_valid is None else key_valid[:, None, None, :]
    )
    return o


class Block21(nn.Module):
    def __init__(self, cfg: Transformer21Config):
        super().__init__()
        dim = cfg.inner_dim
        self.eps = cfg.eps
        self.attn = Attention21(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps)
        self.img_mlp = SwiGLU(dim, dim * cfg.mlp_ratio)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def forward(self, x: torch.Tensor, mod: tuple[torch.Tensor, ...], ctx: _Ctx, i: int) -> torch.Tensor:
        """The reference (diffusers' op order). x (B, L, D); mod: (scale1, gate1, scale2, gate2),
        each (B|1, L|1, D) rows per token."""
        sc1, g1, sc2, g2 = mod
        q, k, v = self.attn.qkv(self._norm(x) * (1 + sc1), ctx.cos, ctx.sin)  # (B, H, L, Dh)
        if ctx.mode == "cached":  # the target's keys after the stored prefix: same values as diffusers' cat
            kb, vb = ctx.cache.layers[i]
            kb[:, :, ctx.prefix :].copy_(k)
            vb[:, :, ctx.prefix :].copy_(v)
            o = attention(q, kb, vb, ctx.key_mask)
        else:
            if ctx.mode == "extract":
                kb, vb = ctx.cache.layers[i]
                kb.copy_(k)
                vb.copy_(v)
            o = block_causal_attention(q, k, v, ctx.segments, ctx.prefix, ctx.key_valid)
        x = x + g1.tanh() * self.attn.out(o)
        x = x + g2.tanh() * self.img_mlp(self._norm(x) * (1 + sc2))
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x

    def forward_fused(
        self,
        x: torch.Tensor,
        mod: tuple[torch.Tensor, ...],
        ctx: _Ctx,
        i: int,
        h: torch.Tensor | None = None,
        norm_next: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same block with fused kernels: LayerNorm + scale in one pass, QK-norm + RoPE written
        straight into the (B, H, S, Dh) query/key/value buffers (the KV cache's when there is one),
        the attention residual fused with the next LayerNorm + scale, SwiGLU's silu * up in one pass.
        -> (x, the next block's normed input or None).

        mod: (scale1, tanh(gate1), scale2, tanh(gate2)) as (R, D) rows: R = B, or 2B with
        `ctx.split` (tokens from `split` on take row B + b: the t=0 rows first, then the real ones).
        h: this block's LayerNorm + scale1 of x when the previous block made it. norm_next: make the
        next block's (every block shares the modulation, so it is LN(x_out) * (1 + scale1)) in the
        MLP residual's pass: one read of x fewer and one launch fewer per block.
        """
        sc1, g1, sc2, g2 = mod
        a = self.attn
        qb, kb, vb = ctx.buffers(i)
        split, zero = ctx.split, ctx.zero
        if h is None:
            h = layernorm_modulate(x, zero, sc1, self.eps, split)
        qkv, v_out = project_qkv(a.to_qkv, h, vb, ctx.offset)  # (B, L, 3|2 H Dh)
        qk_norm_rope(
            qkv, a.norm_q.weight, a.norm_k.weight, ctx.cos, ctx.sin, qb, kb, v_out, offset=ctx.offset
        )
        if ctx.mode == "cached":
            o = attention(qb[:, :, ctx.prefix :], kb, vb, ctx.key_mask)
        else:
            o = block_causal_attention(qb, kb, vb, ctx.segments, ctx.prefix, ctx.key_valid)
        x, h = gated_residual_layernorm_modulate(x, a.out(o), g1, zero, sc2, self.eps, split)
        m = self.img_mlp.forward_fused(h)
        if norm_next and x.dtype != torch.float16:  # (fp16 clips x first)
            return gated_residual_layernorm_modulate(x, m, g2, zero, sc1, self.eps, split)
        x = gated_residual(x, m, g2, split)
        return (x.clip(-65504, 65504) if x.dtype == torch.float16 else x), None


@dataclass
class _Ctx:
    mode: str | None
    cos: torch.Tensor  # (L, Dh/2) fp32 rows of this forward's tokens
    sin: torch.Tensor
    prefix: int
    segments: tuple
    key_valid: torch.Tensor | None  # (B, S) bool
    key_mask: torch.Tensor | None  # (B, 1, 1, S) bool for the target's attention
    cache: PrefixKVCache | None
    # the fused path
    offset: int = 0  # where this forward's tokens start in the (B, H, S, Dh) buffers
    split: int | None = None  # modulation rows: see Block21.forward_fused
    zero: torch.Tensor | None = None  # (R, D) zero shift
    scratch: tuple[torch.Tensor, ...] | None = None  # q, k, v buffers when there is no cache

    def buffers(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cache is None:
            return self.scratch
        return (self.cache.q, *self.cache.layers[i])


# ---------------------------------------------------------------------------------------------
# The model


class QwenImage21Transformer(DenoisableTransformer):
    """Implements `runtime.contract.DenoisableTransformer`; one modulation shared by every block, so no
    modulation table (the contract's defaults: `modulation_table` None, nothing per block)."""

    # how LoRA files' diffusers module names map onto ours (loading/lora.ModuleIndex): fused pieces
    lora_key = staticmethod(lambda key: checkpoint_key(key))
    lora_names = staticmethod(lambda key: diffusers_keys(key))

    def __init__(self, cfg: Transformer21Config):
        super().__init__()
        self.cfg = cfg
        dim = cfg.inner_dim
        self.time_text_embed = TimeEmbed21(dim)
        self.txt_in = TextProjection(cfg.context_in_dim, dim, cfg.eps)
        self.img_in = nn.Linear(cfg.in_channels, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList([Block21(cfg) for _ in range(cfg.num_layers)])
        self.norm_out_linear = nn.Linear(dim, dim, bias=False)
        self.proj_out = nn.Linear(dim, cfg.out_dim, bias=False)
        self._layouts: OrderedDict = OrderedDict()
        self._dev_layouts: OrderedDict = OrderedDict()

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer_blocks

    def fp8_linears(self) -> list[str]:
        return block_linears("transformer_blocks", len(self.transformer_blocks), BLOCK_LINEARS21)

    def layout(self, vl_mask: torch.Tensor, img_shapes, shard: tuple[int, int] | None = None) -> Layout21:
        """`Layout21` of a joint sequence (cached), or of a rank's `shard` of its target tokens. Pass
        `vl_mask` on the CPU where the forward must not synchronise (a CUDA-graph capture): a device
        mask is copied to the host here."""
        shapes = tuple(tuple(int(v) for v in s) for s in img_shapes)
        key = (tuple(bool(b) for b in vl_mask.tolist()), shapes, shard)
        if key not in self._layouts:
            if len(self._layouts) >= 16:
                self._layouts.popitem(last=False)
            self._layouts[key] = (
                build_layout(key[0], shapes, tuple(self.cfg.axes_dims_rope))
                if shard is None
                else shard_layout(self.layout(vl_mask, img_shapes), *shard)
            )
        self._layouts.move_to_end(key)
        return self._layouts[key]

    def _on_device(self, lay: Layout21, device) -> tuple[torch.Tensor, ...]:
        key = (id(lay), str(device))
        if key not in self._dev_layouts:
            if len(self._dev_layouts) >= 16:
                self._dev_layouts.popitem(last=False)
            self._dev_layouts[key] = (
                lay,
                *(t.to(device) for t in (lay.text_pos, lay.vl_text, lay.img_pos, lay.cos, lay.sin)),
            )
        return self._dev_layouts[key][1:]

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, Nc + N, C) condition latents first, the target's last
        encoder_hidden_states: torch.Tensor,  # (B, L, context_in_dim) prompt embedding (with image slots)
        encoder_hidden_states_mask: torch.Tensor | None,  # (B, L) 1 = real token; None = all real
        timestep: torch.Tensor,  # (B,) sigma in [0, 1]
        img_shapes: list[
            tuple[int, int, int]
        ],  # (1, h, w) latent grid per image, condition first, target last
        img_mask: torch.Tensor,  # (L + N/4,) or (B, L + N/4) bool: image slots (row 0 is the layout)
        kv_cache: PrefixKVCache | None = None,
        kv_cache_mode: str | None = None,  # None | "extract" (prefill, store) | "cached" (target only)
        step: StepContext | None = None,
        shard: tuple[int, int] | None = None,  # sequence parallel: this rank's target tokens [start, end)
    ) -> torch.Tensor:  # (B, N | end - start, out_channels): the target image's (shard's) prediction
        cfg = self.cfg
        if kv_cache is not None and not cfg.causal_condition:
            raise ValueError(
                "kv_cache requires causal_condition=True (prefix activations must not depend on t)"
            )
        if (kv_cache is None) != (kv_cache_mode is None) or kv_cache_mode not in (None, "extract", "cached"):
            raise ValueError(f"kv_cache_mode {kv_cache_mode!r} needs a kv_cache (and 'extract' or 'cached')")
        B = hidden_states.shape[0]
        vl = img_mask[0] if img_mask.dim() == 2 else img_mask
        lay = self.layout(vl, img_shapes, shard)
        N = (
            lay.S - lay.prefix
        )  # the target tokens this forward runs (a shard's only, under sequence parallel)
        text_pos, vl_text, img_pos, cos, sin = self._on_device(lay, hidden_states.device)
        cached = kv_cache_mode == "cached"
        H, Dh = cfg.num_attention_heads, cfg.attention_head_dim
        if cached:
            kv_cache.check(B, lay.S, lay.prefix)
        elif kv_cache is not None:
            kv_cache.ensure(B, H, lay.S, Dh, self.dtype, hidden_states.device)

        # one shared modulation for all blocks, computed once per forward
        t = timestep.to(self.dtype)
        if cfg.causal_condition:
            t = torch.cat([t, t.new_zeros(1)])
        temb = self.time_text_embed(t, self.dtype)  # (B|B+1, D)
        mods = self.modulation(temb).chunk(4, dim=-1)  # scale1, gate1, scale2, gate2: (B|B+1, D) each

        key_valid = None
        if encoder_hidden_states_mask is not None:
            key_valid = torch.ones(B, lay.S, dtype=torch.bool, device=hidden_states.device)
            key_valid[:, text_pos] = encoder_hidden_states_mask.bool()[:, vl_text]
        key_mask = None if key_valid is None else key_valid[:, None, None, :]

        if cached:
            x = self.img_in(hidden_states[:, -N:])  # (B, N, D)
            cos, sin = cos[lay.prefix :], sin[lay.prefix :]
        else:
            img = self.img_in(hidden_states)
            txt = self.txt_in(encoder_hidden_states[:, vl_text])
            x = img.new_empty(B, lay.S, img.shape[-1])
            x[:, text_pos] = txt
            x[:, img_pos] = img
        ctx = _Ctx(kv_cache_mode, cos, sin, lay.prefix, lay.segments, key_valid, key_mask, kv_cache)
        split_rows = cfg.causal_condition and not cached  # prefix tokens take the t=0 rows
        if self.fused:
            rows = [m[:B] for m in mods]  # every token of a cached step is a target token
            if split_rows:  # (2B, D): t=0 rows for tokens before `prefix`, the real ones from there on
                rows = [torch.cat([m[B:].expand(B, -1), m[:B]]) for m in mods]
                ctx.split = lay.prefix
            rows = [rows[0], rows[1].tanh(), rows[2], rows[3].tanh()]
            ctx.zero = torch.zeros_like(rows[0])
            ctx.offset = lay.prefix if cached else 0
            if kv_cache is None:
                ctx.scratch = tuple(qkv_buffer(B, H, lay.S, Dh, x.dtype, x.device) for _ in range(3))
            blocks_call = Block21.forward_fused
        else:
            if split_rows:
                target = (torch.arange(x.shape[1], device=x.device) >= lay.prefix)[None, :, None]
                rows = [torch.where(target, m[:B, None], m[B:, None]) for m in mods]
            else:
                rows = [m[:B, None] for m in mods]
            blocks_call = Block21.forward

        last, fused = len(self.transformer_blocks) - 1, self.fused
        made: list = [None]  # (block index, its output x, x's version, the next block's normed input)

        def call(i: int, block: Block21, x: torch.Tensor, none: torch.Tensor):
            if not fused:
                return blocks_call(block, x, rows, ctx, i), none
            # the previous block's normed output is this block's input only if the runner handed its
            # x on untouched (a step cache skips blocks and adds residuals: then it is recomputed)
            m = made[0]
            h = m[3] if m is not None and m[0] == i - 1 and m[1] is x and m[2] == x._version else None
            x, h_next = blocks_call(block, x, rows, ctx, i, h, norm_next=i < last)
            made[0] = None if h_next is None else (i, x, x._version, h_next)
            return x, none

        # the runner seam carries two streams (Qwen-Image's image and text); 2.1 is single-stream, so the
        # second is an empty (B, 0, D) view: a step cache stores and adds its (empty) residual unchanged
        x, _ = self.block_runner.run(self.transformer_blocks, call, x, x[:, :0], step)
        if kv_cache_mode == "extract":
            kv_cache.prefix, kv_cache.ready = lay.prefix, True

        x = x[:, -N:]
        scale = self.norm_out_linear(F.silu(temb[:B]).to(x.dtype))[:, None]  # targets use the real rows
        x = F.layer_norm(x, (x.shape[-1],), eps=cfg.eps) * (1 + scale)
        return self.proj_out(x)


# ---------------------------------------------------------------------------------------------
# Checkpoint layout


def checkpoint_key(key: str) -> tuple[str, int, int] | tuple[str, None, None]:
    """A diffusers (or ComfyUI) 2.1 key -> (our key, slot, pieces) for tensors fused at load time
    (to_q/k/v -> to_qkv, gate_layer/proj -> gate_up), else (our key, None, None)."""
    if key.startswith("model.diffusion_model."):
        key = key[len("model.diffusion_model.") :]
    for old, slot in (("attn.to_q.", 0), ("attn.to_k.", 1), ("attn.to_v.", 2)):
        if old in key:
            return key.replace(old, "attn.to_qkv."), slot, 3
    for old, slot in (("img_mlp.gate_layer.", 0), ("img_mlp.proj.", 1)):
        if old in key:
            return key.replace(old, "img_mlp.gate_up."), slot, 2
    if key.startswith("norm_out.linear."):
        return key.replace("norm_out.linear.", "norm_out_linear."), None, None
    if key.startswith("modulation.1."):
        return key, None, None
    return key, None, None


def diffusers_keys(key: str) -> list[str]:
    """Inverse of `checkpoint_key`: the diffusers keys whose tensors make up our tensor `key`."""
    for fused, parts in (
        ("attn.to_qkv.", ("attn.to_q.", "attn.to_k.", "attn.to_v.")),
        ("img_mlp.gate_up.", ("img_mlp.gate_layer.", "img_mlp.proj.")),
    ):
        if fused in key:
            return [key.replace(fused, p) for p in parts]
    if key.startswith("norm_out_linear."):
        return [key.replace("norm_out_linear.", "norm_out.linear.")]
    return [key]
