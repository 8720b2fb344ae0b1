"""`qwenfast serve --warm-up SIZES` (server/warmup.py): the batch shapes of those sizes run once before the
server serves, largest first, through the worker's own path; /health shows the progress; a bad size is
refused at start-up with the nearest valid ones; with per-row LoRAs each shape runs with and without an
adapter. CPU, the tiny demo pipeline (no CUDA graphs here: what is checked is which calls the warm-up
makes, the calls whose graphs a GPU server captures)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from qwenfast import QwenImagePipeline  # noqa: E402
from qwenfast.errors import ConfigureError  # noqa: E402
from qwenfast.server.app import create_app  # noqa: E402
from qwenfast.server.options import ServerConfig, add_serve_arguments, config_from_args, parse_sizes  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from qwenfast.server.warmup import plan  # noqa: E402

from .test_lora_rows import _lora  # noqa: E402
from .test_server import G, _wait, running  # noqa: E402

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"


class Recorder:
    """The pipeline, recording each call's (width, height, images, true-CFG scale, negative prompt given,
    per-row LoRAs, steps)."""

    def __init__(self, pipe):
        self._pipe, self.calls = pipe, []

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __call__(self, *args, **kw):
        loras = kw.get("loras")
        self.calls.append(
            (kw["width"], kw["height"], len(kw["prompt"]), kw["true_cfg_scale"],
             kw.get("negative_prompt") is not None, None if loras is None else [len(r) for r in loras],
             kw["num_inference_steps"])
        )  # fmt: skip
        return self._pipe(*args, **kw)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


def test_plan_runs_the_largest_shapes_first():
    got = plan(((32, 32), (64, 48), (48, 48)), 4, 4.0, None, None)
    shapes = [(p.width * p.height, p.cfg, p.negative, p.n, p.steps, lo) for p, lo in got]
    assert [s[0] for s in shapes] == [64 * 48] * 6 + [48 * 48] * 6 + [32 * 32] * 6  # largest size first
    assert shapes[:6] == [(3072, 4.0, " ", b, 1, ()) for b in (4, 2, 1)] + [
        (3072, 1.0, None, b, 1, ()) for b in (4, 2, 1)
    ]  # the default CFG with the blank negative a request gets, then none; batches largest first
    cached = plan(((32, 32),), 3, 1.0, "fast", "/loras/a.safetensors")  # CFG 1: one kind; a cache: 6 steps
    assert [(p.n, p.steps, lo) for p, lo in cached] == [
        (2, 6, ()),
        (1, 6, ()),
        (2, 6, (("/loras/a.safetensors", 1.0),)),
        (1, 6, (("/loras/a.safetensors", 1.0),)),
    ]
    capped = plan(((32, 32),), 8, 4.0, None, None, cfg_batch=2)  # --max-cfg-batch 2: CFG batches 2 and 1
    assert [(p.cfg, p.n) for p, _ in capped] == [(4.0, 2), (4.0, 1), (1.0, 8), (1.0, 4), (1.0, 2), (1.0, 1)]


def test_sizes_are_parsed_and_checked():
    assert parse_sizes("1024x1024, 1328x1328,1024x1024") == ((1024, 1024), (1328, 1328))
    for bad in ("1024", "axb", ",", "1024x1024x3"):
        with pytest.raises(ValueError, match="--warm-up"):
            parse_sizes(bad)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert config_from_args(p.parse_args(["--warm-up", "64x32"])).warm_up == ((64, 32),)
    assert config_from_args(p.parse_args([])).warm_up == ()
    with pytest.raises(SystemExit, match="WIDTHxHEIGHT"):
        config_from_args(p.parse_args(["--warm-up", "big"]))


def test_a_size_a_request_could_not_ask_for_is_refused(pipe):
    with pytest.raises(ConfigureError, match="multiples of 16; nearest: 992x992 or 1008x1008"):
        create_app(pipe, ServerConfig(warm_up=((1000, 1000),)))
    with pytest.raises(ConfigureError, match="128x128: width and height must be in 16..64"):
        create_app(
            pipe, ServerConfig(warm_up=((128, 128),), limits=ServerConfig().limits.__class__(max_side=64))
        )


def test_the_server_warms_every_shape_then_serves(pipe):
    rec = Recorder(pipe)
    with running(rec, max_batch=2, warm_up=((32, 32), (48, 48))) as (base, _):
        _wait(lambda: httpx.get(base + "/health").json().get("warm_up", {}).get("done"))
        w = httpx.get(base + "/health").json()["warm_up"]
        warm = list(rec.calls)
        r = httpx.post(base + G, json={"prompt": "a cat", "size": "32x32", "steps": 1}, timeout=60)
    cfg = pipe.defaults["true_cfg_scale"]
    assert cfg > 1 and w["of"] == w["batches"] == len(warm) == 8 and w["failed"] == 0, (w, warm)
    want = [(s, s, b, c, c > 1, None, 1) for s in (48, 32) for c in (cfg, 1.0) for b in (2, 1)]
    assert warm == want
    assert r.status_code == 200 and len(rec.calls) == len(warm) + 1  # then it serves


def test_per_row_loras_warm_with_and_without_an_adapter(tmp_path):
    tiny = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    tiny.progress_bar = False
    save_file(_lora(1, 4), tmp_path / "b.safetensors")
    save_file(_lora(2, 4), tmp_path / "a.safetensors")
    rec = Recorder(tiny)
    with running(rec, max_batch=1, warm_up=((32, 32),), lora_dir=str(tmp_path), row_loras=2) as (base, _):
        _wait(lambda: httpx.get(base + "/health").json().get("warm_up", {}).get("done"))
        w = httpx.get(base + "/health").json()["warm_up"]
    assert w["failed"] == 0 and [c[5] for c in rec.calls] == [[0], [1]] * (
        2 if tiny.defaults["true_cfg_scale"] > 1 else 1
    )
    assert list(tiny.row_loras.resident) == ["a"]  # the first adapter by name
