"""The modulation table (runtime/modulation.py): every block's modulation rows computed once per
timestep. Images equal computing them in every forward (fp32 within 1e-5: a batch of B rows shares
one GEMV's rows where the per-forward path runs an M=B GEMM), for text-to-image with batched and
separate CFG, Edit-2511's zero_cond_t, a LoRA on the modulation Linears (the table must be cleared),
offload="blocks" with the modulation weights in host memory, and the planner's accounting of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qwenfast import EngineOptions, QwenImagePipeline
from qwenfast.runtime.memory import Calibration, MemoryPlanner, ModelSizes
from qwenfast.runtime.modulation import ModulationTable, batch_rows

from .conftest import assert_close_finite

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"
KW = dict(height=64, width=48, num_inference_steps=3, output_type="np", negative_prompt=" ", true_cfg_scale=2.0)
PROMPTS = ["a red circle", "a blue square on grass"]
TOL = 1e-5


def _pipe(**opts) -> QwenImagePipeline:
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, options=EngineOptions(**opts))
    p.progress_bar = False
    return p


def _run(p, **kw) -> np.ndarray:
    gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    return p(PROMPTS, generator=gens, **{**KW, **kw}).images


@pytest.fixture(scope="module")
def pair():
    return _pipe(modulation_cache=0), _pipe()


@pytest.mark.parametrize("batched_cfg", [True, False])
def test_table_equals_per_forward_modulations(pair, batched_cfg):
    off, on = pair
    for p in pair:
        p.configure(batched_cfg=batched_cfg)
    want = _run(off)
    table = on.transformer.modulation_table
    assert off.transformer.modulation_table is None and table is not None
    table.clear()
    h0, m0 = table.hits, table.misses
    got = _run(on)
    assert_close_finite(got, want, rtol=0, atol=TOL)
    forwards = KW["num_inference_steps"] * (1 if batched_cfg else 2)
    # the schedule was filled before the loop (one miss per step), then every forward hit
    assert table.misses - m0 == KW["num_inference_steps"] == len(table)
    assert table.hits - h0 == forwards
    _run(on)  # the same schedule again: no new entry
    assert table.misses - m0 == KW["num_inference_steps"]


def test_forward_reads_the_table_and_weight_changes_clear_it(pair):
    """Sensitivity: a scaled entry moves the image far beyond the tolerance (the forward reads the
    table); `release_graphs()` and a LoRA change clear it, and a LoRA on the modulation Linears gives
    the per-forward path's image."""
    off, on = pair
    for p in pair:
        p.configure(batched_cfg="auto")
    want = _run(on)
    table = on.transformer.modulation_table
    for k in list(table.entries):
        table.entries[k] = table.entries[k] * 1.5
    moved = np.abs(_run(on) - want).max()
    assert moved > 10 * TOL, moved
    on.release_graphs()
    assert len(table) == 0
    assert_close_finite(_run(on), want, rtol=0, atol=0)

    g = torch.Generator().manual_seed(3)
    lora = {}
    for i, blk in enumerate(on.transformer.transformer_blocks):
        for name in ("img_mod", "txt_mod"):
            lin = getattr(blk, name)[1]
            lora[f"transformer_blocks.{i}.{name}.1.lora_A.weight"] = torch.randn(4, lin.in_features, generator=g) * 0.3
            lora[f"transformer_blocks.{i}.{name}.1.lora_B.weight"] = torch.randn(lin.out_features, 4, generator=g) * 0.3
    try:
        for p in pair:
            p.load_lora(dict(lora), name="mod")
        assert len(table) == 0  # cleared by the LoRA change
        with_lora = _run(off)
        assert np.abs(with_lora - want).max() > 10 * TOL  # the LoRA does change the modulations
        assert_close_finite(_run(on), with_lora, rtol=0, atol=TOL)
    finally:
        for p in pair:
            p.unload_lora()
    assert len(table) == 0
    assert_close_finite(_run(on), want, rtol=0, atol=0)


