"""Whole-pipeline pixels equal diffusers' QwenImagePipeline for the same seed (tiny random model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

CASES = {
    "no-cfg-square": dict(prompt="a red circle", height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0),
    "cfg-list-of-prompts": dict(prompt=["a red circle on the left", "blue"],
                                negative_prompt=["ugly", "a bad small square at the bottom"],
                                height=48, width=80, num_inference_steps=3, true_cfg_scale=4.0),  # fmt: skip
    "cfg-n-images-odd-size": dict(prompt="a cat", negative_prompt=" ", height=72, width=40, num_inference_steps=2,
                                  num_images_per_prompt=2),  # fmt: skip
    "truncated-sequence": dict(prompt="a big blue square on the left of a tiny green star", height=32, width=32,
                               num_inference_steps=2, true_cfg_scale=1.0, max_sequence_length=3),  # fmt: skip
}


TOL = 1e-3  # max abs pixel difference to diffusers (fp32, [0, 1] pixels)


def _other(text):
    """Another prompt of the same shape (str or list): what a pipeline that ignored its text would miss."""
    return [f"a yellow triangle at the bottom {i}" for i in range(len(text))] if isinstance(text, list) \
        else "a yellow triangle at the bottom"  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_pixels_match_diffusers(tiny_t2i, qf_t2i, case):
    ref, _ = tiny_t2i
    kw = CASES[case]
    with pytest.warns(UserWarning, match="multiples of 16") if kw["height"] % 16 else _nullcontext():
        b = qf_t2i(**kw, generator=torch.Generator().manual_seed(7), output_type="np").images
    a = ref(**kw, generator=torch.Generator().manual_seed(7), output_type="np").images
    assert a.shape == b.shape and b.dtype == np.float32
    assert np.isfinite(a).all() and np.isfinite(b).all() and b.std() > 0.05  # a real picture, not a constant
    assert np.abs(a - b).max() <= TOL
    # sensitivity: the text inputs move diffusers' pixels by far more than TOL, so matching it means
    # qwenfast used them (the tiny model is not too insensitive for this comparison to fail)
    moved = {"prompt": dict(kw, prompt=_other(kw["prompt"]))}
    if kw.get("negative_prompt") is not None and kw.get("true_cfg_scale", 4.0) > 1:
        moved["negative_prompt"] = dict(kw, negative_prompt=_other(kw["negative_prompt"]))
    for what, other in moved.items():
        c = ref(**other, generator=torch.Generator().manual_seed(7), output_type="np").images
        assert np.abs(c - a).max() >= 10 * TOL, what


def test_pil_output_and_explicit_latents(tiny_t2i, qf_t2i):
    ref, _ = tiny_t2i
    lat = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3))
    kw = dict(prompt="green star", height=32, width=128, num_inference_steps=2, true_cfg_scale=1.0)
    a = ref(**kw, latents=lat, output_type="pil").images[0]
    b = qf_t2i(**kw, latents=lat, output_type="pil").images[0]
    assert b.size == (128, 32) and b.mode == "RGB"
    assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1
    # sensitivity: other latents, or another prompt, move diffusers' 8-bit pixels by >= 10 levels
    for other in (dict(kw, latents=torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(4))),
                  dict(kw, prompt=_other(kw["prompt"]), latents=lat)):  # fmt: skip
        c = ref(**other, output_type="pil").images[0]
        assert np.abs(np.asarray(c, dtype=int) - np.asarray(a, dtype=int)).max() >= 10


def test_generator_list_and_seed_semantics(qf_t2i):
    kw = dict(prompt=["a", "b"], height=32, width=32, num_inference_steps=1, true_cfg_scale=1.0, output_type="np")
    one = qf_t2i(**kw, generator=torch.Generator().manual_seed(5)).images
    again = qf_t2i(**kw, generator=torch.Generator().manual_seed(5)).images
    other = qf_t2i(**kw, generator=torch.Generator().manual_seed(6)).images
    assert np.array_equal(one, again) and not np.array_equal(one, other)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert qf_t2i(**kw, generator=gens).images.shape == (2, 32, 32, 3)


def test_prompt_cache_makes_repeat_free(qf_t2i):
    te = qf_t2i.text_encoder
    te._cache.clear()
    calls = []
    orig = te._hidden
    te._hidden = lambda texts, drop: calls.append(len(texts)) or orig(texts, drop)
    try:
        qf_t2i.encode_prompt(["x y", "x y", "z"])
        qf_t2i.encode_prompt(["z"])
    finally:
        te._hidden = orig
    assert calls == [2]  # two distinct prompts encoded once, in one batch


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_batched_cfg_equals_separate_passes(qf_t2i):
    """One batch-2 forward (prompts of different token lengths, padded + masked) == two forwards."""
    kw = dict(prompt=["a big blue square on the left of a tiny green star", "red"], negative_prompt=["x", "blurry"],
              height=48, width=32, num_inference_steps=3, true_cfg_scale=3.0, output_type="np")  # fmt: skip
    old = qf_t2i.options.batched_cfg
    try:
        qf_t2i.configure(batched_cfg=False)
        sep = qf_t2i(**kw, generator=torch.Generator().manual_seed(2)).images
        qf_t2i.configure(batched_cfg=True)
        bat = qf_t2i(**kw, generator=torch.Generator().manual_seed(2)).images
    finally:
        qf_t2i.configure(batched_cfg=old)
    assert np.abs(sep - bat).max() < 1e-5


def test_batched_cfg_auto_batches_only_without_a_mask(qf_t2i):
    """"auto": one batch-2 forward when the prompts need no padding mask, two forwards otherwise."""
    sizes = []
    hook = qf_t2i.transformer.register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[0]))
    kw = dict(height=32, width=32, num_inference_steps=1, true_cfg_scale=3.0, output_type="latent")
    try:
        assert qf_t2i.options.batched_cfg == "auto"
        qf_t2i("red", negative_prompt="red", **kw)  # equal lengths: no mask
        assert sizes == [2]
        sizes.clear()
        qf_t2i("a big blue square on the left", negative_prompt="x", **kw)
        assert sizes == [1, 1]
    finally:
        hook.remove()


def test_join_text_mask_only_when_needed():
    from qwenfast.pipeline.text_to_image import join_text

    a, b = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    e, m = join_text(a, None, b, None)
    assert e.shape == (4, 5, 8) and m is None
    e, m = join_text(a, None, torch.randn(2, 3, 8), None)
    assert e.shape == (4, 5, 8) and m[2:, 3:].sum() == 0 and m[:2].all() and torch.equal(e[2:, 3:], torch.zeros(2, 2, 8))


def test_prompt_cache_off_gives_the_same_embeddings(qf_t2i):
    te = qf_t2i.text_encoder
    ref, _ = te.encode(["a red circle", "two blue squares", "a red circle"])
    old = te.cache_size
    te.cache_size, saved = 0, dict(te._cache)
    te._cache.clear()
    try:
        emb, _ = te.encode(["a red circle", "two blue squares", "a red circle"])
        assert len(te._cache) == 0
    finally:
        te.cache_size = old
        te._cache.update(saved)
    assert torch.equal(emb, ref)


def test_text_encoder_padded_causal_path_equals_the_masked_call():
    """The CUDA-graph path of the text encoder (ids right-padded to a bucket, no padding mask) gives
    the real tokens' states of the masked call; checked eagerly on CPU (the graph replays the same)."""
    from qwenfast.models.text_encoder import T2I_TEMPLATE, TextEncoder
    from qwenfast.pipeline.text_to_image import DEFAULT_MODEL
    from qwenfast.runtime.cuda_graphs import TextEncoderGraphs

    te = TextEncoder.from_pretrained(DEFAULT_MODEL / "text_encoder", DEFAULT_MODEL / "tokenizer", "cpu", torch.float32)
    texts = [T2I_TEMPLATE.format(p) for p in ("a red circle", "a large blue star at the top left, green background")]
    tok = te.tokenizer(texts, padding=True, return_tensors="pt")
    runner = TextEncoderGraphs(te.model.model.language_model, te.tokenizer.pad_token_id, bucket=16)
    assert runner.padded(tok.input_ids, tok.attention_mask).shape[1] % 16 == 0
    with torch.no_grad():
        want = te.model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True)
        got = runner(tok.input_ids, tok.attention_mask)
    m = tok.attention_mask.bool()
    assert torch.allclose(got[m], want.hidden_states[-1][m], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="right-padded"):
        runner(tok.input_ids.flip(1), tok.attention_mask.flip(1))


