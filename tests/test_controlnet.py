"""ControlNet pipelines (one net, a multi-condition Union net, two nets, inpainting) against diffusers.

Tiny random models are built with diffusers (a 3-block transformer and 2-block ControlNets, so the
residual interval ceil(3 / 2) = 2 is exercised), saved in the real layouts (diffusers folders, and
the InstantX single-file form), loaded by qwenfast; the same seed must give the same pixels (fp32,
CPU). The ControlNets are made sensitive (`qwenfast.testing.tiny_control`): each test checks that its
control input moves diffusers' own pixels by >= 10x the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3


def _image(w: int, h: int, seed: int, channels: int = 3):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8).squeeze())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import diffusers

    from qwenfast.pipeline.controlnet import QwenImageControlNetPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline
    from qwenfast.testing.tiny_control import build_controlnet, save_controlnet_file

    root = tmp_path_factory.mktemp("cn")
    ref = build_tiny_pipeline(root / "t2i", seed=0, transformer_layers=3)
    nets = {
        "a": build_controlnet(64, seed=1),
        "b": build_controlnet(64, seed=2),
        "inpaint": build_controlnet(64, seed=3, extra_condition_channels=4),
    }
    nets["a"].save_pretrained(root / "cn-a")  # diffusers folder
    save_controlnet_file(nets["b"], root / "cn-b.safetensors", prefix="controlnet.")  # single file, prefixed
    nets["inpaint"].save_pretrained(root / "cn-inpaint")
    comps = {k: getattr(ref, k) for k in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}

    def qf(controlnet, cls=QwenImageControlNetPipeline):
        p = cls.from_pretrained(root / "t2i", controlnet=controlnet, device="cpu", dtype=torch.float32)
        p.progress_bar = False
        return p

    def dp(controlnet, cls=diffusers.QwenImageControlNetPipeline):
        p = cls(**comps, controlnet=controlnet)
        p.set_progress_bar_config(disable=True)
        return p

    return {"root": root, "nets": nets, "qf": qf, "dp": dp}


KW = dict(prompt="a red circle on the left", negative_prompt=" ", true_cfg_scale=4.0, height=48, width=80,
          num_inference_steps=3, output_type="np")  # fmt: skip


def _run(pipe, seed=5, **kw):
    return pipe(generator=torch.Generator().manual_seed(seed), **{**KW, **kw}).images


@pytest.fixture(scope="module")
def single(models):
    return models["dp"](models["nets"]["a"]), models["qf"](models["root"] / "cn-a")


@pytest.mark.parametrize("cfg", [True, False])
def test_one_controlnet_matches_diffusers_batch2_nonsquare(single, cfg):
    dp, qf = single
    kw = dict(control_image=_image(80, 48, 1), prompt=["a red circle on the left", "a blue square"])
    if not cfg:
        kw.update(negative_prompt=None, true_cfg_scale=1.0)
    a, b = _run(dp, **kw), _run(qf, **kw)
    assert a.shape == b.shape == (2, 48, 80, 3)
    assert np.isfinite(b).all() and np.abs(a - b).max() < TOL
    moved = _run(dp, **{**kw, "control_image": _image(80, 48, 2)})
    assert np.abs(moved - a).max() >= 10 * TOL  # the control image matters


def test_guidance_window_and_scale(single):
    dp, qf = single
    kw = dict(control_image=_image(80, 48, 1), num_inference_steps=4, control_guidance_start=0.25,
              control_guidance_end=0.75, controlnet_conditioning_scale=0.6, num_images_per_prompt=2)  # fmt: skip
    a, b = _run(dp, **kw), _run(qf, **kw)
    assert a.shape == (2, 48, 80, 3) and np.abs(a - b).max() < TOL
    full = _run(dp, **{**kw, "control_guidance_start": 0.0, "control_guidance_end": 1.0})
    assert np.abs(full - a).max() >= 10 * TOL  # the window matters


def test_batched_cfg_gives_the_controlnet_the_cond_prompt_only(single, models):
    """One batched [cond; uncond] forward: the ControlNet runs on the cond rows, both halves get its
    residuals: the same images as separate passes. FP8 also quantises the ControlNet's blocks."""
    _, qf = single
    kw = dict(control_image=_image(80, 48, 1), negative_prompt="a red circle on the right")  # equal lengths
    outs = []
    for batched in (True, False):
        qf.configure(batched_cfg=batched)
        outs.append(_run(qf, **kw))
    qf.configure(batched_cfg="auto")
    assert np.abs(outs[0] - outs[1]).max() < 1e-5
    from qwenfast.kernels.fp8_linear import FP8Linear

    p = models["qf"](models["root"] / "cn-a")
    p.configure(fp8=True)
    assert isinstance(p.controlnet.transformer_blocks[0].attn.to_qkv, FP8Linear)
    fp8 = _run(p, **kw)
    # FP8 rounding, not another picture: measured max 0.011, mean 1.2e-3 (another control image moves the
    # mean by 8.8e-3); bounds at ~4x. And more than 0: the blocks were really quantised.
    d = np.abs(fp8 - outs[1])
    assert np.isfinite(fp8).all() and d.max() < 0.05 and 1e-4 < d.mean() < 5e-3, (d.max(), d.mean())


