"""One seed rule everywhere: image i of a request with seed S is drawn from its own generator seeded
S + i and reports / records S + i, so it is the image that seed S + i makes alone. `qwenfast generate
--seed 7 --n 2` used to draw both images from one generator and write seed 7 into both PNGs: image 2
could not be made again from any seed shown."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwenfast.cli import main
from qwenfast.validation import MAX_SEED, image_seeds

FAST = ["--steps", "2", "--quiet", "--device", "cpu"]


def same_image(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal, or off by one 8-bit level on under 1% of values (CPU BLAS picks its kernels by batch size)."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    d = np.abs(a.astype(int) - b.astype(int))
    return int(d.max()) <= 1 and float((d > 0).mean()) < 0.01


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_rule():
    assert image_seeds(7, 3) == [7, 8, 9]
    assert image_seeds(MAX_SEED, 2) == [MAX_SEED, 0]  # wraps inside the seed range
    assert image_seeds(2**64 - 1, 2, 2**64 - 1) == [2**64 - 1, 0]  # ComfyUI's 64-bit range


def test_server_params_follow_the_rule():
    pytest.importorskip("pydantic")
    from qwenfast.server.options import Limits
    from qwenfast.server.schemas import validate

    p = validate({"prompt": "x", "seed": 7, "n": 3}, Limits(), {"width": 32, "height": 32})
    assert p.seeds() == [7, 8, 9]


@pytest.mark.parametrize("extra", [[], ["--image", "IMG"]], ids=["text-to-image", "img2img"])
def test_generate_image_i_of_n_is_seed_plus_i(extra, tmp_path, capsys):
    """Image 2 of `--seed 7 --n 2` equals `--seed 8 --n 1`, and its PNG says seed 8."""
    if extra:
        Image.new("RGB", (32, 32), (40, 70, 200)).save(tmp_path / "in.png")
        extra = ["--image", str(tmp_path / "in.png")]
    args = ["generate", "a small red circle at the top left, blue background", "--size", "32x32", *FAST, *extra]
    assert main([*args, "--seed", "7", "--n", "2", "-o", str(tmp_path / "pair.png")]) == 0
    assert main([*args, "--seed", "8", "-o", str(tmp_path / "eight.png")]) == 0
    assert main([*args, "--seed", "7", "-o", str(tmp_path / "seven.png")]) == 0
    first, second = tmp_path / "pair-0.png", tmp_path / "pair-1.png"
    assert Image.open(first).text["seed"] == "7" and Image.open(second).text["seed"] == "8"
    assert same_image(pixels(second), pixels(tmp_path / "eight.png"))
    assert same_image(pixels(first), pixels(tmp_path / "seven.png"))
    assert not same_image(pixels(first), pixels(second)), "two seeds, two different images"
    assert "seeds 7..8" in capsys.readouterr().out


def test_edit_image_i_of_n_is_seed_plus_i(tmp_path):
    Image.new("RGB", (64, 64), (255, 255, 255)).save(tmp_path / "in.png")
    args = ["edit", str(tmp_path / "in.png"), "--prompt", "add a small red circle", *FAST]
    assert main([*args, "--seed", "7", "--n", "2", "-o", str(tmp_path / "pair.png")]) == 0
    assert main([*args, "--seed", "8", "-o", str(tmp_path / "eight.png")]) == 0
    assert Image.open(tmp_path / "pair-1.png").text["seed"] == "8"
    assert same_image(pixels(tmp_path / "pair-1.png"), pixels(tmp_path / "eight.png"))


def test_comfyui_batch_image_i_is_seed_plus_i():
    from tests.test_comfyui_nodes import load_pack, maxdiff

    pack = load_pack()
    (model,) = pack.NODE_CLASS_MAPPINGS["QwenFastLoader"]().load("demo", "cpu", "fp32", False, "none", "off", False,
                                                                 "none")  # fmt: skip
    sampler = pack.NODE_CLASS_MAPPINGS["QwenFastSampler"]()
    args = {"negative_prompt": " ", "steps": 2, "cfg": 2.0, "width": 128, "height": 128}
    prompt = "a small red circle at the top left, blue background"
    _, pair = sampler.sample(model, prompt, seed=7, batch_size=2, **args)
    _, eight = sampler.sample(model, prompt, seed=8, batch_size=1, **args)
    _, seven = sampler.sample(model, prompt, seed=7, batch_size=1, **args)
    assert pair.shape[0] == 2 and torch.isfinite(pair).all()
    assert maxdiff(pair[1:], eight) <= 1e-3 and maxdiff(pair[:1], seven) <= 1e-3
    assert maxdiff(pair[:1], pair[1:]) > 1e-2