def test_real_rows_and_padding_from_host_lengths():
    """The encode path reads which rows are real from the tokenizer's host mask (no device sync):
    one run of ones (left or right padding) is a slice, any other mask a gather; the padding mask is
    None exactly when every length is the same."""
    from qwenfast.models.text_encoder import pad_embeddings, real_rows

    h = torch.randn(7, 3)
    for m in ([0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0, 1], [0] * 7):
        mask = torch.tensor(m, dtype=torch.bool)
        got = real_rows(h, mask)
        assert torch.equal(got, h[mask]) and (got.numel() == 0 or got.data_ptr() != h.data_ptr())
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    emb, mask = pad_embeddings([a, b])
    assert emb.shape == (2, 4, 3) and torch.equal(emb[1, :2], b) and not emb[1, 2:].any()
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    emb, mask = pad_embeddings([a, a.flip(0)])
    assert mask is None and torch.equal(emb[0], a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_text_encoder_cuda_graph_equals_eager_on_gpu():
    from qwenfast.models.text_encoder import TextEncoder
    from qwenfast.pipeline.text_to_image import DEFAULT_MODEL

    te = TextEncoder.from_pretrained(DEFAULT_MODEL / "text_encoder", DEFAULT_MODEL / "tokenizer", "cuda", torch.bfloat16)
    prompts = ["a red circle", "a large blue star at the top left, green background", " "]
    te.cuda_graphs = False
    want, wmask = te.encode(prompts)
    te.clear_cache()
    te.cuda_graphs = True
    for _ in range(2):  # capture, then replay
        te.clear_cache()
        got, gmask = te.encode(prompts)
        assert te._graphs and te._graphs.enabled and len(te._graphs.graphs) == 1
        assert torch.equal(wmask, gmask) and torch.isfinite(got).all()
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
