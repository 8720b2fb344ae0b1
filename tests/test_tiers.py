"""Memory tiers on CPU: `vram_gib` -> the plan (runtime/tiers.py) -> the options a pipeline runs with.

The plan is checked on full-size sizes (no weights: the planner's arithmetic) and on the tiny model,
where the pipeline must stream exactly the blocks the plan says, give the resident image bit for bit,
and copy host -> "device" the bytes the plan predicts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qwenfast import EngineOptions, QwenImagePipeline
from qwenfast.errors import OptionsError
from qwenfast.loading.sizes import folder_sizes
from qwenfast.runtime import memory
from qwenfast.runtime.arch import ARCHS, NONE
from qwenfast.runtime.memory import GiB, MemoryPlanner, ModelSizes
from qwenfast.runtime.tiers import TooSmall, eight_bit, plan, weights_for

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"
SIZE = dict(height=64, width=48, num_inference_steps=2, output_type="np")
FULL = ModelSizes.qwen_image()


def test_weights_auto_follows_the_arch_table():
    assert weights_for(ARCHS["sm_86"], "auto") == "int8"  # Ampere: no FP8 tensor cores
    assert weights_for(ARCHS["sm_80"], "auto") == "int8"
    for name in ("sm_89", "sm_90", "sm_100", "sm_120"):
        assert weights_for(ARCHS[name], "auto") == "fp8"
    assert weights_for(NONE, "auto") == "bf16"
    assert weights_for(ARCHS["sm_86"], "bf16") == "bf16"  # what is asked is what runs
    with pytest.raises(ValueError, match="weights must be one of"):
        weights_for(NONE, "int4")


def test_full_size_plans_fit_their_budget_and_degrade_in_order():
    order = {"none": 0, "model": 1, "blocks": 2}
    last = None
    for gib in (80, 48, 32, 24, 16, 12, 8, 6):
        p = plan(FULL, gib)
        assert p.peak_gib <= 0.9 * gib, (gib, p.peak_gib)
        if last is not None:  # less memory: never a lighter mode, never more resident blocks
            assert order[p.offload] >= order[last.offload]
            assert p.resident_blocks <= last.resident_blocks
            assert p.step_bytes >= last.step_bytes
        last = p
    assert plan(FULL, 80).offload == "none" and plan(FULL, 80).image_bytes(50) == 0
    assert plan(FULL, 48).offload == "model"
    p12 = plan(FULL, 12)
    assert p12.offload == "blocks" and 0 < p12.resident_blocks < 60
    # what streams each step is exactly the non-resident blocks without their (host-held) modulation
    assert p12.step_bytes == (60 - p12.resident_blocks) * (FULL.transformer_block - FULL.block_modulation)
    assert p12.once_bytes == 0  # 44 streamed blocks share the ring's 2 slots: each reloads every step
    with pytest.raises(TooSmall, match="needs about"):
        plan(FULL, 3)


def test_eight_bit_weights_keep_more_blocks_resident():
    s8 = eight_bit(FULL)
    # the 8-bit Linears are half; the modulation Linears stay 16-bit
    assert (
        s8.transformer_block == FULL.block_modulation + (FULL.transformer_block - FULL.block_modulation) // 2
    )
    for gib in (24, 16, 12, 8):
        b, f = plan(FULL, gib), plan(FULL, gib, weights="fp8")
        assert f.weights == "fp8" and f.resident_blocks > b.resident_blocks
        assert f.step_bytes < b.step_bytes
    p = plan(FULL, 12, weights="auto", card=ARCHS["sm_86"])
    assert p.weights == "int8" and p.options()["int8"] and not p.options()["fp8"]
    # sizes measured on a loaded 8-bit model are not halved again
    assert plan(s8, 12, weights="fp8", eight_bit_sizes=True) == plan(FULL, 12, weights="fp8")


def test_vae_tiles_when_the_decode_does_not_fit():
    big = plan(FULL, 24, height=2048, width=2048)
    small = plan(FULL, 8, height=3072, width=3072)
    assert not big.vae_tiled
    assert small.vae_tiled and "tiles" in " ".join(small.notes)
    untiled = MemoryPlanner(FULL).predict(3072, 3072, 1, offload="blocks", modulation_on_host=True)
    assert untiled.phases["decode"] > 0.9 * 8 * GiB  # the reason it tiles


def test_options_validate_weights_and_vram():
    assert EngineOptions(weights="fp8").fp8 and EngineOptions(weights="int8").int8
    for bad in (
        dict(weights="int4"),
        dict(vram_gib=0),
        dict(vram_gib=-2),
        dict(vram_gib=True),
        dict(vram_gib="12"),
    ):
        with pytest.raises(OptionsError):
            EngineOptions(**bad)
    with pytest.raises(OptionsError, match="choose one"):
        EngineOptions(weights="bf16", fp8=True)
    with pytest.raises(OptionsError, match="choose one"):
        EngineOptions(weights="int8", fp8=True)


def test_folder_sizes_match_the_loaded_model():
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    got, want = folder_sizes(TINY, torch.float32), ModelSizes.from_pipeline(p)
    for name in ("transformer", "transformer_block", "num_blocks", "block_modulation", "te_block", "te_blocks",
                 "te_embed", "dim", "te_hidden"):  # fmt: skip
        assert getattr(got, name) == getattr(want, name), name
    assert got.text_encoder == pytest.approx(want.text_encoder, rel=0.01)  # + the rotary buffers
    assert got.vae >= want.vae  # the folder's VAE holds the encoder a text-to-image pipeline drops


@pytest.fixture
def no_overhead(monkeypatch):
    """The planner without its 512 MiB of CUDA slack, so the tiny model's budgets are KBs."""
    monkeypatch.setattr(memory.Calibration, "load", classmethod(lambda cls, path=None: cls(overhead=0)))


