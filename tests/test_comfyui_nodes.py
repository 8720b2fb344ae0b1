"""The ComfyUI node pack (integrations/comfyui): node contracts as ComfyUI reads them, tensor layouts as
ComfyUI documents them, and outputs equal to qwenfast's own pipeline for the same seed.

ComfyUI itself is not installed in CI: the pack must import without it (its progress bar and interrupt
are looked up when a node runs; a fake `comfy` package checks that those hooks are called). The run
inside a real ComfyUI is recorded in integrations/comfyui/run-cpu/ (see its README).
Models: the embedded demo models (trained, so they react to prompts), on CPU in fp32, 128x128, 4 steps.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / "integrations" / "comfyui"
PROMPT = "a small red star at the top left, white background"
TOL = 1e-3
SIZE, STEPS, CFG = 128, 4, 2.0


def load_pack():
    """Import the pack as ComfyUI does (a package from its folder, under the folder's name)."""
    name = "qwenfast_comfyui"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACK / "__init__.py", submodule_search_locations=[str(PACK)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pack():
    return load_pack()


@pytest.fixture(scope="module")
def model(pack):
    (m,) = pack.NODE_CLASS_MAPPINGS["QwenFastLoader"]().load("demo", "cpu", "fp32", False, "none", "off", False, "none")
    return m


@pytest.fixture(scope="module")
def ref():
    from qwenfast import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(None, device="cpu", dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    from qwenfast_comfyui.run_workflow import make_lora  # the pack is imported by then (fixture order)

    d = tmp_path_factory.mktemp("loras")
    make_lora(d / "a.safetensors", seed=1)
    make_lora(d / "b.safetensors", seed=2)
    return d / "a.safetensors", d / "b.safetensors"


def ref_image(pipe, prompt=PROMPT, seed=3, **kw) -> np.ndarray:
    kw = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS, "true_cfg_scale": CFG, **kw}
    out = pipe(prompt, negative_prompt=" ", generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kw)
    return out.images  # (B, H, W, 3)


def sample(pack, model, prompt=PROMPT, seed=3, **kw):
    args = {"negative_prompt": " ", "seed": seed, "steps": STEPS, "cfg": CFG, "width": SIZE, "height": SIZE,
            "batch_size": 1, **kw}  # fmt: skip
    return pack.NODE_CLASS_MAPPINGS["QwenFastSampler"]().sample(model, prompt, **args)


def maxdiff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all(), "NaN/inf"
    return float(np.abs(a - b).max())


# ---------------------------------------------------------------------------------------------- contracts


def test_pack_imports_without_comfyui_and_exports_its_mappings(pack):
    assert "comfy" not in sys.modules or not hasattr(sys.modules["comfy"], "__qwenfast_fake__")
    classes, names = pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS
    assert set(classes) == set(names)
    assert {"QwenFastLoader", "QwenFastLoRA", "QwenFastSampler", "QwenFastEdit"} <= set(classes)
    assert all(isinstance(v, str) and v for v in names.values())


COMFY_TYPES = {"STRING", "INT", "FLOAT", "BOOLEAN", "IMAGE", "LATENT", "CONDITIONING", "QWENFAST_MODEL"}


@pytest.mark.parametrize("key", ["QwenFastLoader", "QwenFastLoRA", "QwenFastSampler", "QwenFastEdit",
                                 "QwenFastEncodePrompt", "QwenFastDecode"])  # fmt: skip
def test_node_contract(pack, key):
    """What ComfyUI's executor and front end read from a classic node class."""
    cls = pack.NODE_CLASS_MAPPINGS[key]
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"} and spec["required"]
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            assert isinstance(entry, tuple) and 1 <= len(entry) <= 2, (name, entry)
            kind = entry[0]
            assert isinstance(kind, list) and kind or kind in COMFY_TYPES, (name, kind)  # combo or type
            opts = entry[1] if len(entry) > 1 else {}
            assert isinstance(opts, dict)
            if isinstance(kind, list) and "default" in opts:
                assert opts["default"] in kind
            if kind in ("INT", "FLOAT") and "default" in opts:
                assert opts.get("min", -np.inf) <= opts["default"] <= opts.get("max", np.inf), name
    assert isinstance(cls.RETURN_TYPES, tuple) and all(t in COMFY_TYPES for t in cls.RETURN_TYPES)
    if hasattr(cls, "RETURN_NAMES"):
        assert len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES)
    fn = getattr(cls(), cls.FUNCTION)
    assert callable(fn) and isinstance(cls.CATEGORY, str)
    # every required and optional input is a parameter of FUNCTION (ComfyUI passes them by name)
    import inspect

    params = inspect.signature(fn).parameters
    for section in ("required", "optional"):
        for name in spec.get(section, {}):
            assert name in params, f"{key}.{cls.FUNCTION} lacks parameter {name!r}"
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    assert set(required) <= set(spec["required"]), f"{key}: parameters ComfyUI never passes: {required}"


# ---------------------------------------------------------------------------------------------- outputs


def test_sampler_equals_pipeline_and_layouts(pack, model, ref):
    latent, image = sample(pack, model)
    want = ref_image(ref)
    # IMAGE: (B, H, W, C) float32 in [0, 1] on the CPU, as ComfyUI's LoadImage / VAEDecode make it
    assert image.shape == (1, SIZE, SIZE, 3) and image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0 <= float(image.min()) and float(image.max()) <= 1
    assert maxdiff(image, want) <= TOL
    other = ref_image(ref, prompt=PROMPT.replace("red star", "blue circle"))
    assert maxdiff(other, want) >= 10 * TOL, "the demo model must react to the prompt for this test to mean much"
    # LATENT: Qwen-Image's ComfyUI format is Wan21's (16 channels, 3 latent dims): (B, 16, 1, h, w),
    # stored un-normalised (VAE space; ComfyUI's sampler applies process_in/out around the model)
    s = latent["samples"]
    assert s.shape == (1, 16, 1, SIZE // 8, SIZE // 8) and s.dtype == torch.float32
    packed = ref(PROMPT, negative_prompt=" ", height=SIZE, width=SIZE, num_inference_steps=STEPS, true_cfg_scale=CFG,
                 generator=torch.Generator("cpu").manual_seed(3), output_type="latent").images  # fmt: skip
    from qwenfast.pipeline.sampling import unpack_latents

    mean = torch.tensor(ref.vae.cfg.latents_mean).view(1, 16, 1, 1, 1)  # Wan21.process_out's layout
    std = torch.tensor(ref.vae.cfg.latents_std).view(1, 16, 1, 1, 1)
    norm = unpack_latents(packed, SIZE // 8, SIZE // 8).unsqueeze(2)
    assert maxdiff(s, norm * std + mean) <= 1e-5
    assert maxdiff((s - mean) / std, norm) <= 1e-5  # = Wan21.process_in(samples)


def test_decode_node_and_latent_input(pack, model):
    latent, image = sample(pack, model)
    (decoded,) = pack.NODE_CLASS_MAPPINGS["QwenFastDecode"]().decode(model, latent)
    assert maxdiff(decoded, image) <= TOL
    (decoded4,) = pack.NODE_CLASS_MAPPINGS["QwenFastDecode"]().decode(model, {"samples": latent["samples"][:, :, 0]})
    assert maxdiff(decoded4, image) <= TOL  # a 4-D (B, 16, h, w) latent, as EmptySD3LatentImage makes
    # an empty latent sets size and batch (KSampler at denoise 1.0 ignores its content likewise)
    empty = {"samples": torch.zeros(2, 16, 8, 12)}
    lat2, img2 = sample(pack, model, latent_image=empty)
    assert img2.shape == (2, 64, 96, 3) and lat2["samples"].shape == (2, 16, 1, 8, 12)
    with pytest.raises(ValueError, match="one frame"):
        pack.NODE_CLASS_MAPPINGS["QwenFastDecode"]().decode(model, {"samples": torch.zeros(1, 16, 3, 8, 8)})


def test_conditioning_inputs_equal_text_prompts(pack, model, ref):
    enc = pack.NODE_CLASS_MAPPINGS["QwenFastEncodePrompt"]()
    (pos,) = enc.encode(model, PROMPT)
    (neg,) = enc.encode(model, " ")
    assert isinstance(pos, list) and isinstance(pos[0][0], torch.Tensor) and isinstance(pos[0][1], dict)
    assert pos[0][0].ndim == 3 and pos[0][0].shape[2] == model.pipe.transformer.cfg.joint_attention_dim
    _, image = sample(pack, model, prompt="", positive=pos, negative=neg)
    assert maxdiff(image, ref_image(ref)) <= TOL
    # a padded batch of two prompts through one CONDITIONING (attention_mask as ComfyUI carries it)
    emb_a, mask_a = model.pipe.encode_prompt([PROMPT, "a big blue circle in the middle, black background"])
    assert mask_a is not None, "two prompts of different lengths need a mask"
    cond = [[emb_a, {"pooled_output": None, "attention_mask": mask_a}]]
    _, img2 = sample(pack, model, prompt="", positive=cond, negative=neg)
    assert img2.shape[0] == 2 and maxdiff(img2[:1], ref_image(ref)) <= TOL
    with pytest.raises(ValueError, match="width"):
        sample(pack, model, prompt="", positive=[[torch.zeros(1, 5, 7), {}]])
    with pytest.raises(ValueError, match="Edit"):
        sample(pack, model, prompt="", positive=[[emb_a[:1], {"reference_latents": [torch.zeros(1)]}]])


def test_lora_stacking_and_hot_swap(pack, model, ref, lora_files):
    a, b = lora_files
    lora = pack.NODE_CLASS_MAPPINGS["QwenFastLoRA"]()
    (one,) = lora.apply(model, str(a), 0.8)
    (two,) = lora.apply(one, str(b), -0.5)
    plain = ref_image(ref)
    ref.set_loras([(str(a), 0.8), (str(b), -0.5)])
    want_two = ref_image(ref)
    ref.set_loras([])
    assert maxdiff(want_two, plain) >= 10 * TOL, "the LoRAs must change the image"
    _, img_two = sample(pack, two)
    assert maxdiff(img_two, want_two) <= TOL
    _, img_plain = sample(pack, model)  # the base handle again: LoRAs unfused (hot swap, bitwise restore)
    assert maxdiff(img_plain, plain) <= TOL and model.pipe.loras == {}
    (zero,) = lora.apply(model, str(a), 0.0)
    assert zero.loras == ()  # strength 0 = bypass


def test_edit_node_one_and_two_images(pack):
    from PIL import Image

    from qwenfast.pipeline.edit import QwenImageEditPipeline

    nodes = pack.NODE_CLASS_MAPPINGS
    (m,) = nodes["QwenFastLoader"]().load("demo-edit", "cpu", "fp32", False, "none", "off", False, "none")
    ref = QwenImageEditPipeline.from_pretrained(None, device="cpu", dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ims = [Image.new("RGB", (128, 128), c) for c in ("white", (20, 40, 200))]
    for x, y in ((30, 30), (80, 70)):
        ims[0].paste((220, 30, 30), (x, y, x + 24, y + 24))
    as_comfy = [torch.from_numpy(np.asarray(im, dtype=np.float32) / 255)[None] for im in ims]  # (1, H, W, 3)
    prompt = "make the squares blue"

    def want(images, p=prompt):
        return ref(images, p, negative_prompt=" ", num_inference_steps=STEPS, true_cfg_scale=3.0,
                   generator=torch.Generator("cpu").manual_seed(5), output_type="np").images  # fmt: skip

    edit = nodes["QwenFastEdit"]()
    args = {"negative_prompt": " ", "seed": 5, "steps": STEPS, "cfg": 3.0, "width": 0, "height": 0, "batch_size": 1}
    lat, img = edit.edit(m, prompt, image=as_comfy[0], **args)
    w1 = want(ims[:1])
    assert img.shape == (1, *w1.shape[1:]) and lat["samples"].ndim == 5 and maxdiff(img, w1) <= TOL
    assert maxdiff(want(ims[:1], "make the background black"), w1) >= 10 * TOL
    _, img2 = edit.edit(m, prompt, image=as_comfy[0], image2=as_comfy[1], **args)
    assert maxdiff(img2, want(ims)) <= TOL and maxdiff(img2, img) >= 10 * TOL
    with pytest.raises(ValueError, match="edit model"):
        sample(pack, m)
    (t2i,) = nodes["QwenFastLoader"]().load("demo", "cpu", "fp32", False, "none", "off", False, "none")
    with pytest.raises(ValueError, match="text-to-image"):
        edit.edit(t2i, prompt, image=as_comfy[0], **args)


# ---------------------------------------------------------------------------------------------- ComfyUI hooks


def test_progress_bar_and_interrupt(pack, model, ref, monkeypatch):
    """Inside ComfyUI the sampler reports each step to comfy.utils.ProgressBar and checks
    comfy.model_management.throw_exception_if_processing_interrupted between steps."""
    calls, state = [], {"steps_left": None}

    class ProgressBar:
        def __init__(self, total):
            calls.append(("total", total))

        def update_absolute(self, value, total=None, preview=None):
            calls.append((value, total))

    class Interrupted(Exception):
        pass

    def throw_exception_if_processing_interrupted():
        if state["steps_left"] is not None:
            state["steps_left"] -= 1
            if state["steps_left"] < 0:
                raise Interrupted

    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    comfy.__qwenfast_fake__ = True
    utils = types.ModuleType("comfy.utils")
    utils.ProgressBar = ProgressBar
    mm = types.ModuleType("comfy.model_management")
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    comfy.utils, comfy.model_management = utils, mm
    for name, mod in (("comfy", comfy), ("comfy.utils", utils), ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, mod)

    _, image = sample(pack, model)
    assert calls == [("total", STEPS)] + [(i + 1, STEPS) for i in range(STEPS)]
    assert maxdiff(image, ref_image(ref)) <= TOL
    calls.clear()
    state["steps_left"] = 1  # the check before sampling passes; "cancel" is seen right after step 1
    with pytest.raises(Interrupted):
        sample(pack, model)
    assert calls == [("total", STEPS), (1, STEPS)]  # stopped between steps 1 and 2
    state["steps_left"] = None
    _, again = sample(pack, model)
    assert maxdiff(again, image) == 0  # nothing left half-done


def test_nodes_run_under_inference_mode_as_comfyui_runs_them(pack, ref):
    """ComfyUI executes nodes inside torch.inference_mode(): weights loaded there are inference tensors
    (no version counter), which the VAE's cached sub-pixel weights once tripped over."""
    with torch.inference_mode():
        (m,) = pack.NODE_CLASS_MAPPINGS["QwenFastLoader"]().load("demo", "cpu", "fp32", False, "none", "off", False,
                                                                  "none")  # fmt: skip
        _, image = sample(pack, m)
    assert maxdiff(image, ref_image(ref)) <= TOL


def test_nodes_compute_at_qwenfast_precision_where_comfyui_set_tf32(pack, model, monkeypatch):
    """ComfyUI sets torch's float32 matmul precision to "high" (TF32) when imported; a pipeline built, given
    LoRAs or run under it gave bf16 images up to 17/255 off `qwenfast generate`'s on an H100. The nodes run
    their whole bodies at torch's default ("highest") and put ComfyUI's setting back after."""
    seen = []
    cls = type(model.pipe)
    for name in ("__call__", "encode_prompt", "set_loras", "decode_latents"):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _real=real, _n=name, **k: (
            seen.append((_n, torch.get_float32_matmul_precision())), _real(self, *a, **k))[1])  # fmt: skip
    import qwenfast

    real_load = qwenfast.from_pretrained
    monkeypatch.setattr(qwenfast, "from_pretrained", lambda *a, **k: (
        seen.append(("from_pretrained", torch.get_float32_matmul_precision())), real_load(*a, **k))[1])  # fmt: skip
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        (m,) = pack.NODE_CLASS_MAPPINGS["QwenFastLoader"]().load("demo", "cpu", "fp32", False, "none", "off", False, "none")
        assert torch.get_float32_matmul_precision() == "high"  # ComfyUI's setting, back after each node
        latent, _ = sample(pack, m)
        pack.NODE_CLASS_MAPPINGS["QwenFastEncodePrompt"]().encode(m, PROMPT)
        pack.NODE_CLASS_MAPPINGS["QwenFastDecode"]().decode(m, latent)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert {n for n, _ in seen} == {"from_pretrained", "__call__", "encode_prompt", "set_loras", "decode_latents"}, seen
    assert all(p == "highest" for _, p in seen), seen
