"""Bad input to the pipeline gets a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

BASE = dict(height=32, width=32, num_inference_steps=1, true_cfg_scale=1.0, output_type="np")


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(prompt=[]), ValueError, "empty list"),
        (dict(prompt=None), TypeError, "`prompt` must be a string"),
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


def test_single_negative_prompt_is_broadcast(qf_t2i):
    out = qf_t2i(["a", "b"], negative_prompt="bad", **{**BASE, "true_cfg_scale": 3.0})
    assert out.images.shape[0] == 2


def test_bad_device_and_dtype():
    from qwenfast.pipeline.text_to_image import resolve_device, resolve_dtype

    with pytest.raises(ValueError, match="dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            resolve_device("cuda")
