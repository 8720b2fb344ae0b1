"""Text padded to a bucket (`EngineOptions.text_bucket`) attended over by key lengths (`KeyLengths`:
joint order [image; text], no mask) gives what the unpadded text gives: the transformer's rows and the
pipeline's pixels; the pad tokens' values never matter. The FlashAttention-3 path on a GPU against the
masked reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenfast.options import EngineOptions, OptionsError
from qwenfast.pipeline.sampling import TextCond
from qwenfast.runtime.attention import KeyLengths, attention

from .conftest import assert_close_finite, rel_err
from .test_transformer import _inputs, _pair

TOL = 1e-5  # fp32


def test_key_lengths_mask_and_cpu_attention():
    lens = torch.tensor([5, 9, 1], dtype=torch.int32)
    keys = KeyLengths(lens, 9)
    m = keys.mask()
    assert m.shape == (3, 1, 1, 9) and m.dtype == torch.bool
    assert m.squeeze(1).squeeze(1).sum(1).tolist() == [5, 9, 1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 9, 16, generator=g) for _ in range(3))
    out = attention(q, k, v, keys)
    for b, n in enumerate(lens.tolist()):  # each row = attention over its first n keys alone
        want = F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        assert_close_finite(out[b : b + 1], want, atol=TOL, rtol=TOL)
    kl = KeyLengths.of_text(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]), 6)
    assert kl.lens.tolist() == [8, 9] and kl.total == 10


@pytest.mark.parametrize("fused", [True, False])
def test_bucketed_text_equals_unpadded(fused):
    _, ours = _pair()
    ours.set_fused(fused)
    shapes = [(1, 3, 5)]
    x, txt, t = _inputs(2, shapes, 11)
    with torch.no_grad():
        want = [
            ours(x[b : b + 1], txt[b : b + 1, : (11, 6)[b]], None, t[b : b + 1], shapes) for b in range(2)
        ]
        # row 0: 11 real tokens, row 1: 6; both padded to 16 with random junk (never attended to)
        junk = torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(3))
        padded = junk.clone()
        padded[0, :11], padded[1, :6] = txt[0], txt[1, :6]
        mask = torch.zeros(2, 16, dtype=torch.long)
        mask[0, :11], mask[1, :6] = 1, 1
        ours.set_key_lengths(True)
        try:
            got = ours(x, padded, mask, t, shapes)
            moved = txt.clone()
            moved[1, 2] += 1.0  # a real token of row 1: the text must matter
            padded2 = padded.clone()
            padded2[1, :6] = moved[1, :6]
            got2 = ours(x, padded2, mask, t, shapes)
        finally:
            ours.set_key_lengths(False)
    for b in range(2):
        assert_close_finite(got[b : b + 1], want[b], atol=TOL, rtol=TOL)
    assert rel_err(got2[1], got[1]) > 10 * TOL
    assert rel_err(got2[0], got[0]) < TOL


def test_text_cond_bucketed():
    c = TextCond(torch.randn(2, 11, 4), None)
    b = c.bucketed(8)
    assert b.emb.shape == (2, 16, 4) and b.mask.tolist() == [[1] * 11 + [0] * 5] * 2
    assert torch.equal(b.emb[:, :11], c.emb) and not b.emb[:, 11:].any()
    assert c.bucketed(0) is c and TextCond(torch.randn(1, 16, 4)).bucketed(8).mask is None


def test_pipeline_text_bucket_same_image_one_shape(qf_t2i):
    pipe = qf_t2i
    seen = []
    fwd = pipe.transformer.forward

    def spy(x, txt, *a, **kw):
        seen.append(txt.shape[1])
        return fwd(x, txt, *a, **kw)

    kw = dict(height=64, width=64, num_inference_steps=2, true_cfg_scale=2.0, negative_prompt="blurry",
              output_type="latent")  # fmt: skip
    prompts = ["a cat", "a watercolor painting of a lighthouse at dawn with gulls"]
    plain = [pipe(prompt=p, generator=torch.Generator().manual_seed(5), **kw).images for p in prompts]
    pipe.configure(text_bucket=64)
    try:
        pipe.transformer.forward = spy
        bucketed = [pipe(prompt=p, generator=torch.Generator().manual_seed(5), **kw).images for p in prompts]
    finally:
        pipe.transformer.forward = fwd
        pipe.configure(text_bucket=0)
    assert pipe.transformer.key_lengths is False
    for a, b in zip(bucketed, plain):
        assert_close_finite(a, b, atol=TOL, rtol=TOL)
    assert rel_err(plain[0], plain[1]) > 10 * TOL  # the prompts differ in the output
    assert set(seen) == {64}  # every prompt, cond and uncond, one text shape


def test_text_bucket_option_checks():
    with pytest.raises(OptionsError):
        EngineOptions(text_bucket=-1)
    with pytest.raises(OptionsError):
        EngineOptions(text_bucket=True)
    with pytest.raises(OptionsError):
        EngineOptions(text_bucket=64, parallel="cfg=2")
    assert EngineOptions(text_bucket=64).text_bucket == 64
    assert EngineOptions(text_bucket="auto", parallel="cfg=2").text_bucket == "auto"  # resolves to 0 there
    with pytest.raises(OptionsError):
        EngineOptions(text_bucket="always")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("S,lens", [(4224 + 64, [4224 + 31, 4224 + 64]), (1037, [900, 1037])])
def test_fa3_key_lengths_against_masked_reference(S, lens):
    from qwenfast.runtime.attention import _fa3, _fa3_key_lengths, fa3_runs

    if not fa3_runs(torch.device("cuda")) or _fa3(allow_fwd=True) is None:
        pytest.skip("FA3 not installed or not a Hopper GPU: key lengths run as a mask there")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, S, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views of (B, S, H, D)
    keys = KeyLengths(torch.tensor(lens, dtype=torch.int32, device="cuda"), S)
    k2, v2 = k.clone(), v.clone()
    # past a row's keys: weight exactly 0, so large values change nothing (they must be finite, as the
    # model's padding is: a kernel multiplies a tile's zero weights by what lies there, and 0 * NaN is NaN)
    k2[0, :, lens[0] :], v2[0, :, lens[0] :] = 1e4, -1e4
    out = _fa3_key_lengths(q, k2, v2, keys)
    assert out is not None and out.shape == q.shape
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keys.mask())
    assert not out.isnan().any()
    assert rel_err(out.float(), want) < 1e-2
    # and captured in a CUDA graph, replayed for other lengths
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _fa3_key_lengths(q, k, v, keys)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _fa3_key_lengths(q, k, v, keys)
    keys.lens.copy_(torch.tensor([lens[0] - 17, lens[1]], dtype=torch.int32))
    graph.replay()
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keys.mask())
    assert rel_err(static.float(), want) < 1e-2


def test_auto_batches_cfg_where_key_lengths_are_free(qf_t2i, monkeypatch):
    """batched_cfg="auto" keeps cond and uncond apart when they need a mask, except where padded text
    is attended by key lengths on FlashAttention-3 (no masked attention there)."""
    import qwenfast.pipeline.placement as placement

    pipe = qf_t2i
    assert pipe._cfg_batching() == "auto"
    pipe.configure(text_bucket=64)
    try:
        assert pipe._cfg_batching() == "auto"  # CPU: the key lengths become a mask
        monkeypatch.setattr(placement, "key_lengths_free", lambda device: True)
        assert pipe._cfg_batching() is True
        pipe.configure(batched_cfg=False)
        assert pipe._cfg_batching() is False  # an explicit choice stands
    finally:
        pipe.configure(text_bucket=0, batched_cfg="auto")
    assert pipe._cfg_batching() == "auto"
