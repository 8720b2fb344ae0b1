"""Flow-matching Euler sampling for Qwen-Image, plus latent packing and true-CFG.

The schedule is computed with the same numpy float32 arithmetic as diffusers'
`FlowMatchEulerDiscreteScheduler` + `QwenImagePipeline` (linspace in float64, cast to float32, the
exponential shift, the terminal stretch), so sigmas agree bit for bit. The Euler update and the CFG
combination keep diffusers' dtype promotion (a 0-d fp32 sigma times a bf16 prediction stays bf16),
which matters for reproducing the same image in bf16.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import SchedulerConfig


def calculate_shift(image_seq_len: int, cfg: SchedulerConfig) -> float:
    """mu: linear in the number of image tokens between (base_len, base_shift) and (max_len, max_shift)."""
    m = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
    b = cfg.base_shift - m * cfg.base_image_seq_len
    return image_seq_len * m + b


def get_sigmas(
    cfg: SchedulerConfig, num_inference_steps: int, image_seq_len: int, sigmas: list[float] | None = None
) -> torch.Tensor:
    """The N+1 noise levels (last one 0) as float32; timestep for the model = sigma."""
    if sigmas is None:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    s = np.array(sigmas).astype(np.float32)
    if s.ndim != 1 or len(s) < 1:
        raise ValueError("sigmas must be a non-empty 1-D list")
    if cfg.use_dynamic_shifting:
        mu = calculate_shift(image_seq_len, cfg)
        if cfg.time_shift_type == "exponential":
            s = math.exp(mu) / (math.exp(mu) + (1 / s - 1) ** 1.0)
        else:
            s = mu / (mu + (1 / s - 1) ** 1.0)
    else:
        s = cfg.shift * s / (1 + (cfg.shift - 1) * s)
    if cfg.shift_terminal and s[-1] != 1:  # one step: diffusers divides by zero (NaN sigmas); skip
        one_minus_z = 1 - s
        scale = one_minus_z[-1] / (1 - cfg.shift_terminal)
        s = 1 - (one_minus_z / scale)
    out = torch.from_numpy(np.asarray(s)).to(torch.float32)
    if cfg.invert_sigmas:
        out = 1.0 - out
        return torch.cat([out, torch.ones(1)])
    return torch.cat([out, torch.zeros(1)])


def timesteps_from_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """diffusers' scheduler.timesteps (sigma * 1000, float32), without the trailing 0."""
    return sigmas[:-1] * 1000


def model_timestep(t: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """What the pipeline hands the transformer: (t * 1000) cast to the model dtype, then / 1000."""
    return t.expand(batch).to(dtype) / 1000


def euler_step(sample: torch.Tensor, pred: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """x_{t-1} = x_t + (sigma_next - sigma) * v, accumulated in fp32 and cast back to pred's dtype."""
    dt = sigma_next - sigma  # 0-d fp32: keeps pred's dtype in the product, as diffusers does
    return (sample.to(torch.float32) + dt * pred).to(pred.dtype)


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance with the per-token norm of the conditional prediction restored."""
    comb = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)


def latent_hw(height: int, width: int, vae_scale: int = 8) -> tuple[int, int]:
    """Latent grid size; pixel sizes are floored to a multiple of 2*vae_scale (16) like diffusers."""
    return 2 * (int(height) // (vae_scale * 2)), 2 * (int(width) // (vae_scale * 2))


def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): 2x2 patches, channel-major inside a patch."""
    B, C, h, w = z.shape
    z = z.view(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(B, (h // 2) * (w // 2), C * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w); inverse of `pack_latents`."""
    B, _, D = x.shape
    x = x.view(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, D // 4, h, w)
