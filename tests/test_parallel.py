"""Multi-GPU layouts on CPU processes over gloo: CFG-parallel and Ulysses sequence parallel give the
one-process pixels (fp32, 1e-5) for square and odd token counts, text-to-image and edit, CFG on and
off; a failing rank ends the run with one error, no hang."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

from qwenfast.runtime.parallel import ParallelConfig, split_sizes
from qwenfast.testing.parallel import run_parallel

from .conftest import assert_close_finite

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def six_heads(tmp_path_factory):
    """A tiny text-to-image model with 6 heads (ulysses = 2 and 3 divide it) and 3 blocks."""
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("par") / "t2i-6h"
    build_tiny_pipeline(path, seed=3, heads=6, transformer_layers=3)
    return path


@pytest.fixture(scope="module")
def edit_model(tmp_path_factory):
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("par") / "edit-plus"
    build_tiny_pipeline(path, seed=4, heads=2, edit="edit-plus", zero_cond_t=True)
    return path


def _one(model, call):
    from qwenfast.pipeline.auto import from_pretrained

    pipe = from_pretrained(model, device="cpu", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(call)
    kw["generator"] = [torch.Generator().manual_seed(s) for s in kw.pop("seeds")]
    return pipe(**kw, output_type="np").images


T2I_CFG = dict(prompt=["a red circle", "two blue squares at the top"], negative_prompt=" ", true_cfg_scale=3.0,
               num_inference_steps=3, seeds=[1, 2])  # fmt: skip


def test_layouts_and_splits():
    assert ParallelConfig.parse("cfg=2,ulysses=2") == ParallelConfig(2, 2)
    assert ParallelConfig.parse("ulysses=3").world == 3
    for bad in ("cfg=3", "ulysses=0", "tp=2", ""):
        with pytest.raises(ValueError):
            ParallelConfig.parse(bad)
    assert split_sizes(6889, 2) == [3445, 3444] and sum(split_sizes(13, 3)) == 13


def test_cfg_rank_trims_its_text_once_per_mask(monkeypatch):
    """cfg=2 gives each rank its rows without the shared right padding; the mask is read on the host
    once per mask tensor (not once per step), and a new or changed mask is read again."""
    import qwenfast.runtime.attention as A
    from qwenfast.runtime.parallel import ParallelForward

    par = ParallelForward(lambda *a, **k: None, groups=None)
    reads, real = [], A.trim_padding
    monkeypatch.setattr(A, "trim_padding", lambda *a: reads.append(1) or real(*a))
    emb = torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    e, m = par._trim(emb, mask, slice(0, 1))
    assert e.shape == (1, 3, 4) and m is None and torch.equal(e, emb[:1, :3])
    e, m = par._trim(emb, mask, slice(1, 2))
    assert e.shape == (1, 5, 4) and m is None
    for _ in range(3):  # the next steps: same mask, same rows, no host read
        assert par._trim(emb, mask, slice(1, 2))[0].shape == (1, 5, 4)
    assert len(reads) == 2
    both, bm = par._trim(emb, mask, slice(0, 2))
    assert both.shape == (2, 5, 4) and torch.equal(bm, mask[:, :5])
    mask[1, 5] = 1  # in place: a new version, read again
    assert par._trim(emb, mask, slice(1, 2))[0].shape == (1, 6, 4)
    other = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert par._trim(emb, other, slice(0, 1))[0].shape == (1, 2, 4)
    assert par._trim(emb, None, slice(1, 2))[0].shape == (1, 6, 4)


@pytest.mark.parametrize("layout,world,size", [
    ("ulysses=2", 2, (64, 48)),     # 4 x 3 = 12 image tokens: even
    ("ulysses=3", 3, (80, 48)),     # 5 x 3 = 15 over 3
    ("ulysses=2", 2, (80, 48)),     # 15 over 2: uneven chunks
    ("cfg=2", 2, (64, 48)),
    ("cfg=2,ulysses=2", 4, (80, 48)),
])  # fmt: skip
def test_text_to_image_equals_one_process(six_heads, tmp_path, layout, world, size):
    call = dict(T2I_CFG, height=size[0], width=size[1])
    want = _one(six_heads, call)
    got = run_parallel(six_heads, layout, call, tmp_path / "out.npy", world)
    assert_close_finite(got, want, atol=1e-5, rtol=0)
    import json

    # every rank fills its modulation table (runtime/modulation.py) for the schedule: all blocks' GEMVs, once
    assert json.loads((tmp_path / "out.json").read_text()) == {"core": "ParallelForward", "world": world,
                                                                "exchange": "collective",
                                                                "modulated_blocks": [0, 1, 2]}  # fmt: skip
    assert np.abs(want[0] - want[1]).max() > 1e-2  # the two prompts' images differ: rows were not mixed


@pytest.mark.parametrize("layout,world", [("ulysses=2", 2), ("ulysses=3", 3)])
def test_modulations_split_over_ranks_without_the_table(six_heads, tmp_path, layout, world):
    """With the modulation table off, each forward's modulation GEMVs are split over the sequence
    ranks (`parallel.split_over_ranks`): rank 0 runs blocks 0, G, 2G, ... only."""
    import json

    call = dict(T2I_CFG, height=80, width=48)
    got = run_parallel(six_heads, layout, call, tmp_path / "out.npy", world, options={"modulation_cache": 0})
    assert_close_finite(got, _one(six_heads, call), atol=1e-5, rtol=0)
    G = ParallelConfig.parse(layout).ulysses
    assert json.loads((tmp_path / "out.json").read_text())["modulated_blocks"] == list(range(0, 3, G))


@pytest.mark.parametrize("chunks", ["1", "2"])  # 6 heads / 3 ranks = 2 heads each: 2 chunks pipelines them
def test_ulysses_without_cfg(six_heads, tmp_path, monkeypatch, chunks):
    monkeypatch.setenv("QWENFAST_ULYSSES_CHUNKS", chunks)  # the spawned ranks inherit it
    call = dict(prompt=["a red circle"], num_inference_steps=2, true_cfg_scale=1.0, seeds=[5], height=48, width=80)
    assert_close_finite(run_parallel(six_heads, "ulysses=3", call, tmp_path / "o.npy", 3), _one(six_heads, call),
                               atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize("layout,world,size,interp", [
    ("ulysses=2", 2, (80, 48), False),
    ("ulysses=3", 3, (80, 48), False),
    ("cfg=2,ulysses=2", 4, (64, 48), False),
    ("ulysses=2", 2, (48, 48), True),  # the Triton copy kernel (interpreter) across the processes
])  # fmt: skip
def test_peer_exchange_equals_one_process(six_heads, tmp_path, monkeypatch, layout, world, size, interp):
    """The peer-memory Ulysses exchange (shared-memory files on CPU, NVLink on GPUs) gives the
    one-process pixels, as the collective one does."""
    import json

    call = dict(T2I_CFG, height=size[0], width=size[1], num_inference_steps=2)
    want = _one(six_heads, call)
    monkeypatch.setenv("QWENFAST_ULYSSES_EXCHANGE", "peer")  # the spawned ranks inherit these
    if interp:  # set after this process ran its own Triton-less reference
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("QWENFAST_KERNELS", "triton")
    got = run_parallel(six_heads, layout, call, tmp_path / "out.npy", world)
    assert_close_finite(got, want, atol=1e-5, rtol=0)
    assert json.loads((tmp_path / "out.json").read_text())["exchange"] == "peer"


def test_edit_with_reference_tokens_equals_one_process(edit_model, tmp_path, monkeypatch):
    """Edit-2511 style (zero_cond_t): the shard boundary falls inside the noise or the reference tokens."""
    img = (np.random.default_rng(0).random((40, 56, 3)) * 255).astype(np.uint8)
    call = dict(image=img, prompt=["make it red"], negative_prompt=" ", true_cfg_scale=2.0, num_inference_steps=2,
                seeds=[6], height=48, width=64)  # fmt: skip
    want = _one(edit_model, call)
    for layout, world, exchange in (("ulysses=2", 2, "collective"), ("cfg=2", 2, "collective"),
                                    ("ulysses=2", 2, "peer")):  # fmt: skip
        monkeypatch.setenv("QWENFAST_ULYSSES_EXCHANGE", exchange)
        got = run_parallel(edit_model, layout, call, tmp_path / f"{world}.npy", world)
        assert_close_finite(got, want, atol=1e-5, rtol=0)


def test_cfg_parallel_without_cfg_is_refused(six_heads, tmp_path):
    call = dict(prompt=["a red circle"], num_inference_steps=1, true_cfg_scale=1.0, seeds=[5], height=32, width=32)
    with pytest.raises(Exception, match="no CFG"):
        run_parallel(six_heads, "cfg=2", call, tmp_path / "o.npy", 2)


HANG_S = 300  # a hang guard, not a timing: a good run takes seconds even on a loaded CPU


@contextlib.contextmanager
def _spawned_processes(monkeypatch):
    """Yields the process contexts of every `torch.multiprocessing.start_processes` (what launch.spawn
    starts), so a test can look at how each rank ended. Hang guard: launch.spawn has no timeout and a
    rank left waiting on a dead peer's collective is not ended by gloo's timeout (seen: a spawn that
    joined every rank in turn hung for good), so after HANG_S s a watchdog SIGKILLs the ranks, and the
    test fails saying so."""
    import threading

    import torch.multiprocessing as mp

    real, contexts, hung = mp.start_processes, [], threading.Event()

    def start(*a, **k):
        contexts.append(real(*a, **k))
        return contexts[-1]

    def kill_all():
        hung.set()
        for ctx in contexts:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()

    monkeypatch.setattr(mp, "start_processes", start)
    watchdog = threading.Timer(HANG_S, kill_all)
    watchdog.start()
    try:
        yield contexts
    finally:
        watchdog.cancel()
        assert not hung.is_set(), f"the parallel run hung: its ranks were killed after {HANG_S} s"


def _assert_others_were_ended(ctx, failed: int) -> None:
    """Every rank but `failed` has exited, ended by spawn's clean-up (SIGTERM) or by its own error on the
    lost peer, never by a timeout: the other rank was ended, not left waiting in a collective."""
    import os
    import pickle
    import signal

    for i, p in enumerate(ctx.processes):
        assert p.exitcode is not None, f"rank {i} is still running"
        if i == failed or p.exitcode == -signal.SIGTERM:
            continue
        trace = ""
        if os.path.exists(ctx.error_files[i]):
            with open(ctx.error_files[i], "rb") as f:
                trace = pickle.load(f)
        assert trace and not re.search(r"timed? ?out", trace, re.I), (i, p.exitcode, trace[-800:])


def test_a_failing_rank_ends_the_run(six_heads, tmp_path, monkeypatch):
    call = dict(T2I_CFG, height=32, width=32)
    with _spawned_processes(monkeypatch) as contexts, \
            pytest.raises(Exception, match="process 1 failed: RuntimeError: rank 1 failed on purpose"):  # fmt: skip
        run_parallel(six_heads, "ulysses=2", call, tmp_path / "o.npy", 2, fail_rank=1)
    (ctx,) = contexts
    assert ctx.processes[1].exitcode == 1
    _assert_others_were_ended(ctx, failed=1)


def test_a_killed_rank_ends_the_run(six_heads, tmp_path, monkeypatch):
    """A rank SIGKILLed mid-denoise (the others waiting in its collective) ends the run with one error
    naming the signal; the others were ended, not left to time out."""
    import signal

    from qwenfast.errors import ParallelError

    call = dict(T2I_CFG, height=32, width=32)
    with _spawned_processes(monkeypatch) as contexts, pytest.raises(ParallelError, match="process 1 was killed by SIGKILL"):
        run_parallel(six_heads, "ulysses=2", call, tmp_path / "o.npy", 2, fail_rank=1, fail_how="kill")
    (ctx,) = contexts
    assert ctx.processes[1].exitcode == -signal.SIGKILL
    _assert_others_were_ended(ctx, failed=1)


def test_cli_parallel_writes_the_one_process_image(tmp_path, capsys):
    """`qwenfast generate --device cpu --parallel ...` starts the ranks itself; rank 0 writes the PNG."""
    from PIL import Image

    from qwenfast.cli import main

    args = ["generate", "a small red circle at the top left, blue background", "--device", "cpu", "--seed", "3",
            "--steps", "4", "--quiet"]  # fmt: skip
    assert main([*args, "-o", str(tmp_path / "one.png")]) == 0
    assert main([*args, "--parallel", "ulysses=3", "-o", str(tmp_path / "par.png")]) == 0  # the demo has 3 heads
    one = np.asarray(Image.open(tmp_path / "one.png")).astype(int)
    par = Image.open(tmp_path / "par.png")
    assert par.text["parallel"] == "ulysses=3"
    assert np.abs(np.asarray(par).astype(int) - one).max() <= 1  # fp32: at most one 8-bit level
    assert main([*args, "--parallel", "ulysses=2", "-o", str(tmp_path / "bad.png")]) == 2
    assert "must divide the model's 3 attention heads" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()

