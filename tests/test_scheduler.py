"""Sigmas/timesteps equal diffusers' FlowMatchEulerDiscreteScheduler + QwenImagePipeline, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qwenfast.config import PRESETS, QWEN_IMAGE_SCHEDULER, SchedulerConfig
from qwenfast.pipeline import sampling as S

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline, calculate_shift  # noqa: E402


def _diffusers_sigmas(config: dict, steps: int, seq_len: int):
    sch = FlowMatchEulerDiscreteScheduler(**config)
    c = sch.config
    mu = calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))  # fmt: skip
    sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return sch.sigmas, sch.timesteps


QWEN = dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")  # fmt: skip
LIGHTNING = dict(QWEN, base_shift=math.log(3), max_shift=math.log(3), shift_terminal=None)


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 50])
@pytest.mark.parametrize("size", [(512, 512), (1024, 1024), (1328, 1328), (928, 1664), (64, 48)])
@pytest.mark.parametrize("config", [QWEN, LIGHTNING, {}], ids=["qwen", "lightning", "class-defaults"])
def test_sigmas_bitwise_equal(steps, size, config):
    seq_len = (size[0] // 16) * (size[1] // 16)
    ref_sigmas, ref_t = _diffusers_sigmas(config, steps, seq_len)
    ours = S.get_sigmas(SchedulerConfig.from_dict(config), steps, seq_len)
    if steps == 1 and config.get("shift_terminal"):
        # diffusers stretches 1 - sigma by 0/0 here and returns NaN; we keep the unstretched [1, 0]
        assert torch.isnan(ref_sigmas[0]) and torch.equal(ours, torch.tensor([1.0, 0.0]))
        return
    assert torch.equal(ours, ref_sigmas)
    assert torch.equal(S.timesteps_from_sigmas(ours), ref_t)


def test_lightning_preset_gives_documented_4_step_sigmas():
    cfg = QWEN_IMAGE_SCHEDULER.replace(**PRESETS["lightning-4"].scheduler_overrides)
    s = S.get_sigmas(cfg, 4, 4096)
    assert np.allclose(s.numpy(), [1.0, 0.9, 0.75, 0.5, 0.0], atol=1e-6)


def test_euler_step_and_cfg_follow_diffusers_dtype_rules():
    sch = FlowMatchEulerDiscreteScheduler(**QWEN)
    sch.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=0.7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 64, generator=g).bfloat16()
    v = torch.randn(2, 12, 64, generator=g).bfloat16()
    ref = sch.step(v, sch.timesteps[0], x, return_dict=False)[0]
    ours = S.euler_step(x, v, sch.sigmas[0], sch.sigmas[1])
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)
    u = torch.randn(2, 12, 64, generator=g).bfloat16()
    comb = u + 4.0 * (v - u)
    expect = comb * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert torch.equal(S.true_cfg(v, u, 4.0), expect)


def test_pack_unpack_match_diffusers():
    z = torch.randn(2, 16, 6, 10)
    packed = QwenImagePipeline._pack_latents(z[:, None], 2, 16, 6, 10)
    assert torch.equal(S.pack_latents(z), packed)
    assert torch.equal(S.unpack_latents(packed, 6, 10), z)
    unpacked = QwenImagePipeline._unpack_latents(packed, 48, 80, 8)
    assert torch.equal(unpacked[:, :, 0], z)


def test_bad_steps():
    with pytest.raises(ValueError, match="num_inference_steps"):
        S.get_sigmas(QWEN_IMAGE_SCHEDULER, 0, 256)
