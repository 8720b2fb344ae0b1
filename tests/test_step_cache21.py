"""The step cache (runtime/cache.py) on Qwen-Image-2.1 (CPU, fp32, a tiny random 4-block 2.1 model).

With the prefix KV cache, step 0 ("extract") runs every block and is not shown to the step cache;
the cached steps 1..n-1 are the cache's run (numbered 0..n-2). Checked here: an all-full policy is
the uncached pipeline bitwise; a cached step is its definition (the middle blocks replaced by the
residual of the last full step, + the Taylor term), KV cache on and off; the presets skip exactly
the steps and block evaluations the policy predicts and change the image a little; nothing leaks
between requests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwenfast.runtime.blocks import BlockRunner
from qwenfast.runtime.cache import CACHE_PRESETS as PRESETS
from qwenfast.runtime.cache import CachePolicy, StepCacheRunner

from .conftest import assert_close_finite
from .test_step_cache import assert_gapped_run_is_its_definition

pytest.importorskip("diffusers")

LAYERS = 4
KW = dict(output_resolution=64, output_type="np")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    import qwenfast
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    path = tmp_path_factory.mktemp("c21") / "tiny21"
    build_tiny21_pipeline(path, seed=1, transformer_layers=LAYERS)
    p = qwenfast.from_pretrained(path, device="cpu", dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture
def fresh(pipe):
    yield pipe
    pipe.configure(cache=None)


def _image(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((40, 72, 3)) * 255).astype(np.uint8)


CALLS = {
    "t2i-cfg": dict(prompt=["a red circle", "two cats under a tall tree"], negative_prompt=["blurry", "dark"],
                    true_cfg_scale=2.5),  # fmt: skip
    "edit": dict(prompt="make it red", image=_image()),
}


def _run(pipe, call: dict, seed: int = 3, **kw) -> np.ndarray:
    p = call["prompt"] if call["prompt"] is not None else list(call["prompt_embeds"])
    n = len(p) if isinstance(p, list) else 1
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    return pipe(**call, generator=gens, **KW, **kw).images


class Counting(StepCacheRunner):
    """A step cache that counts the block evaluations and records each forward's (step, blocks run)."""

    def __init__(self, policy: CachePolicy):
        super().__init__(policy)
        self.blocks, self.log = 0, []

    def run(self, blocks, call, img, txt, step):
        before = self.blocks

        def counted(i, block, img, txt):
            self.blocks += 1
            return call(i, block, img, txt)

        out = super().run(blocks, counted, img, txt, step)
        self.log.append((None if step is None else step.step, self.blocks - before))
        return out


class Scripted(BlockRunner):
    """Full steps that record the middle residual (block `first` to the end); at the runner step
    `at`, the middle replaced by `res(recorded)`: a cached step by its definition."""

    def __init__(self, first: int, at: int, res=None):
        self.first, self.at, self.res, self.recorded = first, at, res, {}

    def run(self, blocks, call, img, txt, step):
        for i in range(self.first):
            img, txt = call(i, blocks[i], img, txt)
        key = (None if step is None else step.step, step.branch if step is not None else None)
        if step is not None and step.step == self.at and self.res is not None:
            r = self.res(self.recorded, step.branch)
            return img + r[0], txt + r[1]
        i0, t0 = img, txt
        for i in range(self.first, len(blocks)):
            img, txt = call(i, blocks[i], img, txt)
        self.recorded[key] = (img - i0, txt - t0)
        return img, txt


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("kv", [True, False])
def test_all_full_policy_is_the_uncached_pipeline_bitwise(fresh, name, kv):
    want = _run(fresh, CALLS[name], num_inference_steps=4, use_kv_cache=kv)
    fresh.configure(cache=CachePolicy(kind="static", every=1, taylor=1))
    got = _run(fresh, CALLS[name], num_inference_steps=4, use_kv_cache=kv)
    assert_close_finite(got, want)
    s = fresh.block_runner.stats
    branches = 2 if name == "t2i-cfg" else 1
    assert s == {"full": branches * (3 if kv else 4), "cached": 0}  # the extract steps are not the cache's


@pytest.mark.parametrize("taylor", [0, 1])
@pytest.mark.parametrize("kv", [True, False])
def test_a_cached_step_is_its_definition(fresh, taylor, kv):
    """Policy: runner steps 0 and 1 full, 2 cached (= denoise step 3 with the KV cache, 2 without): the last."""
    call, steps = CALLS["t2i-cfg"], 4 if kv else 3
    policy = CachePolicy(kind="static", first=1, last=0, warmup=1, tail=0, every=100, taylor=taylor)
    fresh.configure(cache=policy)
    got = _run(fresh, call, num_inference_steps=steps, use_kv_cache=kv)
    assert fresh.block_runner.stats == {"full": 2 * 2, "cached": 2}  # 2 CFG branches

    def res(rec, branch):  # the residual of the last full step, extrapolated as the policy says (1 step)
        r1, r0 = rec[(1, branch)], rec[(0, branch)]
        return r1 if not taylor else tuple(a + (a - b) * 1.0 for a, b in zip(r1, r0))

    probe = Scripted(1, at=2)
    fresh.transformer.block_runner = probe  # the test's own runner, in place of the cache's
    full = _run(fresh, call, num_inference_steps=steps, use_kv_cache=kv)
    recorded = probe.recorded
    if kv:  # the extract step is not the runner's: it came with no step, every block ran
        assert (None, None) in recorded
        assert recorded[(0, "cond")][0].shape[1] < recorded[(None, None)][0].shape[1]  # target tokens only
    fresh.transformer.block_runner = Scripted(1, at=2, res=lambda rec, b: res(recorded, b))
    want = _run(fresh, call, num_inference_steps=steps, use_kv_cache=kv)
    assert_close_finite(got, want, atol=1e-6, rtol=0)
    assert np.abs(got - full).max() > 1e-3  # the cached step is not a full one


