"""diffusers' call and loading arguments on qwenfast's pipelines, each against diffusers 0.42.1 on tiny
random models (fp32, CPU): `guidance_scale`, `return_dict`, `attention_kwargs` (the LoRA scale),
`callback_on_step_end` (changing the latents or the prompt embeddings, interrupting), `prompt_embeds`
in the task pipelines, `from_pretrained(torch_dtype=...)`, `.to()`, and the clear refusals.

Every equality with diffusers comes with a check that the argument does something on this tiny
model (its effect on diffusers' own pixels is >= 10x the tolerance), so a test cannot pass by
comparing two outputs that ignore it.
"""

from __future__ import annotations

import logging
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

TOL = 1e-3
KW = dict(prompt="a red circle on the left", negative_prompt="blurry", true_cfg_scale=4.0, height=32, width=48,
          num_inference_steps=3, output_type="np")  # fmt: skip


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _image(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _mask(w: int, h: int, box: tuple):
    from PIL import Image, ImageDraw

    m = Image.new("L", (w, h), 0)
    ImageDraw.Draw(m).ellipse(box, fill=255)
    return m


def _close(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max())


def _mix(emb: torch.Tensor) -> torch.Tensor:
    """A change of prompt embeddings the model sees (a plain scale would not count: the transformer
    RMS-normalises its text input), token by token (padding stays zero)."""
    return emb + torch.roll(emb, 1, dims=-1)


def _moved(a, b) -> bool:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) >= 10 * TOL


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def t2i(tiny_t2i):
    """{task: (diffusers pipeline, qwenfast pipeline)} for text-to-image, img2img and inpaint on the same
    weights. The qwenfast pipelines are this module's own (LoRAs are loaded here)."""
    import diffusers

    from qwenfast import QwenImagePipeline

    ref, path = tiny_t2i
    q = QwenImagePipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    out = {"t2i": (ref, q)}
    for task, cls in (("img2img", diffusers.QwenImageImg2ImgPipeline), ("inpaint", diffusers.QwenImageInpaintPipeline)):
        d = cls(**ref.components)
        d.set_progress_bar_config(disable=True)
        out[task] = (d, q.for_task(task))
    return out


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    """(diffusers Edit v1, qwenfast) at a small image area (`edit_area` patches diffusers' constant)."""
    import json

    from qwenfast import QwenImageEditPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny-edit"
    ref = build_tiny_pipeline(path, seed=0, edit="edit")
    (path / "qwenfast.json").write_text(json.dumps({"image_areas": {"vl_area": 96 * 64, "vae_area": 96 * 64}}))
    q = QwenImageEditPipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    return ref, q


@pytest.fixture
def edit_area():
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as mod

    real = mod.calculate_dimensions
    with mock.patch.object(mod, "calculate_dimensions", lambda area, ratio: real(96 * 64, ratio)):
        yield


