"""Where qwenfast gives another result than diffusers 0.42.1 on purpose (docs/diffusers.md, "Differences
on purpose"), each shown on tiny random models: what diffusers does, and that qwenfast's result is
the intended one (each image equals its prompt run alone). The other documented differences are
tested beside the feature: one-step schedules in test_scheduler.py, Layered batches in
test_layered.py, edit prompt lists in test_edit.py, refused inputs in test_diffusers_images.py.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

KW = dict(height=32, width=32, num_inference_steps=2, output_type="np")
PROMPTS = ["a red circle", "a small blue square at the top left corner of the picture"]  # different lengths


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_prompt_list_with_several_images_per_prompt_pairs_each_prompt_with_its_own_mask(tiny_t2i, qf_t2i):
    """diffusers tiles the padding masks as a batch while it repeats the embeddings prompt by prompt:
    its images 1 and 2 (prompt 0's second, prompt 1's first) get the other prompt's mask. qwenfast's
    image r is what its prompt gives alone."""
    ref, q = tiny_t2i[0], qf_t2i
    kw = {**KW, "true_cfg_scale": 1.0}
    theirs = ref(prompt=PROMPTS, num_images_per_prompt=2, generator=_gens(range(4)), **kw).images
    mine = q(PROMPTS, num_images_per_prompt=2, generator=_gens(range(4)), **kw).images
    for r in range(4):
        alone = ref(prompt=PROMPTS[r // 2], generator=_gens([r]), **kw).images[0]
        assert np.abs(mine[r] - alone).max() <= 1e-3, r
        wrong = np.abs(theirs[r] - alone).max()
        assert (wrong >= 1e-2) if r in (1, 2) else (wrong <= 1e-3), (r, wrong)  # diffusers' mis-paired rows


def test_one_negative_prompt_for_a_prompt_list(tiny_t2i, qf_t2i):
    """diffusers broadcasts one negative over a prompt list with one image per prompt (the same images),
    and fails with more; qwenfast repeats it for every image."""
    ref, q = tiny_t2i[0], qf_t2i
    kw = {**KW, "true_cfg_scale": 4.0}
    a = ref(prompt=PROMPTS, negative_prompt=" ", generator=_gens([1, 2]), **kw).images
    b = q(PROMPTS, negative_prompt=" ", generator=_gens([1, 2]), **kw).images
    assert np.abs(a - b).max() <= 1e-3
    with pytest.raises(RuntimeError, match="must match the size"):
        ref(prompt=PROMPTS, negative_prompt=" ", num_images_per_prompt=2, generator=_gens(range(4)), **kw)
    mine = q(PROMPTS, negative_prompt=" ", num_images_per_prompt=2, generator=_gens(range(4)), **kw).images
    listed = q(PROMPTS, negative_prompt=[" ", " "], num_images_per_prompt=2, generator=_gens(range(4)), **kw).images
    assert np.isfinite(mine).all() and np.array_equal(mine, listed)


def test_layered_prompt_embeds_skip_the_caption(tmp_path):
    """With `prompt_embeds`, diffusers writes a caption it does not use; qwenfast writes none, same pixels."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as mod
    from PIL import Image

    from qwenfast.pipeline.layered import QwenImageLayeredPipeline
    from qwenfast.testing.tiny_control import build_tiny_layered

    ref = build_tiny_layered(tmp_path / "layered", seed=0)
    q = QwenImageLayeredPipeline.from_pretrained(tmp_path / "layered", device="cpu", dtype=torch.float32)
    q.set_progress_bar_config(disable=True)
    pic = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 4), dtype=np.uint8), "RGBA")
    pe, pm = ref.encode_prompt(prompt="a red circle", device="cpu")
    kw = dict(prompt_embeds=pe, prompt_embeds_mask=pm, layers=2, num_inference_steps=2, true_cfg_scale=1.0,
              output_type="np")  # fmt: skip
    real = mod.calculate_dimensions
    with mock.patch.object(mod, "calculate_dimensions", lambda area, ratio: real(64 * 64, ratio)), \
         mock.patch.object(ref, "get_image_caption", wraps=ref.get_image_caption) as d_caption:  # fmt: skip
        theirs = ref(pic, prompt="", resolution=640, generator=torch.Generator().manual_seed(3), **kw).images
    with mock.patch.object(q, "caption", side_effect=AssertionError("captioned")):
        mine = q(pic, resolution=64, generator=torch.Generator().manual_seed(3), **kw).images
        by_text = q(pic, "a red circle", resolution=64, generator=torch.Generator().manual_seed(3),
                    **{k: v for k, v in kw.items() if not k.startswith("prompt_embeds")}).images  # fmt: skip
    assert d_caption.called
    assert np.abs(np.concatenate(mine) - np.concatenate(theirs)).max() <= 1e-3
    assert np.abs(np.concatenate(mine) - np.concatenate(by_text)).max() <= 1e-5


def test_edit_plus_name_loads_what_the_folder_is(tmp_path):
    """`QwenImageEditPlusPipeline` is `QwenImageEditPipeline`: the folder's model_index.json picks the
    preprocessing (Edit v1 here), whichever name loads it."""
    from qwenfast import QwenImageEditPlusPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    build_tiny_pipeline(tmp_path / "edit-v1", seed=0, edit="edit")
    pipe = QwenImageEditPlusPipeline.from_pretrained(tmp_path / "edit-v1", device="cpu", dtype=torch.float32)
    assert pipe.mode == "edit"