def test_zero_cond_t_edit_uses_a_t0_entry(tmp_path):
    from PIL import Image

    from qwenfast.pipeline.edit import QwenImageEditPipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    build_tiny_pipeline(tmp_path / "m", seed=0, edit="edit-plus", zero_cond_t=True)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    out = {}
    for n in (0, 8):
        p = QwenImageEditPipeline.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32,
                                                  options=EngineOptions(modulation_cache=n))  # fmt: skip
        p.progress_bar = False
        assert p.transformer.cfg.zero_cond_t
        out[n] = p([img], prompt="make it red", negative_prompt=" ", true_cfg_scale=3.0, num_inference_steps=2,
                   height=48, width=64, generator=torch.Generator().manual_seed(1), output_type="np").images  # fmt: skip
    table = p.transformer.modulation_table
    assert "t=0" in table and len(table) == 3
    assert_close_finite(out[8], out[0], rtol=0, atol=TOL)


@pytest.mark.parametrize("budget", [1e-6, 64.0])
def test_offload_blocks_keeps_modulation_weights_on_the_host(budget):
    """With a table, the streamer leaves the modulation Linears out of the streamed (and resident)
    bytes; images equal the resident pipeline's."""
    want = _run(_pipe())
    p = _pipe(offload="blocks", offload_budget=budget)
    s = p._block_streamer
    blocks = p.transformer.transformer_blocks
    mod_ids = {id(t) for b in blocks for m in (b.img_mod, b.txt_mod) for t in m.parameters()}
    assert s.held == mod_ids
    streamed = {id(item[0]._parameters[item[1]]) for items in s.layout for item in items if item[2]}
    assert not streamed & mod_ids and (streamed or budget > 1)
    # CUDA graphs (on by default) run only when no block streams and the table serves the modulations
    runner = p.transformer.block_runner  # graphs with the table's rows (streamed copies captured), not without
    assert p.options.cuda_graphs and runner.can_graph(True) and not runner.can_graph(False)
    assert_close_finite(_run(p), want, rtol=0, atol=TOL)
    # a forward outside the denoise core (no step: no table) brings them in through the runner
    tr = p.transformer
    x, emb = torch.randn(1, 12, 64), torch.randn(1, 5, tr.cfg.joint_attention_dim)
    t = torch.full((1,), 0.5)
    ref = _pipe(modulation_cache=0).transformer(x, emb, None, t, [(1, 4, 3)])
    assert_close_finite(tr(x, emb, None, t, [(1, 4, 3)]), ref, rtol=0, atol=TOL)


def test_planner_counts_modulation_on_host():
    pl = MemoryPlanner(ModelSizes.qwen_image(), Calibration())
    s = pl.sizes
    assert 0 < s.block_modulation < s.transformer_block
    a = pl.resident("blocks", resident_blocks=60)
    b = pl.resident("blocks", resident_blocks=60, modulation_on_host=True)
    assert a - b == (60 - 1) * s.block_modulation  # one block's come in for a table miss
    kw = dict(offload="blocks", cfg=False)
    for gib in (16, 24):
        k0 = pl.resident_blocks(gib * 2**30, 1024, 1024, **kw)
        k1 = pl.resident_blocks(gib * 2**30, 1024, 1024, modulation_on_host=True, **kw)
        assert k1 > k0
    p = _pipe()
    tr = p.transformer
    entry = len(tr.transformer_blocks) * 2 * 6 * tr.cfg.inner_dim * 4  # fp32
    assert p._modulation_table_bytes() == min(64, p.defaults["num_inference_steps"] + 1) * entry
    p.configure(modulation_cache=2)
    assert p._modulation_table_bytes() == 2 * entry
    p.configure(modulation_cache=0)
    assert p._modulation_table_bytes() == 0
    assert MemoryPlanner.from_pipeline(p).sizes.block_modulation == sum(
        t.numel() * t.element_size() for m in (p.transformer.transformer_blocks[0].img_mod,
                                               p.transformer.transformer_blocks[0].txt_mod) for t in m.parameters())


