"""Flow-matching Euler sampling for Qwen-Image: the schedule, latent packing, true-CFG, and the
denoise core every pipeline shares.

`denoise()` is the whole sampling loop as one plain function (flux-style): it takes a forward
callable, the latents, the sigmas and the conditioning, and knows nothing about models, offload,
graphs or servers. Pipelines only prepare conditioning and call it; the OOM back-off splits its
batch; a step cache or a parallel layout plugs in below it (block runner, attention seam), never
into it.

The schedule is computed with the same numpy float32 arithmetic as diffusers'
`FlowMatchEulerDiscreteScheduler` + `QwenImagePipeline` (linspace in float64, cast to float32, the
exponential shift, the terminal stretch), so sigmas agree bit for bit. The Euler update and the CFG
combination keep diffusers' dtype promotion (a 0-d fp32 sigma times a bf16 prediction stays bf16),
which matters for reproducing the same image in bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import SchedulerConfig
from ..runtime.attention import trim_padding
from ..runtime.blocks import StepContext


def calculate_shift(image_seq_len: int, cfg: SchedulerConfig) -> float:
    """mu: linear in the number of image tokens between (base_len, base_shift) and (max_len, max_shift)."""
    m = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
    b = cfg.base_shift - m * cfg.base_image_seq_len
    return image_seq_len * m + b


def get_sigmas(
    cfg: SchedulerConfig,
    num_inference_steps: int,
    image_seq_len: int,
    sigmas: list[float] | None = None,
    mu: float | None = None,
) -> torch.Tensor:
    """The N+1 noise levels (last one 0) as float32; timestep for the model = sigma. `mu`: the
    dynamic shift, when a pipeline computes its own (Layered: sqrt(condition tokens / 256)) instead
    of the linear rule of `calculate_shift`."""
    if sigmas is None:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    s = np.array(sigmas).astype(np.float32)
    if s.ndim != 1 or len(s) < 1:
        raise ValueError("sigmas must be a non-empty 1-D list")
    if cfg.use_dynamic_shifting:
        mu = calculate_shift(image_seq_len, cfg) if mu is None else mu
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


def euler_step(
    sample: torch.Tensor, pred: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """x_{t-1} = x_t + (sigma_next - sigma) * v, accumulated in fp32 and cast back to pred's dtype."""
    dt = sigma_next - sigma  # 0-d fp32: keeps pred's dtype in the product, as diffusers does
    return (sample.to(torch.float32) + dt * pred).to(pred.dtype)


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float, normalize: bool = True) -> torch.Tensor:
    """Classifier-free guidance with the per-token norm of the conditional prediction restored
    (`normalize=False`: the plain combination, Layered's default `cfg_normalize=False`)."""
    comb = uncond + scale * (cond - uncond)
    if not normalize:
        return comb
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)


def plain_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance without the norm rescale (Qwen-Image-2.1's pipeline, Layered's default)."""
    return true_cfg(cond, uncond, scale, normalize=False)


def scale_noise(sample: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching forward process at noise level `sigma`: sigma * noise + (1 - sigma) * sample.

    diffusers' `FlowMatchEulerDiscreteScheduler.scale_noise` (sigma cast to the sample's dtype first),
    which img2img uses for its starting point and inpainting for the known region after each step.
    """
    s = sigma.to(sample.device, sample.dtype)
    return s * noise + (1.0 - s) * sample


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


# ---------------------------------------------------------------------------------------------
# The denoise core