def _image(p, prompt="a red square"):
    p.progress_bar = False
    return p(prompt, generator=torch.Generator().manual_seed(3), **SIZE).images


def test_vram_plan_streams_what_it_says_and_changes_no_pixel(no_overhead):
    ref = QwenImagePipeline.from_pretrained(None, device="cpu", dtype=torch.float32)  # the demo: 5 blocks
    want = _image(ref)
    seen = set()
    for gib in np.linspace(0.02, 0.06, 17):
        try:
            p = QwenImagePipeline.from_pretrained(
                None, device="cpu", dtype=torch.float32, options=EngineOptions(vram_gib=float(gib))
            )
        except OptionsError as e:
            assert "too little" in str(e) and "needs about" in str(e)
            continue
        plan_ = p.memory_plan
        assert (
            plan_ is not None
            and p.options.offload == plan_.offload
            and p.options.vram_gib == pytest.approx(gib)
        )
        seen.add((plan_.offload, plan_.resident_blocks))
        if plan_.offload == "blocks":
            st = p._block_streamer
            assert len(st.resident) == plan_.resident_blocks
            assert len(p.text_encoder.layer_streamer.resident) == plan_.te_resident_layers
        before = p.streamed_bytes()
        got = _image(p)
        np.testing.assert_array_equal(got, want)  # offload moves weights, never changes them
        moved = p.streamed_bytes() - before
        # the plan's bytes: the streamed blocks every step + the text encoder once per new prompt
        # (+ the modulation Linears brought in once for the new schedule when they live on the host)
        # (+ on this first image, the ring's first fill and the modulation Linears of the new schedule:
        # the table brings each block's in once, for the whole schedule)
        steps = SIZE["num_inference_steps"]
        low = plan_.image_bytes(steps) + plan_.once_bytes
        assert low - 1024 <= moved <= plan_.image_bytes(steps, first=True) + 1024, (
            gib,
            moved,
            low,
        )  # norms: bytes
        again = p.streamed_bytes()
        _image(p)  # the same prompt and schedule: the blocks' bytes alone
        # (to a few hundred bytes: small host-held tensors a table entry may still bring)
        assert p.streamed_bytes() - again == pytest.approx(
            plan_.image_bytes(steps, new_prompt=False), abs=1024
        )
    assert {m for m, _ in seen} >= {"none", "blocks"} and len(seen) >= 3, seen


