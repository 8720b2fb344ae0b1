"""CUDA graphs over the block ring (runtime/offload.py `fence` / `capture` / `replayed`, runtime/blocks.py
StreamingBlockRunner): a streamed forward captured with its block copies in it replays with one launch.

On the CPU: what a captured forward copies (every block of a shared ring slot, once; a block alone in
its slot stays there) is what an eager forward copies after a fence, which is what a replay is credited;
and the planner holds the graph pool through the encode and decode. On a GPU: a 5-block transformer
streaming 3 or 4 blocks through a 2-slot ring, replayed from graphs, equals the resident eager forward
bit for bit, also with an eager forward between replays; the bytes a replay is credited are the bytes
the streamer's layout says it copies.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qwenfast.runtime.memory import Calibration, MemoryPlanner, ModelSizes
from qwenfast.runtime.offload import BlockStreamer

from .conftest import assert_close_finite


class _Blk(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


def _chain(blocks, x):
    for b in blocks:
        x = b(x)
    return x


@pytest.mark.parametrize(
    "n,resident,ring,shared",
    [(6, [0, 2], 2, [1, 3, 4, 5]), (5, [], 3, [0, 1, 3, 4]), (5, [0, 1, 2], 3, []), (3, [1], 2, [])],
)
def test_captured_forward_copies_what_a_replay_is_credited(n, resident, ring, shared):
    torch.manual_seed(n)
    blocks = nn.ModuleList([_Blk(8) for _ in range(n)])
    x = torch.randn(2, 8)
    want = _chain(blocks, x)
    s = BlockStreamer(blocks, "cpu", ring=ring, resident=resident)
    assert_close_finite(_chain(blocks, x), want, rtol=0, atol=0)  # eager: a warm-up before a capture
    per = {b: s.host[b].numel() for b in s.order}
    assert s.graph_bytes() == sum(per[b] for b in shared)
    solo = [b for b in s.order if b not in shared]
    s.fence()  # what the graph runner does before a capture or a replay
    assert sorted(b for b in s.in_slot if b is not None) == solo  # a block alone in its slot stays
    s.cyclic = False  # as inside a capture: no prefetch for the next forward
    c0, b0 = s.copies, s.bytes_in
    assert_close_finite(_chain(blocks, x), want, rtol=0, atol=0)
    s.cyclic = True
    assert (s.copies - c0, s.bytes_in - b0) == (len(shared), s.graph_bytes())
    c1, b1 = s.copies, s.bytes_in
    s.replayed()
    assert (s.copies - c1, s.bytes_in - b1) == (len(shared), s.graph_bytes())
    assert_close_finite(_chain(blocks, x), want, rtol=0, atol=0)  # eager again after a replay
    with s.capture():  # counts nothing (on a GPU the capture copies nothing; replays are counted)
        c2, _ = s.copies, s.bytes_in
        _chain(blocks, x)
        assert s.copies - c2 == len(shared) and not s.cyclic
    assert s.copies == c2 and s.cyclic


def test_planner_holds_the_graph_pool_through_encode_and_decode():
    pl = MemoryPlanner(ModelSizes.qwen_image(), Calibration())
    kw = dict(offload="blocks", cfg=False, resident_blocks=30, modulation_on_host=True)
    a, b = pl.predict(1024, 1024, 1, **kw), pl.predict(1024, 1024, 1, graph_pool=True, **kw)
    pool = a.phases["denoise"] - a.resident
    assert pool > 0 and b.phases["denoise"] == a.phases["denoise"]
    assert b.phases["encode"] - a.phases["encode"] == pool == b.phases["decode"] - a.phases["decode"]
    for gib in (8, 12, 16):
        budget = gib * 2**30
        k = pl.resident_blocks(budget, 1024, 1024, cfg=False, modulation_on_host=True)
        kg = pl.resident_blocks(budget, 1024, 1024, cfg=False, modulation_on_host=True, graph_pool=True)
        assert (
            kg <= k
            and pl.predict(1024, 1024, 1, **{**kw, "resident_blocks": kg}, graph_pool=True).peak <= budget
        )


def _model(layers: int):
    from qwenfast.config import TransformerConfig
    from qwenfast.models.transformer import QwenImageTransformer

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=layers, num_attention_heads=2, attention_head_dim=32, joint_attention_dim=48,
                            axes_dims_rope=(8, 12, 12))  # fmt: skip
    return QwenImageTransformer(cfg).eval().to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("resident", [[2], [1, 3]])
def test_streamed_forward_replayed_from_graphs_equals_resident(resident):
    from qwenfast.runtime.blocks import BlockRunner, StreamingBlockRunner
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    model = _model(5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 96, 64, generator=g).to("cuda", torch.bfloat16)
    txt = torch.randn(1, 7, 48, generator=g).to("cuda", torch.bfloat16)
    t, shapes = torch.tensor([0.6], device="cuda"), [(1, 8, 12)]
    with torch.no_grad():
        want = model(x, txt, None, t, shapes)
        s = BlockStreamer(model.blocks, "cuda", ring=2, hooks=False, resident=resident)
        model.set_block_runner(StreamingBlockRunner(s))
        assert s.graph_bytes() > 0  # 3 or 4 blocks take turns in 2 slots: the graph holds copies
        graphs = CudaGraphRunner(model)
        outs = []
        for k in range(5):  # warm-ups and capture, replays, an eager forward between replays
            if k == 3:
                outs.append(model(x, txt, None, t, shapes))
            b0 = s.bytes_in
            outs.append(graphs(x, txt, None, t, shapes))
            if k >= 1:
                assert s.bytes_in - b0 == s.graph_bytes()  # a replay is credited its copies
        assert graphs.graphs
        x2 = torch.randn_like(x)  # another input through the same graph
        got2 = graphs(x2, txt, None, t, shapes)
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out, want)
    s.set_resident(range(5))  # every block on the device again, run by the plain runner
    model.set_block_runner(BlockRunner())
    with torch.no_grad():
        want2 = model(x2, txt, None, t, shapes)
    assert torch.equal(got2, want2)
