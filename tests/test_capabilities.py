"""What a model can do, declared once: each pipeline class's `CAPABILITIES` (pipeline/tasks.py), the
registry in pipeline/auto.py, a loaded model's `pipe.capabilities`, and `for_task` as a thin object over
the loaded model's shared state (pipeline/state.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

import qwenfast
from qwenfast.pipeline import auto
from qwenfast.pipeline.diffusers_compat import DiffusersMethods
from qwenfast.pipeline.tasks import Capabilities

# what a pipeline object may hold itself: its model state, and the state of the call running on it
PER_CALL = {n for n, v in vars(DiffusersMethods).items() if n.startswith("_") and not n.startswith("__") and not callable(v)}


@pytest.fixture(scope="module")
def t2i():
    return qwenfast.from_pretrained(qwenfast.DEMO_MODEL, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def edit():
    return qwenfast.from_pretrained(qwenfast.DEMO_EDIT_MODEL, device="cpu", dtype=torch.float32)


def test_every_registered_class_declares_what_it_loads_and_runs():
    seen = []
    for cls in auto.PIPELINES:
        c = vars(cls).get("CAPABILITIES")
        assert isinstance(c, Capabilities) and c.tasks and cls.folder_kinds and cls.checkpoints, cls.__name__
        seen += c.tasks
    assert sorted(t for t in set(seen) if seen.count(t) > 1) == ["edit", "text-to-image"]  # 2.1's, in one class
    assert auto.folder_tasks("text-to-image")[:3] == ["text-to-image", "img2img", "inpaint"]
    assert auto.folder_tasks("edit-plus") == auto.folder_tasks("edit") == ["edit", "edit-inpaint"]
    assert auto.folder_tasks("qwen-image-2.1") == ["text-to-image", "edit"]
    assert auto.task_class("edit", "inpaint").__name__ == "QwenImageEditInpaintPipeline"  # an edit model's inpainting
    with pytest.raises(ValueError, match="needs a layered model .Qwen-Image-Layered.; this folder holds an edit model"):
        auto.task_class("edit", "layered")


def test_a_loaded_model_answers_for_its_folder(t2i, edit):
    c = t2i.capabilities
    assert (c.model_type, c.tasks, c.max_images, c.mask, c.rgba) == (
        "qwen-image", ("text-to-image", "img2img", "inpaint"), 1, True, False)  # fmt: skip
    e = edit.capabilities
    assert (e.model_type, e.variant, e.tasks, e.max_images, e.mask) == (
        "qwen-image-edit-plus", "edit-plus", ("edit", "edit-inpaint"), 3, True)  # fmt: skip
    v1 = copy.copy(edit)  # the same model as an Edit v1 folder loads: the class's rule, answered per folder
    v1.mode = "edit"
    assert (v1.capabilities.model_type, v1.capabilities.max_images) == ("qwen-image-edit", 1)
    assert edit.capabilities.max_images == 3  # the copy's state is its own


def test_for_task_is_a_thin_object_over_the_same_state(t2i):
    view = t2i.for_task("inpaint")
    assert type(view).__name__ == "QwenImageInpaintPipeline" and set(vars(view)) == {"_model_state"}
    assert view.transformer is t2i.transformer and view.defaults is t2i.defaults
    assert t2i.for_task("text-to-image") is t2i and view.for_task("img2img").capabilities == t2i.capabilities
    before = t2i.options
    try:
        view.configure(batched_cfg=False)
        assert t2i.options.batched_cfg is False  # one state: a change through either is seen by both
        t2i.apply_preset("lightning-4")
        assert view.defaults["num_inference_steps"] == 4
    finally:
        t2i.configure(batched_cfg=before.batched_cfg)
        t2i.defaults.update(num_inference_steps=20, true_cfg_scale=2.0)
        t2i.scheduler_overrides = {}
    with pytest.raises(ValueError, match="does not run 'controlnet', which needs .* ControlNet"):
        t2i.for_task("controlnet")


def test_a_pipeline_holds_nothing_but_its_state_and_its_call(t2i, edit):
    """Every attribute a pipeline sets is declared shared (pipeline/state.py), so a view sees all of it;
    only the running call's own state stays with the object."""
    for pipe in (t2i, edit, t2i.for_task("img2img")):
        assert set(vars(pipe)) <= {"_model_state"} | PER_CALL, (type(pipe).__name__, sorted(vars(pipe)))
    img = Image.new("RGB", (32, 32), "red")
    t2i.for_task("img2img")("x", image=img, strength=0.5, num_inference_steps=2, height=32, width=32,
                            output_type="latent")  # fmt: skip
    edit(img, "x", num_inference_steps=1, height=32, width=32, output_type="latent")
    for pipe in (t2i, edit):
        assert set(vars(pipe)) <= {"_model_state"} | PER_CALL, (type(pipe).__name__, sorted(vars(pipe)))


def test_a_stand_in_answers_as_the_loaded_pipeline(edit):
    """What Ray Serve's ingress holds: the class over the settings, no weights."""
    s = auto.stand_in(type(edit).__name__, edit.settings())
    call = {"image": [Image.new("RGB", (64, 40))], "height": None, "width": None}
    assert s.capabilities == edit.capabilities and s.output_size(call) == edit.output_size(call)
    inpaint = {"image": [Image.new("RGB", (64, 40))], "height": 32, "width": 32}
    assert s.for_task("edit-inpaint").output_size(inpaint) == edit.for_task("edit-inpaint").output_size(inpaint)
    assert s.size_note(512, 512) == edit.size_note(512, 512)


def test_copy_is_a_pipeline_of_its_own(t2i):
    c = copy.copy(t2i)
    c.defaults = {"num_inference_steps": 1}
    assert t2i.defaults["num_inference_steps"] == 20 and c.transformer is t2i.transformer


def test_single_files_load_under_the_class_of_the_task():
    with pytest.raises(ValueError, match="unknown task"):
        auto.from_single_files("t", "v", "te", task="outpaint")
    with pytest.raises(ValueError, match="loads from a model folder only"):
        auto.from_single_files("t", "v", "te", task="layered")