def test_vram_with_the_step_cache_says_what_to_do(no_overhead):
    with pytest.raises(OptionsError, match="step cache does not run with streamed blocks"):
        QwenImagePipeline.from_pretrained(
            None, device="cpu", dtype=torch.float32, options=EngineOptions(vram_gib=0.03, cache="fast")
        )


@pytest.mark.parametrize("arch,fmt", [("sm_86", "int8"), ("sm_89", "fp8"), (None, "bf16")])
def test_weights_auto_on_a_pipeline(monkeypatch, arch, fmt):
    if arch:
        monkeypatch.setenv("QWENFAST_ARCH", arch)
    else:
        monkeypatch.delenv("QWENFAST_ARCH", raising=False)
    p = QwenImagePipeline.from_pretrained(
        TINY, device="cpu", dtype=torch.float32, options=EngineOptions(weights="auto")
    )
    assert p.options.weights == fmt
    assert (p.options.fp8, p.options.int8) == (fmt == "fp8", fmt == "int8")


def test_doctor_prints_the_plan_and_generate_says_vram_does_nothing_on_cpu(capsys, tmp_path):
    from qwenfast.cli import main

    assert main(["doctor", "--vram", "12", "--weights", "fp8"]) == 0
    out = capsys.readouterr().out
    want = plan(FULL, 12, weights="fp8")
    assert "memory plan  full-size Qwen-Image, budget 12 GiB" in out and "weights fp8, offload blocks" in out
    assert f"{want.resident_blocks} of 60 transformer blocks resident" in out
    assert main(["doctor", "--vram", "2"]) == 0
    assert "too little" in capsys.readouterr().out
    out_png = tmp_path / "x.png"
    assert (
        main(
            [
                "generate",
                "a red square",
                "--device",
                "cpu",
                "--vram",
                "8",
                "--steps",
                "2",
                "-o",
                str(out_png),
                "--quiet",
            ]
        )
        == 0
    )
    assert out_png.is_file() and "--vram 8 does nothing on the CPU" in capsys.readouterr().err


def test_cfg_is_batched_while_blocks_stream(no_overhead):
    """Prompts of unequal length need a padding mask, so "auto" CFG runs two forwards a step; while blocks
    stream it batches them instead (each streamed block crosses once a step, not twice): the same image up
    to fp32 rounding, half the forwards."""
    ref = QwenImagePipeline.from_pretrained(None, device="cpu", dtype=torch.float32)
    p = QwenImagePipeline.from_pretrained(
        None, device="cpu", dtype=torch.float32, options=EngineOptions(vram_gib=0.03)
    )
    assert p._block_streamer is not None and p._block_streamer.order  # blocks stream at this budget
    kw = dict(prompt="a small red star at the top left, white background", negative_prompt=" ", true_cfg_scale=4.0,
              height=64, width=64, num_inference_steps=3, output_type="np")  # fmt: skip
    images, forwards = [], []
    for pipe in (ref, p):
        pipe.progress_bar = False
        n = [0]
        hook = pipe.transformer.register_forward_pre_hook(lambda m, a, n=n: n.__setitem__(0, n[0] + 1))
        images.append(pipe(**kw, generator=torch.Generator().manual_seed(1)).images)
        hook.remove()
        forwards.append(n[0])
    assert forwards == [6, 3]  # resident: cond and uncond apart (the option's "auto"); streaming: batched
    np.testing.assert_allclose(images[1], images[0], rtol=0, atol=5e-5)
    assert np.isfinite(images[1]).all()


def test_weights_flag_gets_the_notes_of_the_format_it_names(capsys):
    import argparse

    from qwenfast.engine_args import engine_notes

    def notes(**kw):
        a = argparse.Namespace(preset=None, lora=None, device="cpu", offload=None, offload_budget=None, fp8=False,
                               int8=False, vram=None, weights=None)  # fmt: skip
        vars(a).update(kw)
        engine_notes(a)
        return capsys.readouterr().err

    assert "--fp8 on the CPU is emulated" in notes(weights="fp8")
    assert "--int8 on the CPU is emulated" in notes(weights="int8")
    assert "keeps bf16" in notes(weights="auto")
    assert notes(weights="bf16") == ""
