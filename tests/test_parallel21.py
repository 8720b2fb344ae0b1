"""Qwen-Image-2.1 on several CPU processes over gloo (runtime/parallel21.py): Ulysses (the prefix
whole on every rank, the target tokens sharded) and CFG-parallel give the one-process pixels (fp32,
1e-5), for odd target token counts (the shards are uneven), text-to-image with a padded prompt list
and an edit with the prefix KV cache on, with and without the step cache. Each run reports what it
sharded (`info["parallel"]`): the counts are checked, so a run that silently did not shard fails."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qwenfast.runtime.cache import CACHE_PRESETS as PRESETS
from qwenfast.testing.parallel import run_parallel

from .conftest import assert_close_finite

pytest.importorskip("diffusers")

LAYERS, HEADS = 3, 4  # ulysses=2: two heads per rank


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("par21") / "tiny21"
    build_tiny21_pipeline(path, seed=2, transformer_layers=LAYERS, heads=HEADS)
    return path


def _one(model, call, **options):
    import qwenfast

    pipe = qwenfast.from_pretrained(model, device="cpu", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.configure(**options)
    kw = dict(call)
    kw["generator"] = [torch.Generator().manual_seed(s) for s in kw.pop("seeds")]
    return pipe(**kw, output_type="np").images


def _image(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((40, 72, 3)) * 255).astype(np.uint8)


# 80 x 48 pixels: 5 x 3 = 15 target tokens (odd: 8 + 7 over two ranks); prompts of different lengths (padded)
T2I = dict(prompt=["a red circle", "two blue squares at the top of a green field"], negative_prompt=" ",
           true_cfg_scale=3.0, num_inference_steps=3, seeds=[1, 2], height=80, width=48, output_resolution=64)  # fmt: skip
EDIT = dict(prompt=["make it red"], image=_image(0), negative_prompt="blurry", true_cfg_scale=2.0,
            num_inference_steps=3, seeds=[6], height=48, width=112, output_resolution=64)  # 3 x 7 = 21 tokens  # fmt: skip


def _check(got, want, tmp_path, name, layout, forwards, exchanges=None):
    """Pixels, and what rank 0 sharded: its forwards, and one exchange per block evaluated in them."""
    assert_close_finite(got, want, atol=1e-5, rtol=0)
    info = json.loads((tmp_path / f"{name}.json").read_text())["info"]
    exchanges = forwards * LAYERS if exchanges is None else exchanges
    assert info == {"layout": layout, "sharded_forwards": forwards, "exchanges": exchanges}


@pytest.mark.parametrize("layout,world", [("cfg=1,ulysses=2", 2), ("cfg=2,ulysses=1", 2)])
def test_text_to_image_equals_one_process(model, tmp_path, layout, world):
    want = _one(model, T2I)
    got = run_parallel(model, layout, T2I, tmp_path / "t.npy", world)
    sharded = "ulysses=2" in layout
    _check(got, want, tmp_path, "t", layout, 3 * 2 if sharded else 0)  # 3 steps x 2 CFG branches on each rank
    assert np.abs(want[0] - want[1]).max() > 1e-2  # the two prompts' images differ: rows were not mixed
    moved = _one(model, dict(T2I, prompt=["a red square", T2I["prompt"][1]]))
    assert np.abs(moved[0] - want[0]).max() > 1e-3  # the tiny model reacts: the comparison could fail


def test_edit_with_kv_cache_cfg2_ulysses2_equals_one_process(model, tmp_path):
    want = _one(model, EDIT)
    got = run_parallel(model, "cfg=2,ulysses=2", EDIT, tmp_path / "e.npy", 4)
    _check(got, want, tmp_path, "e", "cfg=2,ulysses=2", 3)  # rank 0: the cond branch, 3 steps
    moved = _one(model, dict(EDIT, image=_image(1)))
    assert np.abs(moved - want).max() > 1e-3  # the condition image matters


@pytest.mark.parametrize("kv", [True, False])
def test_edit_ulysses_with_step_cache_equals_one_process(model, tmp_path, kv):
    """The step cache's residuals are per rank (its target chunk); static decisions agree on every rank."""
    call = dict(EDIT, true_cfg_scale=1.0, num_inference_steps=7, use_kv_cache=kv)
    want = _one(model, call, cache="fast")
    assert np.abs(want - _one(model, call)).max() > 1e-4  # the cache did change the computation
    got = run_parallel(model, "ulysses=2", call, tmp_path / "c.npy", 2, options={"cache": "fast"})
    p, run = PRESETS["fast"], 6 if kv else 7  # the cache's run: the steps after the KV-cache extract step
    skipped = sum(not p.static_full(i, run) for i in range(run))  # a cached step runs only `first` blocks
    assert skipped > 0
    _check(got, want, tmp_path, "c", "cfg=1,ulysses=2", 7, 7 * LAYERS - skipped * (LAYERS - p.first - p.last))


def test_cli_parallel_21_writes_the_one_process_image(model, tmp_path):
    """`qwenfast generate --model <2.1 folder> --parallel ulysses=2` starts the ranks; rank 0 writes the PNG."""
    from PIL import Image

    from qwenfast.cli import main

    args = ["generate", "a red circle", "--model", str(model), "--device", "cpu", "--seed", "3", "--steps", "2",
            "--size", "32x64", "--quiet"]  # fmt: skip
    assert main([*args, "-o", str(tmp_path / "one.png")]) == 0
    assert main([*args, "--parallel", "ulysses=2", "-o", str(tmp_path / "par.png")]) == 0
    par = Image.open(tmp_path / "par.png")
    assert par.text["parallel"] == "ulysses=2"
    one = np.asarray(Image.open(tmp_path / "one.png")).astype(int)
    assert np.abs(np.asarray(par).astype(int) - one).max() <= 1  # fp32: at most one 8-bit level
