"""Bad input to the pipeline gets a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

BASE = dict(height=32, width=32, num_inference_steps=1, true_cfg_scale=1.0, output_type="np")


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(prompt=[]), ValueError, "empty list"),
        (dict(prompt=None), ValueError, r"`prompt` \(text\) or `prompt_embeds`"),  # diffusers: ValueError too
        (dict(prompt=["a", 3]), TypeError, "`prompt` must be a string"),
        (dict(prompt="a", num_inference_steps=0), ValueError, "num_inference_steps"),
        (dict(prompt="a", num_inference_steps=-3), ValueError, "num_inference_steps"),
        (dict(prompt="a", height=8), ValueError, "`height` must be an integer >= 16"),
        (dict(prompt="a", width=64.5), ValueError, "`width` must be an integer"),
        (dict(prompt="a", num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
        (dict(prompt="a", output_type="jpeg"), ValueError, "output_type"),
        (dict(prompt="a", max_sequence_length=2048), ValueError, "max_sequence_length"),
        (dict(prompt=["a", "b"], negative_prompt=["x", "y", "z"], true_cfg_scale=2.0), ValueError, "negative prompts"),
        (dict(prompt="a", latents=torch.zeros(1, 3, 64)), ValueError, "latents must have shape"),
    ],
)
def test_bad_inputs(qf_t2i, kw, err, match):
    with pytest.raises(err, match=match):
        qf_t2i(**{**BASE, **kw})


def test_size_not_multiple_of_16_is_floored_like_diffusers(qf_t2i):
    with pytest.warns(UserWarning, match="floored to 32x48"):
        out = qf_t2i("a", **{**BASE, "height": 40, "width": 50})
    assert out.images.shape == (1, 32, 48, 3)


def test_single_negative_prompt_is_broadcast(qf_t2i, monkeypatch):
    """One negative prompt for two prompts: every row of the negative conditioning is that prompt's
    embedding encoded alone, and each image is the one its prompt gives alone with that negative."""
    import numpy as np

    kw = {**BASE, "true_cfg_scale": 3.0, "num_inference_steps": 2}
    seen = []
    real = qf_t2i._generate
    monkeypatch.setattr(qf_t2i, "_generate", lambda **k: seen.append(k) or real(**k))
    out = qf_t2i(["a red circle", "b"], negative_prompt="bad", generator=[torch.Generator().manual_seed(s) for s in (1, 2)],
                 **kw).images  # fmt: skip
    monkeypatch.undo()
    alone_emb, alone_mask = qf_t2i.encode_prompt(["bad"])
    uncond = seen[0]["uncond"]
    assert uncond.emb.shape[0] == 2 and torch.isfinite(uncond.emb).all()
    for row in range(2):
        L = alone_emb.shape[1]
        torch.testing.assert_close(uncond.emb[row, :L], alone_emb[0], rtol=0, atol=0)
        assert uncond.mask is None or bool(uncond.mask[row, :L].all()) and not uncond.mask[row, L:].any()
    assert alone_mask is None or bool(alone_mask.all())
    assert out.shape[0] == 2 and np.isfinite(out).all()
    for i, (p, s) in enumerate((("a red circle", 1), ("b", 2))):
        one = qf_t2i([p], negative_prompt="bad", generator=[torch.Generator().manual_seed(s)], **kw).images[0]
        other = qf_t2i([p], negative_prompt="a blue square", generator=[torch.Generator().manual_seed(s)], **kw).images[0]
        d = np.abs(out[i] - one).max()
        assert d < 1e-5 and np.abs(other - one).max() > 100 * 1e-5, (i, d)  # the negative matters here


def test_bad_device_and_dtype():
    from qwenfast.pipeline.text_to_image import resolve_device, resolve_dtype

    with pytest.raises(ValueError, match="dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            resolve_device("cuda")