@dataclass(frozen=True)
class TextCond:
    """Prompt conditioning of a batch: embeddings (B, L, D) right-padded, mask (B, L) or None = all real."""

    emb: torch.Tensor
    mask: torch.Tensor | None = None

    def rows(self, i: int, j: int) -> TextCond:
        """Rows i..j, trimmed to their longest prompt (no mask when none of them is padded), so a
        chunk of a split batch runs exactly what it would run as a batch of its own."""
        return TextCond(*trim_padding(self.emb[i:j], None if self.mask is None else self.mask[i:j]))

    def bucketed(self, n: int) -> TextCond:
        """Right-padded (zeros, masked out) to a multiple of `n` tokens (`EngineOptions.text_bucket`;
        0: as it is), so prompts of one bucket share a shape and so a captured graph."""
        B, L, D = self.emb.shape
        pad = -L % n if n else 0
        if not pad:
            return self
        m = torch.ones(B, L, dtype=torch.long, device=self.emb.device) if self.mask is None else self.mask
        return TextCond(
            torch.cat([self.emb, self.emb.new_zeros(B, pad, D)], dim=1),
            torch.cat([m, m.new_zeros(B, pad)], dim=1),
        )


# forward(x (B, N+M, 64), emb (B, L, D), mask (B, L) | None, t (B,), img_shapes, step) -> (B, N+M, 64)
Forward = Callable[..., torch.Tensor]
# callback(step index, step count, latents (B, N, 64) after the step)
StepCallback = Callable[[int, int, torch.Tensor], None]
# blend(step index, latents (B, N, 64) after the Euler step) -> latents the next step starts from
StepBlend = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepEnd:
    """What a step-end hook sees after step i and hands back: the latents (B, N, C) the next step
    starts from, the prompt conditioning of the following steps, and `stop` to end the loop there
    (the latents as they are go to the decoder). diffusers' `callback_on_step_end` and `interrupt`
    are this seam (`pipeline/diffusers_compat.py`)."""

    latents: torch.Tensor
    cond: TextCond
    stop: bool = False


# step_end(step index, step count, timestep t (0-d fp32, sigma * 1000), state) -> state
StepEndHook = Callable[[int, int, torch.Tensor, StepEnd], StepEnd]


def rows_hook(step_end: StepEndHook, buf: torch.Tensor, cond: TextCond, i: int, j: int) -> StepEndHook:
    """The step-end hook of batch rows i..j of an OOM-split batch: the whole-batch hook sees `buf`
    (the batch's latents, these rows current) and the whole batch's prompt conditioning; what it
    returns goes back as these rows."""
    whole = {"cond": cond}

    def hook(k: int, n: int, t: torch.Tensor, state: StepEnd) -> StepEnd:
        buf[i:j] = state.latents
        out = step_end(k, n, t, StepEnd(buf, whole["cond"]))
        rows = state.cond
        if out.cond is not whole["cond"]:
            whole["cond"] = out.cond
            rows = out.cond.rows(i, j)
        return StepEnd(out.latents[i:j], rows, out.stop)

    return hook