def test_table_lru_and_fill_computes_only_missing_entries():
    calls = []

    def compute(ts):
        calls.append([round(float(t), 4) for t in ts])
        return [torch.full((2, 2, 3), float(t)) for t in ts]

    tb = ModulationTable(max_entries=3)
    tb.fill([0.9, 0.5], [torch.tensor([0.9]), torch.tensor([0.5])], compute)
    tb.fill([0.9, 0.5, 0.2, 0.2], [torch.tensor([v]) for v in (0.9, 0.5, 0.2, 0.2)], compute)
    assert calls == [[0.9, 0.5], [0.2]] and tb.misses == 3
    assert abs(float(tb.get(0.9, torch.tensor([0.9]), compute)[0, 0, 0]) - 0.9) < 1e-6 and tb.hits == 1
    tb.get(0.1, torch.tensor([0.1]), compute)  # evicts the least recently used: 0.5
    assert list(tb.entries) == [0.2, 0.9, 0.1]
    with pytest.raises(ValueError, match="max_entries"):
        ModulationTable(0)
    e, z = torch.randn(4, 2, 6), torch.randn(4, 2, 6)
    rows = batch_rows(e, 3, z)  # (blocks, 3 img + 3 zero img + 3 txt, 6D)
    assert rows.shape == (4, 9, 6)
    assert torch.equal(rows[:, 0], e[:, 0]) and torch.equal(rows[:, 4], z[:, 0]) and torch.equal(rows[:, 8], e[:, 1])
    assert batch_rows(e, 1) is e  # batch 1: the entry's [img, txt] rows as they are, no copy
    assert torch.equal(batch_rows(e, 2)[:, 1], e[:, 0]) and torch.equal(batch_rows(e, 2)[:, 3], e[:, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_table_under_cuda_graphs_equals_eager():
    from qwenfast.testing.tiny import build_tiny_pipeline  # noqa: F401 - the same tiny model on the GPU

    p = QwenImagePipeline.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16)
    p.progress_bar = False
    g = _run(p)
    assert p._graphs.graphs  # replayed from graphs, the table's rows as graph inputs
    p.configure(cuda_graphs=False)
    assert_close_finite(_run(p), g, rtol=0, atol=1e-2)
    off = QwenImagePipeline.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16,
                                            options=EngineOptions(modulation_cache=0, cuda_graphs=False))  # fmt: skip
    off.progress_bar = False
    assert_close_finite(_run(off), g, rtol=0, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_with_every_block_resident_replays_graphs():
    """offload="blocks" under a budget that keeps every block: the forward is replayed from CUDA
    graphs (the modulation weights on the host are never read: the table serves them) and equals
    the eager resident pipeline, also for another schedule (same graph, other table rows) and after
    an eager forward in between; a budget that streams blocks drops the graphs and captures new ones
    that hold the blocks' copies."""
    ref = QwenImagePipeline.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16,
                                            options=EngineOptions(cuda_graphs=False))  # fmt: skip
    ref.progress_bar = False
    want, want2 = _run(ref), _run(ref, num_inference_steps=2)
    p = QwenImagePipeline.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16,
                                          options=EngineOptions(offload="blocks", offload_budget=64.0))  # fmt: skip
    p.progress_bar = False
    assert not p._block_streamer.order
    assert_close_finite(_run(p), want, rtol=0, atol=1e-2)
    assert p._graphs.graphs
    tr = p.transformer  # an eager forward (no step: no table, so no graph) between replays
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 12, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    emb = torch.randn(1, 5, tr.cfg.joint_attention_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.full((1,), 0.5, device="cuda")
    with torch.no_grad():
        assert_close_finite(tr(x, emb, None, t, [(1, 4, 3)]), ref.transformer(x, emb, None, t, [(1, 4, 3)]),
                                   rtol=0, atol=2e-2)  # fmt: skip
    assert_close_finite(_run(p, num_inference_steps=2), want2, rtol=0, atol=1e-2)
    p.configure(offload_budget=1e-6)  # every block streams: graphs dropped, captured again with the copies
    assert p._block_streamer.order and not p._graphs.graphs
    assert_close_finite(_run(p), want, rtol=0, atol=1e-2)
    assert p._graphs.graphs
    assert_close_finite(_run(p, num_inference_steps=2), want2, rtol=0, atol=1e-2)
