"""Runtime memory features on CPU: OOM back-off (injected OOMs), offload modes, memory planner.

OOMs are injected by replacing a forward with one that raises `torch.OutOfMemoryError` above a
batch size; the results of the split batch must equal the unsplit ones (same noise, per image).
Offload runs its real code path with the CPU as "device" (plain copies, no streams): images must
equal the non-offloaded pipeline's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from qwenfast import EngineOptions, QwenImagePipeline
from qwenfast.runtime import oom
from qwenfast.runtime.memory import Calibration, MemoryPlanner, ModelSizes, default_budget
from qwenfast.runtime.offload import BlockStreamer

from .conftest import assert_close_finite

TINY = (
    Path(__file__).resolve().parent / "assets" / "tiny-random"
)  # not the default: it may change
SIZE = dict(height=64, width=48, num_inference_steps=2, output_type="np")


@pytest.fixture(scope="module")
def pipe_():
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    p.progress_bar = False
    return p


@pytest.fixture
def pipe(pipe_):
    """The module's pipeline, with every per-test tweak undone."""
    yield pipe_
    for obj in (pipe_.transformer, pipe_.vae):
        obj.__dict__.pop("forward", None)
        obj.__dict__.pop("_decode_tile", None)
    pipe_.vae.tiling = "auto"
    pipe_.configure(oom="backoff", batched_cfg="auto")


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _oom_above(module, limit, counter=None):
    """Make module's forward raise OOM when its input batch is larger than `limit`."""
    real = type(module).forward

    def forward(*a, **k):
        x = a[0] if a else next(iter(k.values()))
        if counter is not None:
            counter.append(x.shape[0])
        if x.shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected, batch {x.shape[0]})")
        return real(module, *a, **k)

    module.forward = forward


PROMPTS = ["a red circle", "two blue squares on a green field, long prompt", "x"]


def test_split_batch_equals_unsplit(pipe, monkeypatch):
    pipe.configure(batched_cfg=True)  # one batch-2 CFG forward even with a padding mask
    want = pipe(PROMPTS, negative_prompt=" ", true_cfg_scale=3.0, generator=_gens(3), **SIZE).images
    seen = []
    _oom_above(pipe.transformer, 2, seen)  # batched CFG: batch 6 -> OOM, 2 prompts (4 rows) -> OOM, 1 fits
    out = pipe(PROMPTS, negative_prompt=" ", true_cfg_scale=3.0, generator=_gens(3), **SIZE)
    assert out.images.shape == want.shape == (3, 64, 48, 3)
    assert np.isfinite(out.images).all()
    assert_close_finite(out.images, want, atol=1e-4)
    assert out.info["oom_backoff"][0].startswith("batch of 3 ran out of memory")
    assert {6, 4, 2} <= set(seen)  # CFG rows: 3 images -> chunks of 2 (OOM) -> chunks of 1
    assert any("chunks of 1" in e for e in out.info["oom_backoff"])


def test_split_with_one_generator_and_images_per_prompt(pipe):
    """One generator for the whole batch: noise is drawn once for all images, so splits do not change it."""
    kw = dict(num_images_per_prompt=2, generator=torch.Generator().manual_seed(3), true_cfg_scale=1.0, **SIZE)
    want = pipe(PROMPTS[:2], **kw).images
    kw["generator"] = torch.Generator().manual_seed(3)
    _oom_above(pipe.transformer, 1)
    out = pipe(PROMPTS[:2], **kw)
    assert len(out.info["oom_backoff"]) >= 2
    assert_close_finite(out.images, want, atol=1e-4)


