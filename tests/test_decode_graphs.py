"""CUDA graphs of a one-image VAE decode (runtime/cuda_graphs.py `DecodeGraphs`, used by the pipeline's
`decode_per_image` path) and the one capture stream every graph cache shares.

On a GPU: a replayed decode equals the eager decode bit for bit (same kernels, same shapes) at two
latent sizes, each capturing once; a replay allocates nothing beyond its output; weights that moved
are recaptured rather than read where they were; captures of two caches run on one stream (a stream per
capture left a cuBLAS workspace behind on each of PyTorch's pooled streams). On the CPU the pipeline's
decode goes eager and stays what it was, and the graph LRU drops the graphs of a step cache's old buffers.
"""

from __future__ import annotations

import pytest
import torch

from qwenfast.config import VAEConfig
from qwenfast.models.vae import QwenImageVAE
from qwenfast.runtime.cuda_graphs import CudaGraphRunner, DecodeGraphs, _GraphCache, capture_stream

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")


def _vae(device, seed=0):
    torch.manual_seed(seed)
    vae = QwenImageVAE(VAEConfig(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random gammas and biases: a dropped norm scale or bias would show
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return vae.to(device, torch.bfloat16)


@gpu
@torch.no_grad()
def test_replayed_decode_equals_eager_and_allocates_nothing_but_its_output():
    vae = _vae("cuda")
    owner = CudaGraphRunner(torch.nn.Identity())
    graphs = DecodeGraphs(vae, pool_of=owner)
    for h, w in [(6, 10), (9, 7), (6, 10)]:  # odd sizes; the first size again: its graph is kept
        z = torch.randn(1, 16, h, w, device="cuda", dtype=torch.bfloat16)
        want = vae.decode(z)
        out = graphs(z)
        assert torch.isfinite(out).all()
        assert torch.equal(out, want)
        z2 = torch.randn_like(z)  # a fresh input replays the same graph with its own values
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out2 = graphs(z2)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before <= out2.numel() * out2.element_size() + 2**20
        assert torch.equal(out2, vae.decode(z2))
        assert (out2 - out).abs().max() > 1e-2  # the input reaches the output
    assert graphs.captures == 2 and len(graphs.graphs) == 2
    assert graphs._pool is None and owner._pool is not None  # the transformer graphs' pool


@gpu
@torch.no_grad()
def test_decode_graphs_recapture_when_weights_move():
    vae = _vae("cuda", seed=3)
    graphs = DecodeGraphs(vae)
    z = torch.randn(1, 16, 5, 6, device="cuda", dtype=torch.bfloat16)
    graphs(z)
    n = graphs.captures
    with torch.no_grad():
        w = vae.decoder.conv_out.weight
        vae.decoder.conv_out.weight = torch.nn.Parameter(w.detach().clone() * 0.5)  # a new tensor
    out = graphs(z)
    assert graphs.captures == n + 1
    assert torch.equal(out, vae.decode(z))


@gpu
def test_captures_share_one_stream():
    assert capture_stream() is capture_stream()
    seen = []
    orig = torch.cuda.graph.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self.capture_stream)

    lin = torch.nn.Linear(8, 8).cuda()
    a, b = _GraphCache(), _GraphCache()  # (the shared capture path, under keys of its own)
    x = torch.randn(4, 8, device="cuda")
    torch.cuda.graph.__init__ = spy
    try:
        a._run(("a",), lin, (x,))
        b._run(("b",), lin, (x,))
        b._run(("c",), lin, (x[:2],))
    finally:
        torch.cuda.graph.__init__ = orig
    assert len(seen) == 3 and all(s == capture_stream() for s in seen)


@gpu
@torch.no_grad()
def test_pipeline_decodes_each_image_from_one_graph(tiny_t2i):
    from qwenfast import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_t2i[1], device="cuda", dtype=torch.bfloat16)
    pipe.configure(decode_per_image=True, cuda_graphs=True)
    h, w = 6, 10
    x = torch.randn(3, h // 2 * w // 2, 64, device="cuda", dtype=torch.bfloat16)
    got = pipe.decode_latents(x, h, w)
    pipe.configure(cuda_graphs=False)
    want = pipe.decode_latents(x, h, w)  # the same per-image decodes, eager
    assert torch.isfinite(got).all() and torch.equal(got, want)
    st = pipe.graph_stats()
    assert st["decode_captures"] == 1 and st["decode_resident"] == 0  # one shape; configure dropped it


@torch.no_grad()
def test_pipeline_decode_per_image_on_cpu_stays_eager(qf_t2i):
    import copy

    pipe = copy.copy(qf_t2i)
    pipe.configure(decode_per_image=True, cuda_graphs=True)
    h, w = 6, 8
    x = torch.randn(2, h // 2 * w // 2, 64, generator=torch.Generator().manual_seed(0))
    want = torch.cat([copy.copy(qf_t2i).decode_latents(x[i : i + 1], h, w) for i in range(2)])
    got = pipe.decode_latents(x, h, w)
    assert torch.equal(got, want) and pipe.graph_stats()["decode_captures"] == 0
    assert (got[0] - got[1]).abs().max() > 1e-3  # two different images, each its own


def test_stale_epoch_graphs_are_dropped_and_an_emptied_pool_forgotten():
    """CPU: the LRU's bookkeeping only (fake entries): a runner whose buffers were reallocated loses the
    graphs keyed on its old epoch, other runners' graphs stay; a cache left with no graph forgets its
    pool (PyTorch cannot capture into a pool whose graphs are all gone), also one it lent to decodes."""
    from qwenfast.runtime.blocks import BlockRunner

    g = CudaGraphRunner(torch.nn.Identity())
    a, b = BlockRunner(), BlockRunner()
    g._pool = "pool"
    for r, e, v in [(a, 0, 1), (a, 0, 2), (b, 0, 1)]:
        g.graphs[("shape", e, (r, v))] = "entry"
    assert g.drop_stale(a) == 0 and g.drop_stale(b) == 0  # first sight: nothing moved
    a.epoch = 1
    assert g.drop_stale(a) == 2 and list(g.graphs) == [("shape", 0, (b, 1))] and g._pool == "pool"
    assert g.drop_stale(a) == 0
    b.epoch = 3
    assert g.drop_stale(b) == 1 and not g.graphs and g._pool is None
    assert g.stale == 3  # counted (the serve benchmark's graphs_dropped_stale)
    d = DecodeGraphs(torch.nn.Identity(), pool_of=g)
    g._pool, d.graphs["k"] = "shared", "entry"
    d.clear()
    assert g._pool is None and not d.graphs
