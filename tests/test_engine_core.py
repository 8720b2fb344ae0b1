"""The engine core's seams on CPU: options + configure, the plain denoise core, the step context
and the block-runner seam, the attention wrapper, graph keys per runner variant, per-call OOM."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from qwenfast import QwenImagePipeline
from qwenfast.errors import ConfigureError, OptionsError
from qwenfast.options import EngineOptions
from qwenfast.pipeline import sampling as S
from qwenfast.runtime.attention import attention, wrap_attention
from qwenfast.runtime.blocks import BlockRunner, StepContext

from .conftest import assert_close_finite

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"
KW = dict(height=48, width=32, num_inference_steps=3, output_type="np")


@pytest.fixture(scope="module")
def pipe():
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ options


def test_options_are_frozen_validated_and_read_from_the_environment(monkeypatch):
    o = EngineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.fp8 = True
    for bad in (dict(offload="disk"), dict(oom="retry"), dict(batched_cfg="yes"), dict(kernels="cuda"),
                dict(cuda_graphs=1), dict(offload_budget=0), dict(offload_budget="8"), dict(graph_slots=0),
                dict(graph_slots=True), dict(graph_slots=2.0)):  # fmt: skip
        with pytest.raises(OptionsError):
            EngineOptions(**bad)
    with pytest.raises(OptionsError, match="unknown engine option"):
        o.replace(graphs=False)
    monkeypatch.setenv("QWENFAST_CUDA_GRAPHS", "0")
    monkeypatch.setenv("QWENFAST_KERNELS", "torch")
    e = EngineOptions.from_env()
    assert e.cuda_graphs is False and e.kernels == "torch"
    assert EngineOptions.from_env(cuda_graphs=True).cuda_graphs is True  # explicit beats the environment


def test_pipeline_options_are_read_only_and_configure_rebuilds(pipe):
    with pytest.raises(AttributeError):
        pipe.options = EngineOptions()
    base = pipe(["a red circle"], negative_prompt=" ", true_cfg_scale=2.0, generator=_gen(1), **KW).images
    try:
        new = pipe.configure(fused=False, batched_cfg=False)
        assert pipe.options is new and new.fused is False and pipe.transformer.fused is False
        got = pipe(["a red circle"], negative_prompt=" ", true_cfg_scale=2.0, generator=_gen(1), **KW).images
        assert_close_finite(got, base, atol=1e-5)  # how it runs, not what it computes
    finally:
        pipe.configure(fused=True, batched_cfg="auto")
    with pytest.raises(OptionsError):
        pipe.configure(offload="disk")
    assert pipe.options == EngineOptions.from_env()  # a refused change changes nothing


def test_graph_slots_bound_the_graph_lru(pipe):
    """`graph_slots` is the transformer graphs' LRU size: configure resizes it, dropping the least recently
    used graphs first (stand-in entries: capturing needs CUDA)."""
    g = pipe._graphs
    try:
        pipe.configure(graph_slots=3)
        assert g.max_graphs == 3
        g.graphs.update((k, ("graph", k)) for k in "abc")
        g.graphs.move_to_end("a")  # used last
        pipe.configure(graph_slots=1)
        assert g.max_graphs == 1 and list(g.graphs) == ["a"]
    finally:
        g.graphs.clear()
        pipe.configure(graph_slots=EngineOptions().graph_slots)
    assert g.max_graphs == 8


def test_one_way_changes_are_refused_with_advice():
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, offload="model")
    with pytest.raises(ConfigureError, match="load the model again"):
        p.configure(offload="none")
    p.configure(offload="blocks")
    # graphs stay an option: a captured forward holds the streamed blocks' copies (with the table's rows)
    assert p.options.offload == "blocks" and p.options.cuda_graphs is True
    runner = p.transformer.block_runner
    assert p._block_streamer.order and runner.can_graph(True) and not runner.graph_safe
    from qwenfast.options import check_transition  # fp8 -> bf16 (checked without FP8 hardware)

    with pytest.raises(ConfigureError, match="FP8 cannot"):
        check_transition(EngineOptions(fp8=True), EngineOptions(fp8=False))


# ------------------------------------------------------------------------------------ denoise core


def test_the_free_denoise_core_is_the_pipeline(pipe):
    """Calling sampling.denoise with the transformer as `forward` gives the pipeline's latents (the
    pipeline's modulation table off: its shared rows differ from a batch's GEMM by ~2e-6 in fp32)."""
    pipe.configure(modulation_cache=0)
    try:
        want = pipe(["a blue square", "x"], negative_prompt=" ", true_cfg_scale=3.0, generator=_gen(2),
                    **{**KW, "output_type": "latent"}).images  # fmt: skip
    finally:
        pipe.configure(modulation_cache=EngineOptions().modulation_cache)
    h, w = S.latent_hw(48, 32)
    x = S.pack_latents(torch.randn((2, 1, 16, h, w), generator=_gen(2))[:, 0])
    cond = S.TextCond(*pipe.encode_prompt(["a blue square", "x"]))
    uncond = S.TextCond(*pipe.encode_prompt([" ", " "]))
    sig = S.get_sigmas(pipe.scheduler_config, 3, x.shape[1])

    def forward(x, emb, mask, t, img_shapes, step):
        return pipe.transformer(x, emb, mask, t, img_shapes, step=step)

    got = S.denoise(forward, x, sig, [(1, h // 2, w // 2)], cond, uncond, 3.0)
    assert_close_finite(got, want, rtol=0, atol=1e-6)


class Recording(BlockRunner):
    def __init__(self):
        self.steps = []

    def run(self, blocks, call, img, txt, step):
        self.steps.append(step)
        return super().run(blocks, call, img, txt, step)


def test_step_context_reaches_the_block_runner(pipe):
    rec = Recording()
    pipe.transformer.block_runner = rec
    try:
        pipe.configure(batched_cfg=False)
        pipe("a red star", negative_prompt="blurry", true_cfg_scale=2.0, generator=_gen(3), **KW)
        sig = S.get_sigmas(pipe.scheduler_config, 3, (48 // 16) * (32 // 16)).tolist()
        assert [(s.step, s.steps, s.branch) for s in rec.steps] == [
            (i, 3, b) for i in range(3) for b in ("cond", "uncond")
        ]
        assert [s.sigma for s in rec.steps[::2]] == pytest.approx(sig[:3], abs=0)
        rec.steps.clear()
        pipe.configure(batched_cfg=True)
        pipe("a red star", negative_prompt="blurry", true_cfg_scale=2.0, generator=_gen(3), **KW)
        assert [s.branch for s in rec.steps] == ["both"] * 3
    finally:
        pipe.transformer.block_runner = BlockRunner()
        pipe.configure(batched_cfg="auto")


class SkipLast(BlockRunner):
    def run(self, blocks, call, img, txt, step):
        return super().run(list(blocks)[:-1], call, img, txt, step)


def test_the_runner_owns_the_block_loop(pipe):
    base = pipe("a red star", generator=_gen(4), true_cfg_scale=1.0, **KW).images
    try:
        pipe.transformer.block_runner = Recording()  # runs every block: same image
        same = pipe("a red star", generator=_gen(4), true_cfg_scale=1.0, **KW).images
        pipe.transformer.block_runner = SkipLast()
        skipped = pipe("a red star", generator=_gen(4), true_cfg_scale=1.0, **KW).images
    finally:
        pipe.transformer.block_runner = BlockRunner()
    assert_close_finite(same, base)
    assert np.abs(skipped - base).max() > 1e-3  # the runner decides what runs


def test_attention_wrapper_sees_every_call_and_can_reshape():
    q, k, v = (torch.randn(2, 4, 7, 8) for _ in range(3))
    want = attention(q, k, v)
    seen = []

    def by_head_halves(inner, q, k, v, mask):  # what a head-parallel layout does around the kernel
        seen.append(q.shape)
        outs = [inner(q[:, i : i + 2], k[:, i : i + 2], v[:, i : i + 2], mask) for i in (0, 2)]
        return torch.cat(outs, dim=1)

    with wrap_attention(by_head_halves):
        got = attention(q, k, v)
    assert_close_finite(got, want, rtol=1e-6, atol=1e-6)
    assert seen == [(2, 4, 7, 8)]
    attention(q, k, v)
    assert len(seen) == 1  # unwrapped again after the block


def test_graph_keys_per_runner_variant(monkeypatch):
    """A runner whose steps differ gets one captured graph per variant."""
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    class Alternating(BlockRunner):
        def variant(self, step):
            return "full" if step is None or step.step % 2 == 0 else "cached"

    model = torch.nn.Identity()
    model.block_runner = Alternating()
    runner = CudaGraphRunner(model)
    keys = []
    monkeypatch.setattr(runner, "_run", lambda key, fn, inputs: keys.append(key) or inputs[0])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.zeros(1, 4, 64)
    for i in range(4):
        runner(x, x, None, x, [(1, 2, 2)], step=StepContext(i, 4, 1.0))
    assert len(set(keys)) == 2 and keys[0] == keys[2] and keys[1] == keys[3]
    assert {k[-1][1] for k in keys} == {"full", "cached"} and {k[-1][0] for k in keys} == {model.block_runner}
    # another runner (another step-cache preset) with the same variants: graphs of its own (the key
    # holds the runner whose buffers a graph reads), so switching back replays the first one's
    first = model.block_runner
    model.block_runner = Alternating()
    runner(x, x, None, x, [(1, 2, 2)], step=StepContext(0, 4, 1.0))
    assert keys[-1] != keys[0] and keys[-1][-1][1] == "full"
    model.block_runner = first
    runner(x, x, None, x, [(1, 2, 2)], step=StepContext(0, 4, 1.0))
    assert keys[-1] == keys[0]
    # the model's graph tag (per-row LoRAs: whether a row uses one) keys graphs of their own
    model.graph_tag = ("row-loras", True)
    runner(x, x, None, x, [(1, 2, 2)], step=StepContext(0, 4, 1.0))
    assert keys[-1] != keys[0] and keys[-1][-1] == keys[0][-1]


# ------------------------------------------------------------------------------------------- OOM


def test_an_oom_is_handled_per_call(pipe):
    """A split call leaves nothing switched on: the next call runs the whole batch at once."""
    sizes = []
    real = type(pipe.transformer).forward

    def tight(module, *a, **k):
        sizes.append(a[0].shape[0])
        if a[0].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(module, *a, **k)

    before = pipe.options
    pipe.transformer.forward = tight.__get__(pipe.transformer)
    try:
        out = pipe(["a", "b"], generator=[_gen(5), _gen(6)], true_cfg_scale=1.0, **KW)
    finally:
        del pipe.transformer.forward
    assert out.info["oom_backoff"] and pipe.options == before and pipe.offload == "none"
    sizes.clear()
    pipe.transformer.forward = lambda *a, **k: (sizes.append(a[0].shape[0]), real(pipe.transformer, *a, **k))[
        1
    ]
    try:
        again = pipe(["a", "b"], generator=[_gen(5), _gen(6)], true_cfg_scale=1.0, **KW)
    finally:
        del pipe.transformer.forward
    assert set(sizes) == {2} and "oom_backoff" not in again.info
    assert_close_finite(again.images, out.images, atol=1e-5)


def test_oom_raise_policy(pipe):
    def always(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    pipe.configure(oom="raise")
    pipe.transformer.forward = always
    try:
        with pytest.raises(torch.OutOfMemoryError):
            pipe(["a", "b"], generator=[_gen(5), _gen(6)], true_cfg_scale=1.0, **KW)
    finally:
        del pipe.transformer.forward
        pipe.configure(oom="backoff")


def test_server_uses_only_the_public_pipeline_api():
    """qwenfast/server imports nothing from runtime/ and no latent packing helpers."""
    import ast

    bad = []
    for f in (Path(__file__).resolve().parent.parent / "qwenfast" / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module
                names = {a.name for a in node.names}
                if (
                    "runtime" in mod.split(".")
                    or mod.endswith("sampling")
                    or names & {"sampling", "scheduler"}
                ):
                    bad.append(f"{f.name}:{node.lineno} from {'.' * node.level}{mod} import {sorted(names)}")
    assert not bad, bad