def join_text(
    emb: torch.Tensor, mask: torch.Tensor | None, nemb: torch.Tensor, nmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack conditional and negative prompt embeddings into one batch for a single forward.

    The shorter side is right-padded with zeros and masked out as attention keys, which makes each
    sample's result equal to its own forward (padded keys get zero weight; the extra text tokens are
    dropped at the end and never reach the image). No mask at all when both sides are unpadded and
    equally long, since a mask costs ~1.6x in attention.
    """
    L = max(emb.shape[1], nemb.shape[1])

    def pad(e, m):
        n = e.shape[1]
        m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if m is None else m
        if n < L:
            e = torch.cat([e, e.new_zeros(e.shape[0], L - n, e.shape[2])], dim=1)
            m = torch.cat([m, m.new_zeros(m.shape[0], L - n)], dim=1)
        return e, m

    (e1, m1), (e2, m2) = pad(emb, mask), pad(nemb, nmask)
    m = torch.cat([m1, m2])
    return torch.cat([e1, e2]), (None if bool(m.all()) else m)


def denoise(
    forward: Forward,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    img_shapes: list[tuple[int, int, int]],
    cond: TextCond,
    uncond: TextCond | None = None,
    cfg_scale: float = 1.0,
    ref_latents: torch.Tensor | None = None,
    batched_cfg: bool | str = "auto",
    callback: StepCallback | None = None,
    progress: bool | dict = False,
    guidance: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = true_cfg,
    blend: StepBlend | None = None,
    step_end: StepEndHook | None = None,
) -> torch.Tensor:
    """Euler steps over `sigmas` (fp32 math) from the noise `x` (B, N, 64) -> the final latents (B, N, 64).

    cond / uncond: prompt conditioning (uncond None = no true CFG). ref_latents (B, M, 64): packed
    reference-image latents appended after the noise tokens (edit); the prediction is cut back to
    the first N tokens. batched_cfg: cond and uncond in one batch-2B forward; "auto" only when no
    padding mask is needed (a masked attention costs more than the second pass saves). Each forward
    gets a `StepContext` (step, count, sigma, branch) for the transformer's block runner.
    guidance(cond, uncond, scale): how CFG combines the two predictions (default Qwen-Image's
    `true_cfg`; Qwen-Image-2.1 uses `plain_cfg`). progress: a progress bar (True, or a dict of
    tqdm arguments from diffusers' `set_progress_bar_config`). blend: applied to the latents after each Euler
    step, before the callback (inpainting puts the known region back at the next noise level there);
    None leaves the loop as it is. step_end: after the blend, before the callback; it may replace the
    latents and the prompt conditioning for the following steps, or stop the loop (diffusers'
    `callback_on_step_end` and `interrupt`). Its latents must keep their shape; they are cast back
    to the loop's dtype and device.
    """
    ts = timesteps_from_sigmas(sigmas)
    levels = sigmas.tolist()  # host floats for the step contexts: one copy now, no sync per step
    B, N = x.shape[:2]
    n = len(ts)
    batched = uncond is not None and bool(batched_cfg)
    if batched:
        emb2, mask2 = join_text(cond.emb, cond.mask, uncond.emb, uncond.mask)
        if batched_cfg == "auto" and mask2 is not None:
            batched = False
    bar = {
        "desc": "denoising",
        "unit": "step",
        "leave": False,
        **(progress if isinstance(progress, dict) else {}),
    }
    for i in tqdm(range(n), disable=progress is False or progress is None, **bar):
        t = model_timestep(ts[i], B, x.dtype)
        sigma = levels[i]
        inp = x if ref_latents is None else torch.cat([x, ref_latents], dim=1)
        if batched:
            step = StepContext(i, n, sigma, "both")
            pred, neg = forward(
                torch.cat([inp, inp]), emb2, mask2, torch.cat([t, t]), img_shapes, step
            ).chunk(2)
            pred = guidance(pred[:, :N], neg[:, :N], cfg_scale)
        else:
            pred = forward(inp, cond.emb, cond.mask, t, img_shapes, StepContext(i, n, sigma, "cond"))[:, :N]
            if uncond is not None:
                step = StepContext(i, n, sigma, "uncond")
                neg = forward(inp, uncond.emb, uncond.mask, t, img_shapes, step)[:, :N]
                pred = guidance(pred, neg, cfg_scale)
        x = euler_step(x, pred, sigmas[i], sigmas[i + 1])
        if blend is not None:
            x = blend(i, x)
        stop = False
        if step_end is not None:
            state = step_end(i, n, ts[i], StepEnd(x, cond))
            if tuple(state.latents.shape) != tuple(x.shape):
                raise ValueError(
                    f"callback_on_step_end returned latents of shape {tuple(state.latents.shape)}; "
                    f"they must keep the shape {tuple(x.shape)}"
                )
            x, stop = state.latents.to(x.device, x.dtype), state.stop
            if state.cond is not cond:  # new prompt embeddings for the following steps
                cond = state.cond
                if batched:
                    emb2, mask2 = join_text(cond.emb, cond.mask, uncond.emb, uncond.mask)
        if callback is not None:
            callback(i, n, x)
        if stop:
            break
    return x