@pytest.mark.parametrize("name,kv,call", [("fast", True, "t2i-cfg"), ("fast", False, "edit"), ("balanced", False, "t2i-cfg"),
                                          ("every-3-last-1", True, "t2i-cfg"), ("every-4-reuse", True, "edit"),
                                          ("adaptive-taylor", True, "t2i-cfg")])  # fmt: skip
def test_a_cached_step_is_its_definition_with_gaps_over_1(fresh, name, kv, call):
    """12 steps of the cache's run (13 denoising steps with the KV cache: its extract step comes first),
    the presets' gaps between full steps: the step cache equals `CacheByDefinition` (test_step_cache.py)."""
    steps = 13 if kv else 12

    def run(_):
        return _run(fresh, CALLS[call], num_inference_steps=steps, use_kv_cache=kv)

    assert_gapped_run_is_its_definition(fresh, run, name, 12)


@pytest.mark.parametrize("preset", ["balanced", "fast"])
@pytest.mark.parametrize("kv", [True, False])
def test_presets_skip_what_the_policy_predicts_and_stay_close(fresh, preset, kv):
    steps, call = 20, CALLS["t2i-cfg"]
    want = _run(fresh, call, num_inference_steps=steps, use_kv_cache=kv)
    other_seed = _run(fresh, call, seed=11, num_inference_steps=steps, use_kv_cache=kv)
    p = PRESETS[preset]
    fresh.configure(cache=preset)
    runner = Counting(p)
    fresh.transformer.block_runner = runner
    got = _run(fresh, call, num_inference_steps=steps, use_kv_cache=kv)
    run = steps - 1 if kv else steps  # the cache's run: the steps after the extract step with the KV cache
    cached = sum(not p.static_full(i, run) for i in range(run))
    assert runner.stats == {"full": 2 * (run - cached), "cached": 2 * cached}  # 2 CFG branches
    assert cached >= run // 2
    first_last = min(p.first, LAYERS) + p.last
    assert runner.blocks == 2 * ((steps - cached) * LAYERS + cached * first_last)  # fewer block evaluations
    assert [n for s, n in runner.log if s is not None and not p.static_full(s, run)] == [first_last] * 2 * cached
    d = np.abs(got - want)
    assert np.isfinite(got).all() and d.max() > 0
    assert d.mean() < 0.1 and d.mean() < 0.5 * np.abs(other_seed - want).mean()  # close, next to a new seed


def test_requests_never_share_a_cache(fresh):
    """warmup=1: the runner's first cached step follows one full step; it must read this request's
    residuals (restarted on the runner's step 0), not the previous request's."""
    fresh.configure(cache=CachePolicy(kind="static", warmup=1, tail=0, every=2, taylor=1))
    a = _run(fresh, CALLS["edit"], num_inference_steps=6)
    _run(fresh, {"prompt": "a blue square", "image": _image(5)}, seed=8, num_inference_steps=6)
    again = _run(fresh, CALLS["edit"], num_inference_steps=6)
    assert_close_finite(again, a)
    assert fresh.block_runner.stats["cached"] > 0


def test_cache_option_is_accepted_for_2_1(fresh):
    fresh.configure(cache="balanced")
    assert isinstance(fresh.block_runner, StepCacheRunner) and fresh.block_runner.policy is PRESETS["balanced"]
    fresh.configure(cache="off")
    assert type(fresh.block_runner) is BlockRunner


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("preset", ["fast", "balanced"])
def test_graph_and_eager_cached_paths_agree(tmp_path, preset):
    """Cached steps replayed as CUDA graphs (one per runner variant: first, full, cached) = eager."""
    import qwenfast
    from qwenfast.testing.tiny21 import build_tiny21_pipeline

    build_tiny21_pipeline(tmp_path / "m", seed=1, transformer_layers=LAYERS)
    p = qwenfast.from_pretrained(tmp_path / "m", device="cuda", dtype=torch.bfloat16, cache=preset)
    p.set_progress_bar_config(disable=True)
    # fixed prompt embeddings: cuda_graphs=False below also turns the text encoder's graph off, whose
    # bf16 states differ from the eager encode by rounding; this test is about the transformer's graphs
    c = CALLS["t2i-cfg"]
    with torch.no_grad():
        emb, mask, _ = p.text_encoder.encode(c["prompt"])
        nemb, nmask, _ = p.text_encoder.encode(c["negative_prompt"])
    call = dict(prompt=None, prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=nemb,
                negative_prompt_embeds_mask=nmask, true_cfg_scale=c["true_cfg_scale"])  # fmt: skip
    graphed = [_run(p, call, num_inference_steps=12) for _ in range(2)]  # capture, then replay
    assert {k[-1][1] for k in p._graphs.graphs} >= {"first", "full", "cached"}  # (runner, variant)
    p.configure(cuda_graphs=False)
    eager = _run(p, call, num_inference_steps=12)
    assert_close_finite(graphed[0], graphed[1])
    assert_close_finite(graphed[1], eager, atol=2e-3)
    p.configure(cache=None, cuda_graphs=True)
    assert np.abs(_run(p, call, num_inference_steps=12) - eager).max() > 0  # the cache was on above