def test_pil_and_latent_outputs_merge(pipe):
    """Chunks of a split batch are merged back in order: image i is prompt i's, for PIL and latents."""
    kw = dict(SIZE, true_cfg_scale=1.0)
    want = {t: pipe(PROMPTS, generator=_gens(3), **{**kw, "output_type": t}).images for t in ("pil", "latent")}
    _oom_above(pipe.transformer, 1)
    got = {t: pipe(PROMPTS, generator=_gens(3), **{**kw, "output_type": t}) for t in ("pil", "latent")}
    assert all(g.info["oom_backoff"] for g in got.values())  # the batch was split
    pil = [np.asarray(im, dtype=int) for im in got["pil"].images]
    ref = [np.asarray(im, dtype=int) for im in want["pil"]]
    assert len(pil) == 3
    for i in range(3):
        assert np.abs(pil[i] - ref[i]).max() <= 1, i  # 8-bit rounding of 1e-4 differences at most
        for j in range(3):
            if j != i:  # every image differs from the others: a wrong order cannot pass
                assert np.abs(pil[i] - ref[j]).max() > 10, (i, j)
    assert_close_finite(got["latent"].images, want["latent"], rtol=0, atol=1e-4)


def test_vae_oom_splits_then_tiles(pipe):
    vae = pipe.vae
    z = torch.randn(3, 16, 8, 6)
    vae.tiling = False
    want = vae.decode(z)
    real = vae._decode_tile
    calls = []

    def tile(x):  # OOM for any batch > 1 and for any untiled 64x48 pass
        calls.append(tuple(x.shape))
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(x)

    vae._decode_tile = tile
    events = []
    got = oom.vae_decode(vae, z, events)
    assert_close_finite(got, want, atol=1e-5, rtol=0)
    assert vae.tiling is False and any("chunks of 1" in e for e in events)

    def small_only(x):
        if x.shape[2] * x.shape[3] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(x)

    vae._decode_tile = small_only
    vae.tile_sample_min, vae.tile_sample_stride = 32, 24
    try:
        events = []
        got = oom.vae_decode(vae, z[:1], events)
        assert got.shape == (1, 3, 64, 48) and torch.isfinite(got).all()
        assert any("VAE tiling" in e for e in events) and vae.tiling is False
        assert vae.untiled_oom is None  # tiling=False was asked: nothing learnt for "auto"
        vae.tiling = "auto"  # (on the CPU "auto" never tiles by itself: only what an OOM taught it)
        events = []
        first = oom.vae_decode(vae, z[:1], events)
        assert any("VAE tiling" in e for e in events) and vae.untiled_oom == 64 * 48
        calls.clear()
        vae._decode_tile = lambda x: (calls.append(tuple(x.shape)), small_only(x))[1]
        events = []
        assert torch.equal(oom.vae_decode(vae, z[:1], events), first)
        assert not events and max(h * w for *_, h, w in calls) <= 16  # tiled without trying untiled
        pipe.configure(oom="raise")  # memory laid out anew: untiled may fit again
        assert vae.untiled_oom is None
        pipe.configure(oom="backoff")
    finally:
        vae.tile_sample_min, vae.tile_sample_stride, vae.tiling, vae.untiled_oom = 256, 192, "auto", None
        vae._decode_tile = real


def test_oom_everywhere_gives_a_clear_error_and_the_process_lives(pipe):
    def always(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    pipe.transformer.forward = always
    with pytest.raises(oom.GenerationOutOfMemory, match="size 1 after every fallback"):
        pipe(PROMPTS[:2], generator=_gens(2), true_cfg_scale=1.0, **SIZE)
    pipe.transformer.__dict__.pop("forward")
    assert pipe("ok", generator=_gens(1), true_cfg_scale=1.0, **SIZE).images.shape == (1, 64, 48, 3)


def test_other_errors_are_not_swallowed(pipe):
    def broken(*a, **k):
        raise ValueError("not memory")

    pipe.transformer.forward = broken
    with pytest.raises(ValueError, match="not memory"):
        pipe(PROMPTS, generator=_gens(3), **SIZE)


def test_run_in_chunks_halves_and_keeps_done_work():
    done = []

    def fn(i, j):
        if j - i > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        done.append((i, j))
        return list(range(i, j))

    parts = oom.run_in_chunks(fn, 7)
    assert [x for p in parts for x in p] == list(range(7))
    assert done == [(0, 2), (2, 4), (4, 6), (6, 7)]


# ---------------------------------------------------------------------------------------------- offload


def test_offload_modes_equal_no_offload():
    kw = dict(negative_prompt=" ", true_cfg_scale=2.0, **SIZE)
    base = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    base.progress_bar = False
    want = base(PROMPTS[:2], generator=_gens(2), **kw).images
    base.configure(batched_cfg=True)  # what "auto" does while blocks stream (the prompts need a mask)
    want_batched = base(PROMPTS[:2], generator=_gens(2), **kw).images
    for mode in ("model", "blocks"):
        p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, offload=mode)
        p.progress_bar = False
        got = p(PROMPTS[:2], generator=_gens(2), **kw).images
        assert_close_finite(got, want if mode == "model" else want_batched)
        assert p.offload == mode
        te_stream = p.text_encoder.layer_streamer  # the text encoder's layers stream too
        assert te_stream.copies >= len(te_stream.blocks)
        w = next(te_stream.blocks[-1].parameters())
        assert any(w.data_ptr() == v.data_ptr() for v in te_stream.host_views[-1])  # back on the host
    streamer = p._block_streamer
    runner = p.transformer.block_runner  # blocks stream: graphs hold the copies, fenced by the graph runner
    assert streamer.copies > 0 and runner.can_graph(True) and not runner.graph_safe
    blk = p.transformer.transformer_blocks[0]
    w = blk.attn.to_qkv.weight  # (the modulation Linears are not streamed: the modulation table serves them)
    assert any(w.data_ptr() == v.data_ptr() for v in streamer.host_views[0])  # back on the host copy
    with pytest.raises(RuntimeError, match="already 'blocks'"):
        p.enable_offload("model")
    with pytest.raises(ValueError, match="offload must be one of"):
        p.enable_offload("disk")


