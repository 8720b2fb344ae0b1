"""The Qwen-Image ControlNet (InstantX Union / Inpainting) in plain torch: the same function as
diffusers' `QwenImageControlNetModel` and `QwenImageMultiControlNetModel`.

A ControlNet is a short copy of the MMDiT (5 blocks for InstantX Union) whose image stream starts
from `img_in(noise) + controlnet_x_embedder(control latents)`; after each of its blocks a zero-
initialised Linear (`controlnet_blocks.i`) turns the image stream into a residual, scaled by the
conditioning scale. The transformer adds residual k after its blocks i with i // ceil(60 / K) == k
(`QwenImageTransformer.forward(block_residuals=...)`).

Its blocks are the transformer's own `TransformerBlock`s (fused kernels, FP8 Linears after
`quantize_model`), its parameters keep diffusers' names (Q/K/V fused on load like the transformer's),
so diffusers folders and the InstantX / ComfyUI single files load with the transformer's key rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ..config import ControlNetConfig
from ..runtime.contract import BlockModel
from .rope import rope_tables
from .transformer import (
    RMSNorm,
    TimeTextEmbed,
    TransformerBlock,
    _normalize_shapes,
    block_linears,
    joint_attention_mask,
)

__all__ = ["QwenImageControlNetModel", "QwenImageMultiControlNetModel", "ControlNets"]


class QwenImageControlNetModel(BlockModel):
    """One ControlNet; `forward` returns its K scaled residuals (diffusers' `controlnet_block_samples`).
    A `runtime.contract.BlockModel`: the fused switch and FP8 reach it as they reach the transformer; it
    runs its own short block loop (no block runner: the transformer's runner owns the denoising loop)."""

    def __init__(self, cfg: ControlNetConfig):
        super().__init__()
        self.cfg = cfg
        tcfg = cfg.transformer_config()
        dim = tcfg.inner_dim
        self.time_text_embed = TimeTextEmbed(dim, use_additional_t_cond=False)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(tcfg) for _ in range(cfg.num_layers)])
        self.controlnet_blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(cfg.num_layers)])
        self.controlnet_x_embedder = nn.Linear(cfg.in_channels + cfg.extra_condition_channels, dim)

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
        """The transformer's block Linears in its blocks; `controlnet_blocks` (zero-initialised) stay bf16."""
        return block_linears("transformer_blocks", len(self.transformer_blocks))

    @property
    def cond_channels(self) -> int:
        """Channels of the packed control latents it takes (64, or 68 for the inpainting net)."""
        return self.controlnet_x_embedder.in_features

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, N, 64) packed noise latents
        controlnet_cond: torch.Tensor,  # (B, N, 64 + extra) packed control latents
        conditioning_scale: float,
        encoder_hidden_states: torch.Tensor,  # (B, L, joint_attention_dim)
        encoder_hidden_states_mask: torch.Tensor | None,  # (B, L), 1 = real; None = all real
        timestep: torch.Tensor,  # (B,) sigma
        img_shapes: list,  # [(1, h/16, w/16)] (or diffusers' per-sample nesting)
    ) -> list[torch.Tensor]:  # K x (B, N, D)
        cfg = self.cfg
        if (
            controlnet_cond.shape[:2] != hidden_states.shape[:2]
            or controlnet_cond.shape[2] != self.cond_channels
        ):
            raise ValueError(
                f"controlnet_cond has shape {tuple(controlnet_cond.shape)}; this ControlNet takes "
                f"{(*hidden_states.shape[:2], self.cond_channels)} (packed control latents of the "
                "output size)"
            )
        img = self.img_in(hidden_states)
        img = img + self.controlnet_x_embedder(controlnet_cond.to(img.dtype))  # (B, N, D)
        temb = self.time_text_embed(timestep.to(img.dtype), img.dtype)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        attn_mask = joint_attention_mask(encoder_hidden_states_mask, img.shape[1])
        rope = rope_tables(cfg.axes_dims_rope, _normalize_shapes(img_shapes), txt.shape[1], img.device)
        out = []
        for block, proj in zip(self.transformer_blocks, self.controlnet_blocks):
            img, txt = (block.forward_fused if self.fused else block)(img, txt, temb, attn_mask, rope, None)
            out.append(proj(img) * conditioning_scale)
        return out


class QwenImageMultiControlNetModel(nn.Module):
    """Several control images: diffusers' `QwenImageMultiControlNetModel`.

    With one net (diffusers' only supported case, "ControlNet-Union with multiple conditions") every
    control image goes through it; with several nets (a qwenfast extension: diffusers raises), net i
    takes image i. The residuals of all conditions are summed in order.
    """

    def __init__(self, controlnets: Sequence[QwenImageControlNetModel]):
        super().__init__()
        self.nets = nn.ModuleList(controlnets)
        if not len(self.nets):
            raise ValueError("QwenImageMultiControlNetModel needs at least one ControlNet")
        if len({n.cfg.num_layers for n in self.nets}) > 1:
            raise ValueError(
                "ControlNets with different numbers of layers cannot be summed (their residuals map "
                "onto different blocks); use nets of the same kind"
            )

    def net_for(self, i: int) -> QwenImageControlNetModel:
        return self.nets[0] if len(self.nets) == 1 else self.nets[i]

    def forward(
        self,
        hidden_states,
        controlnet_cond: Sequence[torch.Tensor],
        conditioning_scale: Sequence[float],
        encoder_hidden_states,
        encoder_hidden_states_mask,
        timestep,
        img_shapes,
    ) -> list[torch.Tensor]:
        if len(self.nets) > 1 and len(controlnet_cond) != len(self.nets):
            raise ValueError(
                f"{len(self.nets)} ControlNets need {len(self.nets)} control images, got "
                f"{len(controlnet_cond)}"
            )
        total = None
        for i, (cond, scale) in enumerate(zip(controlnet_cond, conditioning_scale)):
            r = self.net_for(i)(
                hidden_states,
                cond,
                scale,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                timestep,
                img_shapes,
            )
            total = r if total is None else [a + b for a, b in zip(total, r)]
        return total


ControlNets = QwenImageControlNetModel | QwenImageMultiControlNetModel