def test_union_net_two_conditions_matches_diffusers(models):
    import diffusers

    from qwenfast.models.controlnet import QwenImageMultiControlNetModel

    dp = models["dp"](diffusers.QwenImageMultiControlNetModel([models["nets"]["a"]]))
    qf = models["qf"]([models["root"] / "cn-a"])  # a list: one Union net, several conditions
    assert isinstance(qf.controlnet, QwenImageMultiControlNetModel)
    imgs = [_image(80, 48, 1), _image(80, 48, 3)]
    kw = dict(control_image=imgs, controlnet_conditioning_scale=[0.7, 1.2], control_guidance_start=[0.0, 0.3],
              control_guidance_end=[0.67, 1.0])  # fmt: skip
    a, b = _run(dp, **kw), _run(qf, **kw)
    assert np.abs(a - b).max() < TOL
    moved = _run(dp, **{**kw, "control_image": [imgs[0], _image(80, 48, 4)]})
    assert np.abs(moved - a).max() >= 10 * TOL  # the second condition matters


def test_two_nets_sum_their_residuals(models):
    """Two different nets (diffusers' Multi model refuses them): the residuals are net a on image a plus
    net b on image b, each scaled, as diffusers' single-net forwards give them."""
    from qwenfast.loading.controlnet import load_controlnet
    from qwenfast.models.controlnet import QwenImageMultiControlNetModel

    root, nets = models["root"], models["nets"]
    b = load_controlnet(root / "cn-b.safetensors", axes_dims_rope=(8, 12, 12))  # a single file, prefixed
    ours = QwenImageMultiControlNetModel([load_controlnet(root / "cn-a"), b])
    g = torch.Generator().manual_seed(0)
    x, txt = torch.randn(2, 15, 64, generator=g), torch.randn(2, 7, 64, generator=g)
    conds = [torch.randn(2, 15, 64, generator=g) for _ in range(2)]
    t, shapes = torch.tensor([0.7, 0.7]), [(1, 3, 5)]
    mine = ours(x, conds, [0.5, 1.5], txt, None, t, shapes)
    with torch.no_grad():
        ra = nets["a"](x, conds[0], 0.5, txt, None, t, shapes, return_dict=False)
        rb = nets["b"](x, conds[1], 1.5, txt, None, t, shapes, return_dict=False)
    assert len(mine) == 2
    for m, p, q in zip(mine, ra, rb):
        assert (m - (p + q)).abs().max() < 1e-5 and (p + q).abs().max() > 0.1


def test_single_file_controlnet_equals_the_folder(models, tmp_path):
    """InstantX / ComfyUI single files (bare keys) load to the same model as the diffusers folder."""
    from qwenfast.loading.controlnet import inspect_controlnet, load_controlnet
    from qwenfast.testing.tiny_control import save_controlnet_file

    save_controlnet_file(models["nets"]["a"], tmp_path / "a.safetensors")
    _, cfg = inspect_controlnet(tmp_path / "a.safetensors", {"axes_dims_rope": (8, 12, 12)})
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.extra_condition_channels) == (2, 2, 0)
    f = load_controlnet(tmp_path / "a.safetensors", config={"axes_dims_rope": (8, 12, 12)})
    d = load_controlnet(models["root"] / "cn-a")
    sf, sd = f.state_dict(), d.state_dict()
    assert sf.keys() == sd.keys() and all(torch.equal(sf[k], sd[k]) for k in sf)
    with pytest.raises(Exception, match="axes_dims_rope"):  # not in the weights for a non-standard head dim
        load_controlnet(tmp_path / "a.safetensors")


