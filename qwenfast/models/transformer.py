"""The Qwen-Image MMDiT in plain torch: the same function as diffusers' `QwenImageTransformer2DModel`.

Layout choices (all made once, at load time, never in `forward`):
- Q, K and V of each stream live in one fused Linear (`attn.to_qkv` for the image stream,
  `attn.add_qkv_proj` for the text stream): one GEMM instead of three. `fuse_qkv_key` tells the
  loader how diffusers' separate `to_q/to_k/to_v` tensors map onto the fused ones.
- Every other parameter keeps its diffusers name, so LoRA files and ComfyUI files map 1:1.
- RoPE uses real cos/sin tables (no complex tensors), computed in fp32 exactly as diffusers computes
  its complex table, so the rotation is numerically the same.

Precision follows diffusers op for op (LayerNorm output in the model dtype, RMSNorm statistics in
fp32, RoPE in fp32, timestep rounded to the model dtype before its sinusoid), because the reference path
must reproduce diffusers' images for the same seed. Faster fused paths live in `qwenfast.kernels`
and are checked against this file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import TransformerConfig
from ..kernels.adaln import layernorm_modulate, layernorm_modulate_fp8, select_rows
from ..kernels.fp8_linear import QuantizedRows, fp8_consumer
from ..kernels.fp8_rows import fp8_gelu_fusion
from ..kernels.gated_residual import (
    gated_residual,
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_fp8,
)
from ..kernels.gelu import gelu_tanh_fp8, linear_gelu_tanh
from ..kernels.row_lora import plain_linear
from ..runtime.attention import KeyLengths, attention, joint_attention
from ..runtime.blocks import StepContext
from ..runtime.contract import DenoisableTransformer
from ..runtime.modulation import ModulationTable
from ..runtime.parallel import split_over_ranks
from .rope import apply_rope, rope_tables

# ---------------------------------------------------------------------------------------------
# Small layers


class RMSNorm(nn.Module):
    """diffusers' RMSNorm: fp32 statistics, result cast to the weight dtype before the gain."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Sinusoidal timestep features: cos first, scale 1000, fp32 frequencies.

    (B,) -> (B, dim) fp32. `t` arrives already rounded to the model dtype (diffusers casts the
    timestep first); the frequency table stays fp32 (`diffusers.models.embeddings`; the copy in
    transformer_qwenimage.py that rounds it is dead code there).
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    freqs = torch.exp(exponent)
    args = 1000 * (t[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int, use_additional_t_cond: bool):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(256, dim)
        if use_additional_t_cond:
            self.addition_t_embedding = nn.Embedding(2, dim)
        self.use_additional_t_cond = use_additional_t_cond

    def forward(
        self, t: torch.Tensor, dtype: torch.dtype, additional_t_cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(t).to(dtype))  # (B, D)
        if self.use_additional_t_cond:
            if additional_t_cond is None:
                raise ValueError("this checkpoint (use_additional_t_cond) needs `additional_t_cond`")
            emb = emb + self.addition_t_embedding(additional_t_cond).to(dtype)
        return emb


class GeluProj(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """GELU-tanh MLP; `net.0.proj` / `net.2` are diffusers' parameter names."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(GeluProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward_fused(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """`x` arrives as `QuantizedRows` when `net.0.proj` is an FP8Linear fed by a fused producer."""
        p, out = self.net[0].proj, self.net[2]
        if not isinstance(p, nn.Linear):  # FP8Linear: no cuBLASLt GELU epilogue for scaled GEMMs
            h = p(x)  # (B, L, 4D)
            c = fp8_consumer(out, h) if fp8_gelu_fusion() else None  # net.2 quantises it itself (faster)
            return out(
                F.gelu(h, approximate="tanh") if c is None else gelu_tanh_fp8(h, keep=c.lora_reads_input())
            )
        if not plain_linear(p):  # a subclass adds to its GEMM now (per-row LoRAs): no fused epilogue
            return out(F.gelu(p(x), approximate="tanh"))
        return out(linear_gelu_tanh(x, p.weight, p.bias))


class AdaLayerNormOut(nn.Module):
    """AdaLayerNormContinuous: note the (scale, shift) order, unlike the blocks' (shift, scale)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fused: the one-pass kernel (`kernels.adaln`, the blocks' norm1 op order) instead of a
        LayerNorm and two broadcasts over strided chunks: after its one block, the largest piece of
        a cached step."""
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        if fused:
            return layernorm_modulate(x, shift, scale, eps=self.norm.eps)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


# ---------------------------------------------------------------------------------------------
# Blocks


class JointAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_qkv = nn.Linear(dim, 3 * heads * head_dim)  # image stream, fused Q|K|V
        self.add_qkv_proj = nn.Linear(dim, 3 * heads * head_dim)  # text stream, fused Q|K|V
        self.norm_q = RMSNorm(head_dim)
        self.norm_k = RMSNorm(head_dim)
        self.norm_added_q = RMSNorm(head_dim)
        self.norm_added_k = RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim)])
        self.to_add_out = nn.Linear(heads * head_dim, dim)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        attn_mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],  # (img_cos, img_sin, txt_cos, txt_sin) from `rope_tables`
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, Li, Lt = img.shape[0], img.shape[1], txt.shape[1]
        iq, ik, iv = self.to_qkv(img).view(B, Li, 3, self.heads, self.head_dim).unbind(2)  # (B, Li, H, Dh)
        tq, tk, tv = self.add_qkv_proj(txt).view(B, Lt, 3, self.heads, self.head_dim).unbind(2)
        iq, ik = self.norm_q(iq), self.norm_k(ik)
        tq, tk = self.norm_added_q(tq), self.norm_added_k(tk)
        icos, isin, tcos, tsin = rope
        iq, ik = apply_rope(iq, icos, isin), apply_rope(ik, icos, isin)
        tq, tk = apply_rope(tq, tcos, tsin), apply_rope(tk, tcos, tsin)
        # joint sequence is [text; image] ([image; text] for padded text without a mask: KeyLengths)
        img_first = isinstance(attn_mask, KeyLengths)
        q, k, v = (
            torch.cat([i, t] if img_first else [t, i], dim=1).transpose(1, 2)  # (B, H, S, Dh)
            for i, t in ((iq, tq), (ik, tk), (iv, tv))
        )
        o = attention(q, k, v, attn_mask)
        o = o.transpose(1, 2).flatten(2).to(q.dtype)  # (B, S, H*Dh)
        oi, ot = (o[:, :Li], o[:, Li:]) if img_first else (o[:, Lt:], o[:, :Lt])
        return self.to_out[0](oi.contiguous()), self.to_add_out(ot.contiguous())

    def forward_fused(
        self,
        img: torch.Tensor | QuantizedRows,  # (B, Li, D), or its FP8 rows for an FP8 to_qkv
        txt: torch.Tensor | QuantizedRows,
        attn_mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],  # (img_cos, img_sin, txt_cos, txt_sin) from `rope_tables`
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same function; QK-norm + RoPE + the scatter into the joint [text; image] buffers is one
        kernel per stream (no torch.cat), and the buffers are (B, S, H, Dh) so the attention output
        reshapes to (B, S, H*Dh) for the out projections without a copy. Only the shape, dtype and
        device of `img`/`txt` are read here, so pre-quantised rows pass straight to the projections."""
        B, Li, Lt = img.shape[0], img.shape[1], txt.shape[1]
        H, Dh = self.heads, self.head_dim
        icos, isin, tcos, tsin = rope
        qkv_i, qkv_t = self.to_qkv(img), self.add_qkv_proj(txt)  # (B, L, 3*H*Dh)
        streams = [
            (qkv_t, self.norm_added_q.weight, self.norm_added_k.weight, tcos, tsin),
            (qkv_i, self.norm_q.weight, self.norm_k.weight, icos, isin),
        ]  # joint order: [text; image] ([image; text] with KeyLengths, as `forward`)
        if img_first := isinstance(attn_mask, KeyLengths):
            streams.reverse()
        o = joint_attention(streams, H, Dh, attn_mask).transpose(1, 2).reshape(B, Lt + Li, H * Dh)
        oi, ot = (o[:, :Li], o[:, Li:]) if img_first else (o[:, Lt:], o[:, :Lt])
        return self.to_out[0](oi), self.to_add_out(ot)


def _norm_modulate(x, shift, scale, split, consumer: nn.Module) -> torch.Tensor | QuantizedRows:
    """`layernorm_modulate`, or its FP8 rows when `consumer` is an FP8Linear taking them (`fp8_consumer`):
    the quantisation then happens in the same pass (the bf16 output too while it has a LoRA)."""
    c = fp8_consumer(consumer, x)
    if c is None:
        return layernorm_modulate(x, shift, scale, split=split)
    return layernorm_modulate_fp8(x, shift, scale, split=split, keep=c.lora_reads_input())


def _residual_norm_modulate(x, y, gate, shift, scale, split, consumer: nn.Module):
    """`gated_residual_layernorm_modulate`, the modulated output as FP8 rows for an FP8 `consumer`."""
    c = fp8_consumer(consumer, x)
    if c is None:
        return gated_residual_layernorm_modulate(x, y, gate, shift, scale, split=split)
    return gated_residual_layernorm_modulate_fp8(
        x, y, gate, shift, scale, split=split, keep=c.lora_reads_input()
    )


def _modulate(x, mod, split):
    """x*(1+scale)+shift and the gate; tokens from `split` on take the t=0 half (zero_cond_t)."""
    shift, scale, gate = (select_rows(m, x.shape[1], split) for m in mod.chunk(3, dim=-1))  # (B, 1|L, D)
    return x * (1 + scale) + shift, gate


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        dim = cfg.inner_dim
        self.zero_cond_t = cfg.zero_cond_t
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = JointAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim)
        self.img_mlp = FeedForward(dim)
        self.txt_mlp = FeedForward(dim)

    def modulations(self, temb: torch.Tensor) -> torch.Tensor:
        """img_mod(temb) rows then txt_mod(its temb) rows: (R + B, 6D) with R = temb's rows (B, or 2B
        with zero_cond_t). Computed by the block, or up front for every block by the model (and then
        split over sequence-parallel ranks: runtime/parallel.split_over_ranks)."""
        txt_temb = temb.chunk(2, dim=0)[0] if self.zero_cond_t else temb
        return torch.cat([self.img_mod(temb), self.txt_mod(txt_temb)], dim=0)

    def _mods(self, temb: torch.Tensor, mods: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if mods is None:
            mods = self.modulations(temb)
        return mods[: temb.shape[0]], mods[temb.shape[0] :]  # (R, 6D) img, (B, 6D) txt

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        attn_mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        split: int | None,
        mods: torch.Tensor | None = None,  # `modulations(temb)` when the model computed it up front
    ) -> tuple[torch.Tensor, torch.Tensor]:
        im, tm = self._mods(temb, mods)
        img_mod1, img_mod2 = im.chunk(2, dim=-1)  # (B|2B, 3D) each
        txt_mod1, txt_mod2 = tm.chunk(2, dim=-1)

        img_in, img_gate1 = _modulate(self.img_norm1(img), img_mod1, split)
        txt_in, txt_gate1 = _modulate(self.txt_norm1(txt), txt_mod1, None)
        img_attn, txt_attn = self.attn(img_in, txt_in, attn_mask, rope)
        img = img + img_gate1 * img_attn
        txt = txt + txt_gate1 * txt_attn

        img_in, img_gate2 = _modulate(self.img_norm2(img), img_mod2, split)
        img = img + img_gate2 * self.img_mlp(img_in)
        txt_in, txt_gate2 = _modulate(self.txt_norm2(txt), txt_mod2, None)
        txt = txt + txt_gate2 * self.txt_mlp(txt_in)
        if txt.dtype == torch.float16:  # diffusers clips fp16 overflow
            txt, img = txt.clip(-65504, 65504), img.clip(-65504, 65504)
        return img, txt

    def forward_fused(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        attn_mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        split: int | None,
        mods: torch.Tensor | None = None,  # `modulations(temb)` when the model computed it up front
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block with fused kernels: LayerNorm+modulation in one pass, the attention
        residual fused with the next LayerNorm+modulation, cuBLASLt GELU epilogue. `split`: first
        token modulated with t=0 (zero_cond_t), else None."""
        im, tm = self._mods(temb, mods)
        i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = im.chunk(6, dim=-1)  # (B|2B, D) views
        t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = tm.chunk(6, dim=-1)

        # inputs of FP8 Linears come quantised from these kernels (QuantizedRows; kernels/fp8_rows.py)
        img_in = _norm_modulate(img, i_sh1, i_sc1, split, self.attn.to_qkv)
        txt_in = _norm_modulate(txt, t_sh1, t_sc1, None, self.attn.add_qkv_proj)
        img_attn, txt_attn = self.attn.forward_fused(img_in, txt_in, attn_mask, rope)
        img, img_in = _residual_norm_modulate(
            img, img_attn, i_g1, i_sh2, i_sc2, split, self.img_mlp.net[0].proj
        )
        txt, txt_in = _residual_norm_modulate(
            txt, txt_attn, t_g1, t_sh2, t_sc2, None, self.txt_mlp.net[0].proj
        )
        img = gated_residual(img, self.img_mlp.forward_fused(img_in), i_g2, split=split)
        txt = gated_residual(txt, self.txt_mlp.forward_fused(txt_in), t_g2)
        if txt.dtype == torch.float16:
            txt, img = txt.clip(-65504, 65504), img.clip(-65504, 65504)
        return img, txt


# ---------------------------------------------------------------------------------------------
# The model


# The block Linears FP8 replaces (`fp8_linears`): the modulation Linears (tiny GEMVs, and the model's most
# precision-sensitive path), the embedders and the output projection stay bf16.
BLOCK_LINEARS = ("attn.to_qkv", "attn.add_qkv_proj", "attn.to_out.0", "attn.to_add_out",
                 "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")  # fmt: skip
IMAGE_LINEARS = (
    "attn.to_qkv",
    "attn.to_out.0",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
)  # 97% of the FLOPs at 1024²


def block_linears(prefix: str, n_blocks: int, names: Sequence[str] = BLOCK_LINEARS) -> list[str]:
    """Module names of `names` in each of the `n_blocks` blocks registered as `prefix`, block by block."""
    return [f"{prefix}.{i}.{n}" for i in range(n_blocks) for n in names]


class QwenImageTransformer(DenoisableTransformer):
    """The MMDiT; implements `runtime.contract.DenoisableTransformer` (block runner, modulation table)."""

    takes_key_lengths = True

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.inner_dim
        self.time_text_embed = TimeTextEmbed(dim, cfg.use_additional_t_cond)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = AdaLayerNormOut(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_dim)
        # per-timestep modulation rows (runtime/modulation.py); None = computed in every forward
        self._modulation_table: ModulationTable | None = None

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
        return block_linears("transformer_blocks", len(self.transformer_blocks))

    @property
    def modulation_table(self) -> ModulationTable | None:
        return self._modulation_table

    def set_modulation_cache(self, entries: int) -> None:
        """A table with room for `entries` timesteps (kept, entries and all, when its size is unchanged)."""
        if entries == 0:
            self._modulation_table = None
        elif self._modulation_table is None or self._modulation_table.max_entries != entries:
            self._modulation_table = ModulationTable(entries)

    def modulation_modules(self) -> list[tuple[nn.Module, ...]]:
        return [(b.img_mod, b.txt_mod) for b in self.transformer_blocks]

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, L_img, in_channels) packed latents (+ reference latents)
        encoder_hidden_states: torch.Tensor,  # (B, L_txt, joint_attention_dim)
        encoder_hidden_states_mask: torch.Tensor | None,  # (B, L_txt), 1 = real token; None = all real
        timestep: torch.Tensor,  # (B,) sigma in [0, 1]
        img_shapes: list[tuple[int, int, int]],  # (frames, h/16, w/16) per image in the sequence
        additional_t_cond: torch.Tensor | None = None,
        step: StepContext | None = None,  # which denoising step this is (for the block runner)
        shard: tuple[int, int] | None = None,  # sequence parallel: this rank's image tokens [start, end)
        block_residuals: Sequence[torch.Tensor] | None = None,  # ControlNet: K x (B, L_img, D), see below
        modulations: torch.Tensor | None = None,  # (n_blocks, R + B, 6D): `modulation_entries` rows
    ) -> torch.Tensor:  # (B, L_img, 4 * out_channels)
        """`modulations`: every block's modulation vectors for this timestep, from the modulation
        table (`runtime.modulation.batch_rows` of `modulation_entries`); None computes them here.
        `block_residuals` are diffusers' `controlnet_block_samples`: residual k is added to the image
        stream after every block i with i // ceil(num_layers / K) == k. The add happens inside the
        block call handed to the block runner, so it rides along with whatever the runner does
        (offload streaming, step caches) and with the fused kernels and FP8 Linears (it is a plain add
        after the block); under CUDA graphs the residuals are graph inputs (runtime/cuda_graphs.py)."""
        cfg = self.cfg
        img_shapes = _normalize_shapes(img_shapes)
        n_img = sum(f * h * w for f, h, w in img_shapes)
        start, end = shard if shard is not None else (0, n_img)
        if hidden_states.shape[1] != end - start or not 0 <= start <= end <= n_img:
            raise ValueError(
                f"hidden_states has {hidden_states.shape[1]} tokens but img_shapes {img_shapes} give "
                f"{n_img}" + (f" (shard {shard})" if shard is not None else "")
            )
        img = self.img_in(hidden_states)
        t = timestep.to(img.dtype)
        split = None  # zero_cond_t: tokens after the first image are modulated with t=0
        if cfg.zero_cond_t:
            t = torch.cat([t, t * 0], dim=0)
            f, h, w = img_shapes[0]
            split = min(max(f * h * w - start, 0), end - start)  # in this rank's tokens
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_text_embed(t, img.dtype, additional_t_cond)

        if self.key_lengths and encoder_hidden_states_mask is not None:  # padded text, no mask
            attn_mask = KeyLengths.of_text(encoder_hidden_states_mask, img.shape[1])
        else:
            attn_mask = joint_attention_mask(encoder_hidden_states_mask, img.shape[1])
        res, every = _residual_plan(
            block_residuals, len(self.transformer_blocks), img.shape, start, end, n_img
        )
        rope = rope_tables(cfg.axes_dims_rope, img_shapes, txt.shape[1], img.device, cfg.use_layer3d_rope)
        if shard is not None:  # this rank's image positions (the text is whole on every rank)
            rope = (rope[0][start:end], rope[1][start:end], rope[2], rope[3])

        fused = self.fused
        blocks = self.transformer_blocks
        runner = self.block_runner
        mods = modulations
        if mods is not None and (
            mods.shape[0] != len(blocks) or mods.shape[1] != temb.shape[0] + img.shape[0]
        ):
            raise ValueError(
                f"modulations {tuple(mods.shape)} do not fit {len(blocks)} blocks and "
                f"{temb.shape[0]} + {img.shape[0]} embedding rows"
            )
        if mods is None and runner.every_block_resident:  # sequence parallel: each rank computes a share
            mods = split_over_ranks(len(blocks), lambda i: blocks[i].modulations(temb))

        def call(
            i: int, block: TransformerBlock, img: torch.Tensor, txt: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if mods is not None:
                m = mods[i]
            else:  # the runner may keep the modulation weights elsewhere (offload): it brings them in
                with runner.bring(block.img_mod, block.txt_mod):
                    m = block.modulations(temb)
            img, txt = (block.forward_fused if fused else block)(img, txt, temb, attn_mask, rope, split, m)
            if res is not None:  # ControlNet residual of this block (diffusers adds it after the block)
                img = img + res[i // every]
            return img, txt

        img, txt = self.block_runner.run(self.transformer_blocks, call, img, txt, step)

        if cfg.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        return self.proj_out(self.norm_out(img, temb, fused))

    @torch.no_grad()
    def modulation_entries(self, ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Modulation-table entries (runtime/modulation.py) for timesteps `ts` (each (1,), as `forward`
        gets them): per block, `img_mod` and `txt_mod` of that timestep's embedding row -> (n_blocks, 2,
        6D) each. One GEMV per timestep and module, so an entry does not depend on its batch-mates; the
        block runner brings the weights in when it keeps them elsewhere (offload)."""
        dtype = self.dtype
        tembs = [self.time_text_embed(t.to(dtype), dtype) for t in ts]  # (1, D) each
        blocks = self.transformer_blocks
        out = [
            torch.empty(len(blocks), 2, 6 * self.cfg.inner_dim, device=te.device, dtype=te.dtype)
            for te in tembs
        ]
        for i, block in enumerate(blocks):
            with self.block_runner.bring(block.img_mod, block.txt_mod):
                for e, temb in zip(out, tembs):
                    e[i, 0], e[i, 1] = block.img_mod(temb)[0], block.txt_mod(temb)[0]
        return out


def joint_attention_mask(txt_mask: torch.Tensor | None, n_img: int) -> torch.Tensor | None:
    """(B, L_txt) text mask (1 = real) -> the (B, 1, 1, L_txt + n_img) boolean key mask of the joint
    [text; image] attention, or None when there is no text mask."""
    if txt_mask is None:
        return None
    m = txt_mask.to(torch.bool)
    ones = torch.ones(m.shape[0], n_img, dtype=torch.bool, device=m.device)
    return torch.cat([m, ones], dim=1)[:, None, None, :]


def _residual_plan(
    res: Sequence[torch.Tensor] | None, n_blocks: int, img_shape: torch.Size, start: int, end: int, n_img: int
) -> tuple[list[torch.Tensor] | None, int]:
    """ControlNet residuals checked against the image stream (sliced to a sequence-parallel shard) and
    diffusers' block interval ceil(n_blocks / K)."""
    if res is None:
        return None, 1
    res = list(res)
    if not res:
        raise ValueError("block_residuals is empty; pass None for no ControlNet")
    B, n, D = img_shape
    out = []
    for k, r in enumerate(res):
        if r.shape[1] == n_img and n != n_img:
            r = r[:, start:end]
        if tuple(r.shape) != (B, n, D):
            raise ValueError(
                f"block_residuals[{k}] has shape {tuple(r.shape)}, the image stream is {(B, n, D)}: "
                "a ControlNet conditions the noise tokens only (no reference images)"
            )
        out.append(r)
    return out, math.ceil(n_blocks / len(out))


def _normalize_shapes(img_shapes) -> list[tuple[int, int, int]]:
    """Accept diffusers' nested per-sample form [[(1,h,w), ...], ...] or a flat [(1,h,w), ...]."""
    if (
        len(img_shapes)
        and isinstance(img_shapes[0], (list, tuple))
        and len(img_shapes[0])
        and isinstance(img_shapes[0][0], (list, tuple))
    ):
        img_shapes = img_shapes[0]  # diffusers uses the first sample's shapes for the whole batch
    return [tuple(int(v) for v in s) for s in img_shapes]


# ---------------------------------------------------------------------------------------------
# Checkpoint layout


_QKV = {
    "attn.to_q.": ("attn.to_qkv.", 0), "attn.to_k.": ("attn.to_qkv.", 1), "attn.to_v.": ("attn.to_qkv.", 2),
    "attn.add_q_proj.": ("attn.add_qkv_proj.", 0), "attn.add_k_proj.": ("attn.add_qkv_proj.", 1),
    "attn.add_v_proj.": ("attn.add_qkv_proj.", 2),
}  # fmt: skip


def fuse_qkv_key(key: str) -> tuple[str, int] | None:
    """For a diffusers key of a separate Q/K/V tensor: (fused key, slot 0/1/2); else None."""
    for old, (new, slot) in _QKV.items():
        if old in key:
            return key.replace(old, new), slot
    return None


def split_qkv_key(key: str) -> list[str] | None:
    """Inverse of `fuse_qkv_key`: the three diffusers keys whose tensors form a fused tensor."""
    for new in ("attn.to_qkv.", "attn.add_qkv_proj."):
        if new in key:
            return [key.replace(new, old) for old, (n, _) in _QKV.items() if n == new]
    return None