@pytest.fixture(scope="module")
def controlnet(tiny_t2i, tmp_path_factory):
    import diffusers

    from qwenfast import QwenImageControlNetPipeline
    from qwenfast.testing.tiny_control import build_controlnet

    ref, path = tiny_t2i
    net = build_controlnet(ref.text_encoder.config.text_config.hidden_size, seed=1)
    folder = tmp_path_factory.mktemp("cn") / "union"
    net.save_pretrained(folder)
    d = diffusers.QwenImageControlNetPipeline(**ref.components, controlnet=net)
    d.set_progress_bar_config(disable=True)
    q = QwenImageControlNetPipeline.from_pretrained(path, controlnet=folder, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    return d, q


@pytest.fixture(scope="module")
def q21(tmp_path_factory):
    import qwenfast
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny21"
    ref = build_tiny21_pipeline(path, seed=0)
    q = qwenfast.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    return ref, q


# ------------------------------------------------------------------------------ guidance_scale, return_dict
def test_guidance_scale_is_ignored_with_diffusers_warning(t2i, caplog):
    d, q = t2i["t2i"]
    base = q(**KW, generator=_gen()).images
    with caplog.at_level(logging.WARNING, logger="qwenfast"):
        got = q(**KW, guidance_scale=3.5, generator=_gen()).images
    assert "guidance_scale is passed as 3.5, but ignored since the model is not guidance-distilled" in caplog.text
    theirs = d(**KW, guidance_scale=3.5, generator=_gen()).images
    assert np.array_equal(got, base) and _close(got, theirs) <= TOL


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_guidance_scale_and_return_dict_in_the_image_pipelines(t2i, task):
    d, q = t2i[task]
    kw = {**KW, "image": _image(48, 32, 1), "strength": 0.7}
    if task == "inpaint":
        kw["mask_image"] = _mask(48, 32, (4, 4, 30, 28))
    (theirs,) = d(**kw, guidance_scale=2.0, return_dict=False, generator=_gen())
    out = q(**kw, guidance_scale=2.0, return_dict=False, generator=_gen())
    assert isinstance(out, tuple) and len(out) == 1
    assert _close(out[0], theirs) <= TOL


def test_return_dict_false_is_a_one_tuple_of_the_images(t2i):
    d, q = t2i["t2i"]
    kw = {**KW, "output_type": "pil"}
    mine, theirs = q(**kw, return_dict=False, generator=_gen()), d(**kw, return_dict=False, generator=_gen())
    assert type(mine) is type(theirs) is tuple and len(mine) == len(theirs) == 1
    assert len(mine[0]) == 1 and mine[0][0].size == theirs[0][0].size == (48, 32)


def test_controlnet_inpaint_ignores_guidance_scale_silently(caplog):
    """diffusers' ControlNet inpainting pipeline has guidance_scale=1.0 by default and never warns."""
    from qwenfast.pipeline.diffusers_compat import DiffusersCall

    with caplog.at_level(logging.WARNING, logger="qwenfast"):
        DiffusersCall(mock.Mock(), 1.0, warn_guidance=False)
    assert "guidance_scale" not in caplog.text


# ------------------------------------------------------------------------------ attention_kwargs
def _lora(model, seed: int = 5) -> dict[str, torch.Tensor]:
    """A random LoRA on the attention projections and MLPs, in diffusers' key naming."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks") and ("attn" in n or "mlp" in n):
            sd[f"transformer.{n}.lora_A.weight"] = torch.randn(4, m.in_features, generator=g) / m.in_features**0.5
            sd[f"transformer.{n}.lora_B.weight"] = torch.randn(m.out_features, 4, generator=g) * 0.3
    return sd


def test_attention_kwargs_scale_scales_the_loras_like_diffusers(t2i):
    pytest.importorskip("peft")
    d, q = t2i["t2i"]
    sd = _lora(d.transformer)
    kw = {**KW, "true_cfg_scale": 1.0, "negative_prompt": None}
    plain = q(**kw, generator=_gen()).images
    assert _close(q(**kw, attention_kwargs={"scale": 0.5}, generator=_gen()).images, plain) == 0  # no LoRA: nothing
    d.load_lora_weights(dict(sd), adapter_name="a")
    try:
        theirs = d(**kw, attention_kwargs={"scale": 0.5}, generator=_gen()).images
        full = d(**kw, generator=_gen()).images
    finally:
        d.unload_lora_weights()
    name = q.load_lora(dict(sd), 1.0)
    try:
        mine = q(**kw, attention_kwargs={"scale": 0.5}, generator=_gen()).images
        assert q.loras == {name: 1.0}  # the call's scale is undone afterwards
        again = q(**kw, generator=_gen()).images
        q.set_loras([({}, 0.5, name)])
        half = q(**kw, generator=_gen()).images
    finally:
        q.unload_lora()
    assert _close(mine, theirs) <= TOL and _close(again, full) <= TOL and _close(mine, half) <= 1e-5
    assert _moved(theirs, full) and _moved(full, plain)


def test_attention_kwargs_other_keys(t2i, caplog):
    _, q = t2i["t2i"]
    kw = {**KW, "num_inference_steps": 1}
    with caplog.at_level(logging.WARNING, logger="qwenfast"):
        a = q(**kw, attention_kwargs={"ip_adapter_masks": None}, generator=_gen()).images
    assert "['ip_adapter_masks'] are not used" in caplog.text
    assert np.array_equal(a, q(**kw, generator=_gen()).images)
    with pytest.raises(ValueError, match="attention_mask"):  # diffusers' Qwen-Image attention refuses it too
        q(**kw, attention_kwargs={"attention_mask": torch.ones(1)})
    with pytest.raises(TypeError, match="encoder_hidden_states_mask"):
        q(**kw, attention_kwargs={"encoder_hidden_states_mask": None})
    with pytest.raises(TypeError, match="scale"):
        q(**kw, attention_kwargs={"scale": "0.5"})


# ------------------------------------------------------------------------------ callback_on_step_end
def _halve_first_half(pipe, i, t, kw):
    """A token-dependent change of the latents after step 0 (so the two libraries' token orders must agree)."""
    lat = kw["latents"]
    if i == 0:
        lat = lat.clone()
        lat[:, : lat.shape[1] // 2] *= 0.5
    return {"latents": lat}


class Recorder:
    """Records (step, timestep, num_timesteps) and applies `change`."""

    def __init__(self, change=None):
        self.seen, self.change = [], change

    def __call__(self, pipe, i, t, kw):
        self.seen.append((i, round(float(t), 4), pipe.num_timesteps, sorted(kw)))
        return self.change(pipe, i, t, kw) if self.change else kw


def test_callback_changing_latents_matches_diffusers(t2i):
    d, q = t2i["t2i"]
    rd, rq = Recorder(_halve_first_half), Recorder(_halve_first_half)
    theirs = d(**KW, callback_on_step_end=rd, generator=_gen()).images
    mine = q(**KW, callback_on_step_end=rq, generator=_gen()).images
    assert rq.seen == rd.seen and [s[0] for s in rq.seen] == [0, 1, 2] and rq.seen[0][2] == 3
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(**KW, generator=_gen()).images)


def test_callback_in_place_change_and_batched_cfg(t2i):
    """An in-place change of `callback_kwargs["latents"]` counts (diffusers keeps the same tensor);
    the batched-CFG forward sees the change as well as the two-pass one."""
    d, q = t2i["t2i"]

    def inplace(pipe, i, t, kw):
        if i == 1:
            kw["latents"].mul_(0.7)
        return kw

    kw = {**KW, "negative_prompt": "a blurry picture with many bad details"}
    theirs = d(**kw, callback_on_step_end=inplace, generator=_gen()).images
    outs = []
    for batched in (True, False):
        q.configure(batched_cfg=batched)
        outs.append(q(**kw, callback_on_step_end=inplace, generator=_gen()).images)
    q.configure(batched_cfg="auto")
    assert _close(outs[0], theirs) <= TOL and _close(outs[1], theirs) <= TOL
    assert _moved(theirs, d(**kw, generator=_gen()).images)


def test_callback_changing_prompt_embeds_matches_diffusers(t2i):
    d, q = t2i["t2i"]

    def scale_text(pipe, i, t, kw):
        return {"prompt_embeds": _mix(kw["prompt_embeds"])} if i == 0 else {}

    kw = {**KW, "prompt": ["a red circle on the left", "two blue squares at the very top"], "negative_prompt": " "}
    args = dict(callback_on_step_end=scale_text, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    theirs = d(**kw, **args, generator=[_gen(1), _gen(2)]).images
    outs = []
    for batched in (True, False):
        q.configure(batched_cfg=batched)
        outs.append(q(**kw, **args, generator=[_gen(1), _gen(2)]).images)
    q.configure(batched_cfg="auto")
    assert _close(outs[0], theirs) <= TOL and _close(outs[1], theirs) <= TOL
    assert _moved(theirs, d(**kw, generator=[_gen(1), _gen(2)]).images)


def test_interrupt_stops_after_the_step_like_diffusers(t2i):
    d, q = t2i["t2i"]

    def stop(pipe, i, t, kw):
        assert pipe.interrupt is False
        if i == 0:
            pipe._interrupt = True
        return kw

    theirs = d(**KW, callback_on_step_end=stop, generator=_gen()).images
    mine = q(**KW, callback_on_step_end=stop, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(**KW, generator=_gen()).images)
    assert q.interrupt is True and _close(q(**KW, generator=_gen()).images, d(**KW, generator=_gen()).images) <= TOL


def test_callback_sees_the_whole_batch_when_an_oom_splits_it(t2i):
    """An injected OOM splits the batch of 2 into rows: the step-end hook still sees and changes the
    whole batch, and each chunk continues from its own rows of what it returned."""
    d, q = t2i["t2i"]
    kw = {**KW, "prompt": ["a red circle", "a green square at the top"]}
    shapes = []

    def cb(pipe, i, t, k):
        shapes.append(tuple(k["latents"].shape))
        return _halve_first_half(pipe, i, t, k)

    whole = q(**kw, callback_on_step_end=_halve_first_half, generator=[_gen(1), _gen(2)]).images
    real = type(q.transformer).forward

    def tight(module, *args, **k):
        if args[0].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(module, *args, **k)

    q.transformer.forward = tight.__get__(q.transformer)
    try:
        split = q(**kw, callback_on_step_end=cb, generator=[_gen(1), _gen(2)])
    finally:
        del q.transformer.forward
    assert split.info["oom_backoff"] and all(s[0] == 2 for s in shapes)
    assert _close(split.images, whole) <= 1e-5
    theirs = d(**kw, callback_on_step_end=_halve_first_half, generator=[_gen(1), _gen(2)]).images
    assert _close(whole, theirs) <= TOL


def test_callback_in_inpaint_runs_after_the_blend_like_diffusers(t2i):
    d, q = t2i["inpaint"]
    kw = {**KW, "image": _image(48, 32, 2), "mask_image": _mask(48, 32, (8, 4, 40, 28)), "strength": 0.9}
    theirs = d(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    mine = q(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(**kw, generator=_gen()).images)


def test_callback_in_edit_and_controlnet(edit, edit_area, controlnet):
    d, q = edit
    kw = {**KW, "height": None, "width": None}
    img = _image(72, 40, 3)
    theirs = d(image=img, **kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    mine = q(img, **kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(image=img, **kw, generator=_gen()).images)
    d, q = controlnet
    kw = {**KW, "control_image": _image(48, 32, 4)}
    theirs = d(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    mine = q(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(**kw, generator=_gen()).images)


def test_callback_and_interrupt_in_qwen_image_21(q21):
    d, q = q21
    kw = dict(prompt="a red circle", output_resolution=64, num_inference_steps=3, output_type="np")
    theirs = d(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    mine = q(**kw, callback_on_step_end=_halve_first_half, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _moved(theirs, d(**kw, generator=_gen()).images)

    def stop(pipe, i, t, k):
        pipe._interrupt = i == 1
        return k

    theirs = d(**kw, callback_on_step_end=stop, return_dict=False, generator=_gen())[0]
    mine = q(**kw, callback_on_step_end=stop, return_dict=False, generator=_gen())[0]
    assert _close(mine, theirs) <= TOL


@pytest.mark.parametrize("kv_cache", [True, False])
def test_callback_prompt_embeds_in_qwen_image_21(q21, kv_cache):
    """2.1 fills its prefix KV cache (text and condition images) on step 0: with the cache, embeddings
    changed after step 0 reach nothing, in diffusers as here; without it they count from the next step."""
    d, q = q21

    def mix(pipe, i, t, kw):
        return {"prompt_embeds": _mix(kw["prompt_embeds"])} if i == 0 else {}

    kw = dict(prompt="a red circle", output_resolution=64, num_inference_steps=3, output_type="np",
              use_kv_cache=kv_cache, callback_on_step_end=mix, callback_on_step_end_tensor_inputs=["prompt_embeds"])  # fmt: skip
    theirs = d(**kw, generator=_gen()).images
    mine = q(**kw, generator=_gen()).images
    plain = d(**{**kw, "callback_on_step_end": None}, generator=_gen()).images
    assert _close(mine, theirs) <= TOL
    assert _moved(theirs, plain) != kv_cache  # the cache keeps step 0's prefix


def test_callback_arguments_are_checked(t2i):
    d, q = t2i["t2i"]
    kw = {**KW, "num_inference_steps": 1}
    with pytest.raises(ValueError, match="has to be in") as mine:
        q(**kw, callback_on_step_end=lambda *a: {}, callback_on_step_end_tensor_inputs=["noise_pred"])
    with pytest.raises(ValueError, match="has to be in") as theirs:
        d(**kw, callback_on_step_end=lambda *a: {}, callback_on_step_end_tensor_inputs=["noise_pred"])
    assert str(mine.value) == str(theirs.value)
    with pytest.raises(TypeError, match="must return a dict"):
        q(**kw, callback_on_step_end=lambda *a: None)
    with pytest.raises(ValueError, match="keep the shape"):
        q(**kw, callback_on_step_end=lambda p, i, t, k: {"latents": k["latents"][:, :2]})
    with pytest.raises(TypeError, match="callable"):
        q(**kw, callback_on_step_end="not a function")


# ------------------------------------------------------------------------------ prompt_embeds everywhere
def _embeds(d, prompt, **kw):
    emb, mask = d.encode_prompt(prompt=prompt, device="cpu", **kw)
    return emb, mask


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_prompt_embeds_in_img2img_and_inpaint(t2i, task):
    d, q = t2i[task]
    kw = {**KW, "image": _image(48, 32, 1), "strength": 0.8}
    kw.pop("prompt"), kw.pop("negative_prompt")
    if task == "inpaint":
        kw["mask_image"] = _mask(48, 32, (4, 4, 30, 28))
    pe, pm = _embeds(d, "a red circle on the left")
    ne, nm = _embeds(d, "blurry, a bad picture")
    emb = dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm)
    theirs = d(**kw, **emb, generator=_gen()).images
    mine = q(**kw, **emb, generator=_gen()).images
    by_text = q(**kw, prompt="a red circle on the left", negative_prompt="blurry, a bad picture", generator=_gen())
    assert _close(mine, theirs) <= TOL and _close(mine, by_text.images) <= 1e-5
    assert _moved(theirs, d(**kw, **{**emb, "prompt_embeds": _mix(pe)}, generator=_gen()).images)


def test_prompt_embeds_in_edit_and_controlnet(edit, edit_area, controlnet):
    from PIL import Image

    d, q = edit
    img = _image(72, 40, 3)
    kw = {k: v for k, v in KW.items() if k not in ("prompt", "negative_prompt", "height", "width")}
    im = img.resize((96, 64), resample=Image.LANCZOS)  # what diffusers' edit encodes with the prompt
    pe, pm = d.encode_prompt(prompt="make it red", image=im, device="cpu")
    ne, nm = d.encode_prompt(prompt=" ", image=im, device="cpu")
    emb = dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm)
    theirs = d(image=img, **kw, **emb, generator=_gen()).images
    mine = q(img, **kw, **emb, generator=_gen()).images
    by_text = q(img, prompt="make it red", negative_prompt=" ", **kw, generator=_gen()).images
    assert _close(mine, theirs) <= TOL and _close(mine, by_text) <= 1e-5
    assert _moved(theirs, d(image=img, **kw, **{**emb, "prompt_embeds": _mix(pe)}, generator=_gen()).images)
    d, q = controlnet
    pe, pm = _embeds(d, "a red circle on the left")
    kw = {**KW, "control_image": _image(48, 32, 4), "prompt": None, "prompt_embeds": pe, "prompt_embeds_mask": pm}
    assert _close(q(**kw, generator=_gen()).images, d(**kw, generator=_gen()).images) <= TOL


def test_prompt_and_prompt_embeds_rules(t2i):
    _, q = t2i["img2img"]
    kw = {**KW, "image": _image(48, 32, 1), "num_inference_steps": 1}
    emb = torch.zeros(1, 4, q.transformer.cfg.joint_attention_dim)
    with pytest.raises(ValueError, match="not both"):
        q(**kw, prompt_embeds=emb)
    with pytest.raises(ValueError, match="both are None"):
        q(**{**kw, "prompt": None})
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        q(**kw, negative_prompt_embeds=emb)
    with pytest.raises(ValueError, match="width"):
        q(**{**kw, "prompt": None}, prompt_embeds=torch.zeros(1, 4, 7))


# ------------------------------------------------------------------------------ loading and the pipeline object
def test_from_pretrained_diffusers_arguments(tiny_t2i, monkeypatch):
    import qwenfast
    from qwenfast import QwenImageControlNetModel, QwenImagePipeline

    path = str(tiny_t2i[1])
    pipe = QwenImagePipeline.from_pretrained(path, torch_dtype=torch.float32, low_cpu_mem_usage=True, device="cpu")
    assert pipe.dtype == torch.float32 and pipe.to("cpu") is pipe and pipe.to(torch.float32) is pipe
    assert pipe.to(device="cpu", dtype=torch.float32) is pipe
    with pytest.raises(ValueError, match="torch_dtype=torch.bfloat16"):
        pipe.to(torch.bfloat16)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            pipe.enable_model_cpu_offload()
    for bad, match in ((dict(device_map="balanced"), "device_map"), (dict(variant="fp16"), "variant"),
                       (dict(quantization_config=object()), "fp8=True"), (dict(vae=object()), "loads its own vae"),
                       (dict(use_safetensors=False), "safetensors")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            QwenImagePipeline.from_pretrained(path, **bad)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['colour'\\]"):
        QwenImagePipeline.from_pretrained(path, colour="red")
    with pytest.raises(ValueError, match="dtype=.* and torch_dtype"):
        QwenImagePipeline.from_pretrained(path, dtype=torch.float32, torch_dtype=torch.bfloat16)
    # a hub repo id is downloaded (here: "downloaded" to the local folder) with diffusers' hub arguments
    calls = []
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo, **kw: calls.append((repo, kw)) or path)
    p2 = qwenfast.from_pretrained("Qwen/Qwen-Image", device="cpu", torch_dtype=torch.float32, revision="main")
    assert type(p2).__name__ == "QwenImagePipeline" and calls == [("Qwen/Qwen-Image", {"revision": "main"})]
    with pytest.raises(ValueError, match="downloading it as a Hugging Face hub repo failed"):
        monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo, **kw: 1 / 0)
        QwenImageControlNetModel.from_pretrained("InstantX/Qwen-Image-ControlNet-Union")


def test_set_progress_bar_config_takes_tqdm_arguments(t2i, capsys):
    _, q = t2i["t2i"]
    q.set_progress_bar_config(desc="qwenfast-bar", leave=True)
    try:
        q(**{**KW, "num_inference_steps": 1}, generator=_gen())
    finally:
        q.set_progress_bar_config(disable=True)
    assert "qwenfast-bar" in capsys.readouterr().err


def test_edit_plus_alias():
    import qwenfast

    assert qwenfast.QwenImageEditPlusPipeline is qwenfast.QwenImageEditPipeline
    assert "QwenImageEditPlusPipeline" in qwenfast.__all__


def test_signatures_take_every_diffusers_argument():
    """Every argument of every diffusers 0.42.1 Qwen-Image `__call__`, in diffusers' order (qwenfast's own
    arguments come after them)."""
    import inspect

    import diffusers

    import qwenfast

    names = ["QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
             "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline", "QwenImageControlNetPipeline",
             "QwenImageControlNetInpaintPipeline", "QwenImageLayeredPipeline", "QwenImage21Pipeline"]  # fmt: skip
    for name in names:
        theirs = list(inspect.signature(getattr(diffusers, name).__call__).parameters)
        mine = list(inspect.signature(getattr(qwenfast, name).__call__).parameters)
        assert mine[: len(theirs)] == theirs, (name, [a for a in theirs if a not in mine])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_callback_with_cuda_graphs_to_cuda_and_model_offload(tiny_t2i):
    """On a GPU: a CPU-loaded pipeline moved with `.to("cuda")`; a latents-changing callback gives the
    same pixels with the transformer replayed from CUDA graphs as eagerly, and as diffusers on the GPU;
    `enable_model_cpu_offload` gives the same pixels too."""
    from qwenfast import QwenImagePipeline

    ref, path = tiny_t2i
    q = QwenImagePipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    assert q.to("cuda") is q and q.device.type == "cuda"
    outs = {}
    for graphs in (False, True):
        q.configure(cuda_graphs=graphs)
        outs[graphs] = q(**KW, callback_on_step_end=_halve_first_half, generator=_gen()).images
    plain = q(**KW, generator=_gen()).images
    assert _close(outs[True], outs[False]) <= 1e-5 and _moved(outs[True], plain)
    assert len(q._graphs.graphs) > 0  # the graphs path ran
    ref.to("cuda")
    try:
        theirs = ref(**KW, callback_on_step_end=_halve_first_half, generator=_gen()).images
    finally:
        ref.to("cpu")
    # the GPU runs cuDNN's TF32 convolutions in the VAE and qwenfast's fused kernels: 5e-3 there
    assert _close(outs[True], theirs) <= 5e-3
    q2 = QwenImagePipeline.from_pretrained(path, device="cuda", dtype=torch.float32)
    q2.set_progress_bar_config(disable=True)
    q2.enable_model_cpu_offload()
    assert q2.options.offload == "model"
    assert _close(q2(**KW, generator=_gen()).images, plain) <= 1e-4