def test_transformer_block_residuals_match_diffusers(models):
    """The injection itself: residual k after blocks i // ceil(3 / 2) == k, as diffusers."""
    from qwenfast.loading.diffusers_folder import load_transformer

    root = models["root"]
    ref = models["dp"](models["nets"]["a"]).transformer
    ours = load_transformer(root / "t2i" / "transformer", "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    x, txt = torch.randn(1, 15, 64, generator=g), torch.randn(1, 6, 64, generator=g)
    res = [torch.randn(1, 15, 64, generator=g) for _ in range(2)]
    t, shapes = torch.tensor([0.4]), [(1, 3, 5)]
    with torch.no_grad():
        a = ref(x, txt, None, t, [shapes], controlnet_block_samples=res, return_dict=False)[0]
        plain = ref(x, txt, None, t, [shapes], return_dict=False)[0]
    b = ours(x, txt, None, t, shapes, block_residuals=res)
    assert (a - b).abs().max() < 1e-4 and (a - plain).abs().max() > 0.1
    with pytest.raises(ValueError, match="block_residuals"):
        ours(x, txt, None, t, shapes, block_residuals=[torch.zeros(1, 14, 64)])


def test_cuda_graph_key_and_inputs_carry_the_residuals(monkeypatch):
    """Residuals are graph inputs (copied into static buffers on replay) and their count and shapes are
    in the key, so a graph captured without them (or with other ones) is never replayed for them."""
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner(torch.nn.Identity())
    calls = []
    monkeypatch.setattr(runner, "_run", lambda key, fn, inputs: calls.append((key, inputs)) or inputs[0])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.zeros(1, 4, 64)
    r2, r3 = [torch.ones(1, 4, 64)] * 2, [torch.ones(1, 4, 64)] * 3
    for res in (None, r2, r2, r3):
        runner(x, x, None, x, [(1, 2, 2)], block_residuals=res)
    keys = [k for k, _ in calls]
    assert len(set(keys)) == 3 and keys[1] == keys[2]
    # inputs: x, txt, mask, t, additional_t_cond, modulations, *residuals
    assert [len(i) for _, i in calls] == [6, 8, 8, 9] and calls[1][1][6] is r2[0]


@pytest.mark.parametrize("soft", [True, False])
def test_controlnet_inpaint_matches_diffusers(models, soft):
    import diffusers

    from qwenfast.pipeline.controlnet import QwenImageControlNetInpaintPipeline

    dp = models["dp"](models["nets"]["inpaint"], diffusers.QwenImageControlNetInpaintPipeline)
    qf = models["qf"](models["root"] / "cn-inpaint", QwenImageControlNetInpaintPipeline)
    image = _image(80, 48, 5)
    yy, xx = np.mgrid[0:48, 0:80]
    ramp = np.clip((xx - 20) / 40.0, 0, 1) * (yy > 8)  # soft left-right edge
    if soft:  # a tensor mask is used as given (no binarisation), as in diffusers
        mask = torch.from_numpy(ramp).float()[None, None]
    else:  # a PIL mask is resized, made grayscale and binarised at 0.5
        from PIL import Image

        mask = Image.fromarray((ramp * 255).astype(np.uint8)).convert("RGB")
    kw = dict(control_image=image, control_mask=mask, guidance_scale=1.0)

    def run(p, **extra):
        torch.manual_seed(11)  # the masked image's latents are sampled from the global RNG (diffusers)
        return _run(p, **{**kw, **extra})

    a, b = run(dp), run(qf)
    assert np.isfinite(b).all() and np.abs(a - b).max() < TOL
    other = torch.zeros_like(mask) if soft else mask.transpose(0)  # FLIP_LEFT_RIGHT
    assert np.abs(run(dp, control_mask=other) - a).max() >= 10 * TOL  # the mask matters


def test_control_image_of_another_size_is_resized_like_diffusers(single):
    dp, qf = single
    kw = dict(control_image=_image(50, 70, 6), true_cfg_scale=1.0, negative_prompt=None)  # other size and aspect
    a, b = _run(dp, **kw), _run(qf, **kw)
    assert a.shape == b.shape == (1, 48, 80, 3) and np.abs(a - b).max() < TOL


def test_bad_control_inputs_are_clear_errors(models, single):
    _, qf = single
    with pytest.raises(ValueError, match="control_image is required"):
        _run(qf)
    with pytest.raises(ValueError, match="multiples of 16"):
        _run(qf, control_image=torch.zeros(1, 3, 40, 70))
    with pytest.raises(ValueError, match="start < end"):
        _run(qf, control_image=_image(80, 48, 1), control_guidance_start=0.8, control_guidance_end=0.2)
    multi = models["qf"]([models["root"] / "cn-a"])
    with pytest.raises(ValueError, match="different sizes"):
        _run(multi, control_image=[torch.zeros(1, 3, 48, 80), torch.zeros(1, 3, 32, 32)])
    with pytest.raises(ValueError, match="2 entries for 1"):
        _run(multi, control_image=[_image(80, 48, 1)], controlnet_conditioning_scale=[1.0, 0.5])


def test_from_pretrained_picks_the_controlnet_pipelines(models):
    import qwenfast
    from qwenfast.pipeline.controlnet import QwenImageControlNetInpaintPipeline, QwenImageControlNetPipeline
    from qwenfast.pipeline.text_to_image import QwenImagePipeline

    root = models["root"]
    kw = dict(device="cpu", dtype=torch.float32)
    assert type(qwenfast.from_pretrained(root / "t2i", **kw)) is QwenImagePipeline
    assert type(qwenfast.from_pretrained(root / "t2i", controlnet=root / "cn-a", **kw)) is QwenImageControlNetPipeline
    p = qwenfast.from_pretrained(root / "t2i", task="controlnet-inpaint", controlnet=root / "cn-inpaint", **kw)
    assert type(p) is QwenImageControlNetInpaintPipeline
    with pytest.raises(ValueError, match="not an inpainting ControlNet"):
        QwenImageControlNetInpaintPipeline.from_pretrained(root / "t2i", controlnet=root / "cn-a", **kw)(
            "x", control_image=_image(32, 32, 0), control_mask=_image(32, 32, 0))
    saved = models["dp"](models["nets"]["a"])
    saved.save_pretrained(root / "cn-pipeline")  # a saved diffusers ControlNet pipeline: its controlnet/ is used
    p = qwenfast.from_pretrained(root / "cn-pipeline", **kw)
    assert type(p) is QwenImageControlNetPipeline and p.controlnet.cfg.num_layers == 2
    with pytest.raises(ValueError, match="needs controlnet="):
        QwenImageControlNetPipeline.from_pretrained(root / "t2i", **kw)
    with pytest.raises(ValueError, match="unknown task"):
        qwenfast.from_pretrained(root / "t2i", task="nope", **kw)


def test_cli_generate_with_controlnets(models, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    root = models["root"]
    _image(80, 48, 1).save(tmp_path / "canny.png")
    _image(80, 48, 3).convert("L").save(tmp_path / "depth.png")  # grayscale control pictures are made RGB
    base = ["generate", "a red circle", "--model", str(root / "t2i"), "--steps", "2", "--size", "80x48",
            "--device", "cpu", "--dtype", "fp32", "--seed", "3", "--quiet"]  # fmt: skip
    out = tmp_path / "one.png"
    assert main([*base, "--control", str(tmp_path / "canny.png"), "--controlnet", f"{root / 'cn-a'}:0.8",
                 "-o", str(out)]) == 0  # fmt: skip
    assert Image.open(out).size == (80, 48) and "controlnet" in Image.open(out).text
    two = tmp_path / "two.png"
    assert main([*base, "--control", str(tmp_path / "canny.png"), "--control", str(tmp_path / "depth.png"),
                 "--controlnet", str(root / "cn-a"), "--control-end", "0.5", "-o", str(two)]) == 0  # fmt: skip
    assert np.abs(np.asarray(Image.open(two), np.float32) - np.asarray(Image.open(out), np.float32)).max() > 0
    assert main([*base, "--control", str(tmp_path / "canny.png"), "-o", str(out)]) == 2  # no --controlnet
    assert main([*base, "--control", str(tmp_path / "nope.png"), "--controlnet", str(root / "cn-a")]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_with_new_residuals(models):
    """On the GPU (fp32, fused kernels): graphs on == eager, also when a second call replays the
    captured graphs with another control image (new residuals in the static buffers)."""
    from qwenfast.pipeline.controlnet import QwenImageControlNetPipeline

    root = models["root"]
    p = QwenImageControlNetPipeline.from_pretrained(root / "t2i", controlnet=root / "cn-a", device="cuda",
                                                    dtype=torch.float32, cuda_graphs=True)  # fmt: skip
    p.progress_bar = False
    kw = dict(negative_prompt="a red circle on the right")  # equal lengths: one batched CFG graph
    outs = {}
    for graphs in (True, False):
        p.configure(cuda_graphs=graphs)
        outs[graphs] = [_run(p, control_image=_image(80, 48, s), **kw) for s in (1, 2)]
    for g, e in zip(outs[True], outs[False]):
        assert np.abs(g - e).max() < 1e-4
    assert np.abs(outs[True][0] - outs[True][1]).max() > 10 * TOL
    ref = _run(models["dp"](models["nets"]["a"]), control_image=_image(80, 48, 2), **kw)
    assert np.abs(outs[True][1] - ref).max() < 5e-3  # fused GPU kernels (TF32 off: fp32) vs diffusers on the CPU