class _Blk(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("shift", torch.randn(d))

    def forward(self, x):
        return torch.tanh(self.lin(x)) + self.shift


def _chain(blocks, x):
    for b in blocks:
        x = b(x)
    return x


@pytest.mark.parametrize("n,ring", [(3, 2), (4, 2), (5, 3), (1, 2)])
def test_block_streamer_odd_counts(n, ring):
    """Odd block counts put the last block and the next forward's block 0 in the same slot."""
    torch.manual_seed(n)
    blocks = nn.ModuleList([_Blk(8) for _ in range(n)])
    x = torch.randn(2, 8)

    def run():
        return _chain(blocks, x)

    want = run()
    s = BlockStreamer(blocks, "cpu", ring=ring)
    for _ in range(3):
        assert_close_finite(run(), want, rtol=0, atol=0)
    assert s.copies >= n


# ---------------------------------------------------------------------------------------------- planner


def test_planner_monotonic_and_batch_choice():
    pl = MemoryPlanner(ModelSizes.qwen_image(), Calibration())
    sizes = [512, 768, 1024, 1328, 2048]
    peaks = [pl.predict(s, s, 1).peak for s in sizes]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    for s in (512, 1024):
        by_b = [pl.predict(s, s, b).peak for b in range(1, 8)]
        assert by_b == sorted(by_b) and len(set(by_b)) == len(by_b)
    budget = pl.predict(1024, 1024, 3).peak + 1
    assert pl.max_batch(1024, 1024, budget=budget) == 3
    assert pl.max_batch(1024, 1024, budget=pl.predict(1024, 1024, 3).peak - 1) == 2
    assert pl.max_batch(1024, 1024, budget=10 * 2**20) == 0
    assert pl.max_batch(512, 512, budget=2**62, limit=5) == 5
    # full-size bf16 weights alone are ~57 GiB; offload lowers what stays resident
    none, model, blocks = (pl.predict(1024, 1024, 1, offload=m) for m in ("none", "model", "blocks"))
    assert 55e9 < none.resident < 60e9  # 40.9 GB transformer + 16.6 GB text encoder + VAE
    assert none.peak > model.peak > blocks.peak
    assert blocks.peak < 24 * 2**30
    assert pl.predict(1024, 1024, 1, cfg=False).phases["denoise"] < none.phases["denoise"]
    with pytest.raises(ValueError):
        pl.predict(1024, 1024, 0)


def test_planner_from_pipeline_and_calibration_file(pipe_, tmp_path):
    pl = MemoryPlanner.from_pipeline(pipe_)
    assert (
        pl.sizes.num_blocks == len(pipe_.transformer.transformer_blocks)
        and pl.sizes.transformer > 0
        and pl.sizes.vae > 0
    )
    c = Calibration(transformer=11.0, source="test")
    c.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == c
    assert Calibration.load(tmp_path / "missing.json") == Calibration()
    assert default_budget("cpu") > 2**60


def test_graph_capture_oom_is_raised_not_swallowed(monkeypatch):
    """An OOM while capturing must reach the OOM back-off; graphs stay enabled for smaller batches."""
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner(torch.nn.Identity())

    def capture(*a):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(runner, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    x = torch.zeros(1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.raises(torch.OutOfMemoryError):
        runner(x, x, None, x, [(1, 1, 1)])
    assert runner.enabled


@pytest.mark.parametrize("n,resident,ring", [(6, [0, 2, 3, 5], 2), (5, [4], 2), (4, [0, 1, 2, 3], 2), (7, [1, 3], 3)])
def test_block_streamer_with_resident_blocks(n, resident, ring):
    """Resident blocks stay on the device and are never copied; only the others stream."""
    torch.manual_seed(n)
    blocks = nn.ModuleList([_Blk(8) for _ in range(n)])
    x = torch.randn(2, 8)

    def run():
        return _chain(blocks, x)

    want = run()
    s = BlockStreamer(blocks, "cpu", ring=ring, resident=resident)
    streamed = n - len(resident)
    for k in range(3):
        assert_close_finite(run(), want, rtol=0, atol=0)
        assert s.copies <= (k + 1) * streamed + 1  # each streamed block once per pass (+ a prefetch)
    assert s.copies >= streamed and all(not s.layout[i] for i in resident)


def test_spread_and_planner_resident_blocks():
    from qwenfast.runtime.offload import spread

    assert spread(60, 0) == [] and spread(6, 3) == [1, 3, 5] and spread(4, 9) == [0, 1, 2, 3]
    assert len(spread(60, 17)) == 17
    pl = MemoryPlanner(ModelSizes.qwen_image(), Calibration())
    kw = dict(offload="blocks", cfg=False)
    for gib in (12, 16, 24, 32):
        k = pl.resident_blocks(gib * 2**30, 1024, 1024, **kw)
        assert 0 <= k < 60
        assert pl.predict(1024, 1024, 1, resident_blocks=k, **kw).peak <= gib * 2**30
        assert pl.predict(1024, 1024, 1, resident_blocks=k + 1, **kw).peak > gib * 2**30
    assert pl.resident_blocks(2**40, 1024, 1024, **kw) == 60 and pl.resident_blocks(1, 1024, 1024, **kw) == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_offload_blocks_with_a_budget_equals_resident(fp8):
    """The budget decides how many blocks stay resident (the planner's count for the model's default
    size); images equal the resident model's either way, FP8 included (FP8 buffers stream like weights)."""
    from qwenfast.runtime.memory import GiB

    kw = dict(negative_prompt=" ", true_cfg_scale=2.0, **SIZE)
    base = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, fp8=fp8)
    base.progress_bar = False
    want = base(PROMPTS[:1], generator=_gens(1), **kw).images
    n = len(base.transformer.transformer_blocks)
    for budget, resident in ((1e-6, 0), (64.0, n)):  # nothing fits / everything fits
        p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, fp8=fp8, offload="blocks",
                                              options=EngineOptions(offload_budget=budget))  # fmt: skip
        p.progress_bar = False
        s = p._block_streamer
        d = p.defaults
        assert len(s.resident) == resident == MemoryPlanner.from_pipeline(p).resident_blocks(
            int(0.9 * budget * GiB), d["height"], d["width"], cfg=True, dtype=torch.float32)
        # fp32 within 1e-5: a streamed block's weights sit in a differently aligned buffer, and CPU
        # GEMMs pick kernels by alignment (a batch of 1 shows ~1e-6)
        assert_close_finite(p(PROMPTS[:1], generator=_gens(1), **kw).images, want, rtol=0, atol=1e-5)
        assert (s.copies > 0) == (resident < n)
    p.configure(offload_budget=1e-6)  # planned again: everything streams now
    assert not p._block_streamer.resident and p.transformer.block_runner.streamer is p._block_streamer
    assert_close_finite(p(PROMPTS[:1], generator=_gens(1), **kw).images, want, rtol=0, atol=1e-5)


def test_block_streamer_set_resident_both_ways():
    """A re-planned budget moves streamed blocks to the device and back; results never change."""
    torch.manual_seed(9)
    blocks = nn.ModuleList([_Blk(8) for _ in range(5)])
    x = torch.randn(2, 8)

    def run():
        return _chain(blocks, x)

    want = run()
    s = BlockStreamer(blocks, "cpu", ring=2)
    for resident in ([1, 3], [0, 1, 2, 3, 4], [], [4]):
        s.set_resident(resident)
        c0 = s.copies
        for _ in range(2):
            assert_close_finite(run(), want, rtol=0, atol=0)
        assert sorted(s.resident) == resident and s.copies - c0 <= 2 * (5 - len(resident)) + 1
    s2 = BlockStreamer(blocks, "cpu", ring=2, resident=[0])
    with pytest.raises(ValueError, match="resident from the start"):
        s2.set_resident([])


@pytest.mark.parametrize("budget", [1e-6, 64.0])
def test_text_encoder_layers_take_what_the_blocks_leave(budget):
    """offload="blocks": once every transformer block fits, the planner keeps text-encoder layers
    resident with the rest of the budget (they stream for every new prompt otherwise)."""
    from qwenfast.runtime.memory import GiB

    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, offload="blocks",
                                          options=EngineOptions(offload_budget=budget))  # fmt: skip
    p.progress_bar = False
    te = p.text_encoder.layer_streamer
    pl, d = MemoryPlanner.from_pipeline(p), p.defaults
    kw = dict(cfg=True, dtype=torch.float32, modulation_on_host=True)
    n = len(p.transformer.transformer_blocks)
    want = pl.te_resident_layers(int(0.9 * budget * GiB), d["height"], d["width"], resident_blocks=n, **kw)
    assert len(te.resident) == (want if len(p._block_streamer.resident) == n else 0)
    assert (len(te.resident) == len(te.blocks)) == (budget > 1)
    base = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    base.progress_bar = False
    kw2 = dict(negative_prompt=" ", true_cfg_scale=2.0, **SIZE)
    assert_close_finite(p(PROMPTS[:1], generator=_gens(1), **kw2).images,
                               base(PROMPTS[:1], generator=_gens(1), **kw2).images, rtol=0, atol=1e-5)  # fmt: skip
    # a text-only encode leaves the token embedding and the LM head on the host (rows looked up there)
    parts = p.text_encoder.host_parts()
    assert any("embed_tokens" in h for h in parts) and any("lm_head" in h for h in parts)
    emb = p.text_encoder.model.get_input_embeddings().weight
    assert pl.sizes.te_embed >= emb.numel() * emb.element_size() and pl.text_encoder_moved_in() < (
        pl.sizes.text_encoder - pl.sizes.te_blocks * pl.sizes.te_block - pl.sizes.te_vision)
    small = pl.predict(1024, 1024, 1, offload="blocks", resident_blocks=n, te_resident_layers=0, **kw).peak
    assert pl.predict(1024, 1024, 1, offload="blocks", resident_blocks=n, te_resident_layers=2, **kw).peak == \
        small + 2 * pl.sizes.te_block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a parameter's data cannot move between CPU and meta)")
def test_block_streamer_bring_puts_on_host_parts_back():
    """`on_host` parts stay out of the streamed bytes and in (pinned) host memory; `bring` points them
    at device copies for the duration and back at the very host tensors after (no device copy kept)."""
    torch.manual_seed(3)
    blocks = nn.ModuleList([_Blk(8) for _ in range(3)])
    s = BlockStreamer(blocks, "cuda", ring=2, hooks=False, on_host=[b.lin for b in blocks])
    w = blocks[1].lin.weight
    host = w.data
    assert w.device.type == "cpu" and w.is_pinned() and all(item[1] != "weight" for item in s.layout[1])
    with s.bring(blocks[1].lin):
        assert w.device.type == "cuda" and blocks[1].lin.bias.device.type == "cuda"
    assert w.device.type == "cpu" and w.data_ptr() == host.data_ptr()
