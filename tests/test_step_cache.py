"""Step caching on CPU (runtime/cache.py): the static all-full policy is the uncached model bitwise; a
cached step is its definition (residual reuse / linear Taylor extrapolation); caches never leak
between batch rows, CFG branches or requests; presets through options, CLI and server."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qwenfast import QwenImagePipeline
from qwenfast.errors import OptionsError
from qwenfast.options import EngineOptions
from qwenfast.runtime.blocks import BlockRunner, StepContext
from qwenfast.runtime.cache import CACHE_PRESETS as PRESETS
from qwenfast.runtime.cache import HEADROOM, CachePolicy, StepCacheRunner

from .conftest import assert_close_finite

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"
KW = dict(height=48, width=32, num_inference_steps=8, output_type="np")


@pytest.fixture(scope="module")
def pipe():
    p = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture
def fresh(pipe):
    yield pipe
    pipe.configure(cache=None, batched_cfg="auto")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_static_all_full_equals_uncached_bitwise(fresh):
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **KW)
    want = fresh(["a red circle", "a blue square on the left"], generator=[_gen(1), _gen(2)], **kw).images
    fresh.configure(cache=CachePolicy(kind="static", every=1, taylor=1))
    got = fresh(["a red circle", "a blue square on the left"], generator=[_gen(1), _gen(2)], **kw).images
    assert_close_finite(got, want)
    assert fresh.block_runner.stats["cached"] == 0 and fresh.block_runner.stats["full"] > 0


class Probe(BlockRunner):
    """Records the residual the blocks first..len-last add (the definition of what a cache stores)."""

    def __init__(self, first, last):
        self.first, self.last, self.res = first, last, []

    def run(self, blocks, call, img, txt, step):
        n = len(blocks)
        for i in range(self.first):
            img, txt = call(i, blocks[i], img, txt)
        i0, t0 = img, txt
        for i in range(self.first, n - self.last):
            img, txt = call(i, blocks[i], img, txt)
        self.res.append((img - i0, txt - t0))
        for i in range(n - self.last, n):
            img, txt = call(i, blocks[i], img, txt)
        return img, txt


class Replace(BlockRunner):
    """first blocks, + a given middle residual, last blocks: a cached step by its definition."""

    def __init__(self, first, last, res):
        self.first, self.last, self.r = first, last, res

    def run(self, blocks, call, img, txt, step):
        n = len(blocks)
        for i in range(self.first):
            img, txt = call(i, blocks[i], img, txt)
        img, txt = img + self.r[0], txt + self.r[1]
        for i in range(n - self.last, n):
            img, txt = call(i, blocks[i], img, txt)
        return img, txt


@pytest.fixture(scope="module")
def demo_transformer():
    """The demo's 5-block transformer (the tiny random one has only 2 blocks)."""
    from qwenfast.loading.diffusers_folder import load_transformer
    from qwenfast.pipeline.common import DEFAULT_MODEL

    return load_transformer(DEFAULT_MODEL / "transformer", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("taylor", [0, 1])
@pytest.mark.parametrize("first,last", [(1, 1), (2, 0), (0, 0)])
def test_a_cached_step_is_its_definition(demo_transformer, taylor, first, last):
    tr = demo_transformer
    torch.manual_seed(3)
    shapes = [(1, 3, 2)]
    xs = [torch.randn(2, 6, 64) for _ in range(3)]
    emb, ts = torch.randn(2, 5, tr.cfg.joint_attention_dim), [torch.full((2,), s) for s in (1.0, 0.8, 0.6)]
    policy = CachePolicy(
        kind="static", first=first, last=last, warmup=1, tail=0, every=100, taylor=taylor
    )  # full: 0, 1
    steps = [StepContext(i, 4, float(ts[i][0]), "cond") for i in range(3)]

    def fwd(runner, i):
        tr.block_runner = runner
        try:
            return tr(xs[i], emb, None, ts[i], shapes, step=steps[i])
        finally:
            tr.block_runner = BlockRunner()

    cache = StepCacheRunner(policy)
    outs = [fwd(cache, i) for i in range(3)]
    probe = Probe(first, last)
    full = [fwd(probe, i) for i in range(3)]
    assert_close_finite(outs[0], full[0], rtol=0, atol=0)  # full steps are the model
    assert_close_finite(outs[1], full[1], rtol=0, atol=0)
    r0, r1 = probe.res[0], probe.res[1]
    r = r1 if not taylor else tuple(a + (a - b) * 1.0 for a, b in zip(r1, r0))  # (2 - 1) / (1 - 0)
    want = fwd(Replace(first, last, r), 2)
    assert_close_finite(outs[2], want, rtol=1e-6, atol=1e-6)
    assert (outs[2] - full[2]).abs().max() > 1e-4  # a cached step is not a full one
    assert cache.stats == {"full": 2, "cached": 1}


class CacheByDefinition(BlockRunner):
    """A step cache written out from its definition, independently of runtime/cache.py: on the steps in
    `full` every block runs and the middle residual (blocks first..len-last) is recorded per (branch,
    shapes); on any other step the middle is replaced by the residual r_k of the last full step k,
    plus (taylor) (r_k - r_j) * (s - k) / (k - j), j the full step before k (r_k alone while k is the only
    one). `factors` logs (s, factor)."""

    def __init__(self, first: int, last: int, full: set[int], taylor: bool):
        self.first, self.last, self.full, self.taylor = first, last, full, taylor
        self.history: dict[tuple, list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.factors: list[tuple[int, float]] = []

    def run(self, blocks, call, img, txt, step):
        if step is None:  # not a denoising step of the cache's run (2.1's KV-cache extract step)
            return super().run(blocks, call, img, txt, step)
        n = len(blocks)
        for i in range(self.first):
            img, txt = call(i, blocks[i], img, txt)
        hist = self.history.setdefault((step.branch, tuple(img.shape), tuple(txt.shape)), [])
        if step.step == 0:
            hist.clear()
        if step.step in self.full:
            i0, t0 = img, txt
            for i in range(self.first, n - self.last):
                img, txt = call(i, blocks[i], img, txt)
            hist.append((step.step, (img - i0, txt - t0)))
        else:
            (k, rk), (j, rj) = hist[-1], hist[-2] if len(hist) > 1 else hist[-1]
            f = (step.step - k) / (k - j) if k != j else 0.0  # one full step so far: its residual as is
            self.factors.append((step.step, f))
            r = tuple(a + (a - b) * f for a, b in zip(rk, rj)) if self.taylor else rk
            img, txt = img + r[0], txt + r[1]
        for i in range(n - self.last, n):
            img, txt = call(i, blocks[i], img, txt)
        return img, txt


# (policy, steps, its full steps written out by hand). Static: every `warmup_every`-th of the first
# `warmup`, the last `tail`, and every `every`-th from `warmup` on. Adaptive with an unreachable threshold: warm-up, then `max_skips`
# cached steps between full ones, the tail. The gaps between full steps are 3 and 4, so the Taylor
# factors (s - k) / (k - j) are 1/4, 1/3, 1/2, 2/3, 3/4, 2, 3 as well as 1.
GAPPED = {
    "fast": (PRESETS["fast"], 12, {0, 1, 2, 6, 10, 11}),
    "balanced": (PRESETS["balanced"], 12, {0, 2, 4, 6, 8, 11}),  # warm-up of 8, every 2nd full
    "every-3-last-1": (
        CachePolicy(kind="static", first=1, last=1, warmup=2, tail=1, every=3, taylor=1),
        12,
        {0, 1, 2, 5, 8, 11},
    ),  # fmt: skip
    "every-4-reuse": (
        CachePolicy(kind="static", warmup=2, tail=1, every=4, taylor=0),
        12,
        {0, 1, 2, 6, 10, 11},
    ),
    "adaptive-taylor": (
        CachePolicy(kind="adaptive", warmup=2, tail=1, threshold=1e9, max_skips=2, taylor=1),
        12,
        {0, 1, 4, 7, 10, 11},
    ),  # fmt: skip
}


def assert_gapped_run_is_its_definition(pipe, run, name: str, run_steps: int) -> None:
    """`run(runner_or_None)` -> images: the pipeline with the policy of GAPPED[name] equals the same
    pipeline with `CacheByDefinition` in place of the step cache (fp32: 1e-5), and the cached steps
    differ from full ones."""
    policy, steps, full = GAPPED[name]
    assert steps == run_steps
    assert {s for s in range(steps) if policy.kind == "adaptive" or policy.static_full(s, steps)} >= full
    pipe.configure(cache=policy)
    got = run(None)
    stats = dict(pipe.block_runner.stats)
    definition = CacheByDefinition(policy.first, policy.last, full, bool(policy.taylor))
    pipe.transformer.block_runner = definition
    want = run(definition)
    pipe.configure(cache=None)
    uncached = run(None)
    assert_close_finite(got, want, rtol=0, atol=1e-5)
    assert np.abs(got - uncached).max() > 1e-3  # the cached steps are not full ones
    # the definition replaced the same steps (once per branch; adaptive stats count batch rows)
    assert {s for s, _ in definition.factors} == set(range(steps)) - full
    assert stats["cached"] > 0 and stats["cached"] % len(definition.factors) == 0
    if policy.taylor:  # this run did extrapolate by factors other than 1
        assert {round(f, 6) for _, f in definition.factors} - {1.0}


@pytest.fixture(scope="module")
def demo_pipe():
    """The demo model's pipeline: 5 blocks, so that a policy with `last` > 0 still has a middle."""
    from qwenfast.pipeline.common import DEFAULT_MODEL

    p = QwenImagePipeline.from_pretrained(DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    yield p
    p.configure(cache=None, batched_cfg="auto")


@pytest.mark.parametrize("name", list(GAPPED))
def test_a_cached_step_is_its_definition_with_gaps_over_1(request, name):
    """The whole pipeline (CFG, two prompts, 12 steps) with the presets' gaps between full steps."""
    pipe = request.getfixturevalue("demo_pipe" if GAPPED[name][0].last else "fresh")
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **{**KW, "num_inference_steps": 12})
    pipe.configure(batched_cfg=name != "balanced")  # "balanced": cond and uncond in one forward ("both")

    def run(_):
        return pipe(["a red circle", "two blue stars"], generator=[_gen(4), _gen(5)], **kw).images

    assert_gapped_run_is_its_definition(pipe, run, name, 12)


@pytest.mark.parametrize("policy", [PRESETS["fast"], CachePolicy(kind="adaptive", threshold=1.1, taylor=1)])
def test_rows_branches_and_requests_never_share_a_cache(fresh, policy):
    """A batch of two prompts equals each alone with the same policy; an earlier request changes nothing."""
    fresh.configure(cache=policy, batched_cfg=False)
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **KW)
    alone = [
        fresh([p], generator=[_gen(s)], **kw).images[0]
        for p, s in (("a red circle", 4), ("two blue stars", 5))
    ]
    both = fresh(["a red circle", "two blue stars"], generator=[_gen(4), _gen(5)], **kw).images
    assert_close_finite(both[0], alone[0], atol=2e-5)
    assert_close_finite(both[1], alone[1], atol=2e-5)
    assert fresh.block_runner.stats["cached"] > 0  # the policy did skip something
    again = fresh(["a red circle"], generator=[_gen(4)], **kw).images[0]
    assert_close_finite(again, alone[0], atol=1e-6)
    fresh.configure(batched_cfg=True)  # cond + uncond in one forward: the "both" branch's own cache
    batched = fresh(["a red circle"], generator=[_gen(4)], **kw).images[0]
    assert_close_finite(batched, alone[0], atol=2e-5)


def test_caching_changes_the_image_a_little_and_computes_less(fresh):
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **{**KW, "num_inference_steps": 20})
    want = fresh("a red circle", generator=_gen(6), **kw).images
    fresh.configure(cache="fast")
    got = fresh("a red circle", generator=_gen(6), **kw).images
    s = fresh.block_runner.stats
    assert 0 < s["full"] / (s["full"] + s["cached"]) <= 0.5
    assert 0 < np.abs(got - want).max() < 0.5 and np.isfinite(got).all()


def test_a_cached_step_of_fast_runs_no_block(fresh):
    """`fast` is static with first=0: a cached step runs no block (the whole stack's residual,
    extrapolated), a full step every block; an adaptive policy needs its probe block."""
    assert PRESETS["fast"].first == 0
    per_step = []

    class Counting(StepCacheRunner):
        def run(self, blocks, call, img, txt, step):
            seen = []

            def counted(i, block, x, y):
                seen.append(i)
                return call(i, block, x, y)

            out = super().run(blocks, counted, img, txt, step)
            per_step.append((step.step, step.steps, seen, len(blocks)))
            return out

    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **{**KW, "num_inference_steps": 10})
    want = fresh("a red circle", generator=_gen(6), **kw).images
    fresh.configure(cache="fast", batched_cfg=True)
    fresh.transformer.block_runner = Counting(PRESETS["fast"])
    got = fresh("a red circle", generator=_gen(6), **kw).images
    assert [s for s, *_ in per_step] == list(range(10))
    for s, steps, seen, n in per_step:
        assert seen == (list(range(n)) if PRESETS["fast"].static_full(s, steps) else []), s
    assert sum(not seen for *_, seen, _ in per_step) >= 5  # cached steps were taken
    assert np.isfinite(got).all() and 0 < np.abs(got - want).mean() < 0.05  # close to uncached
    with pytest.raises(ValueError, match="adaptive"):
        CachePolicy(kind="adaptive", first=0)
    assert CachePolicy(kind="static", first=0).first == 0


def test_cache_options_and_their_errors(fresh):
    assert EngineOptions(cache="fast").cache == "fast"
    for bad in ("faster", 3, dict(kind="static")):
        with pytest.raises(OptionsError):
            EngineOptions(cache=bad)
    with pytest.raises(OptionsError, match="offload='blocks'"):
        EngineOptions(cache="fast", offload="blocks")
    with pytest.raises(ValueError):
        CachePolicy(kind="sometimes")
    for bad in (dict(warmup_every=0), dict(kind="adaptive", warmup_every=2)):
        with pytest.raises(ValueError, match="warmup_every"):
            CachePolicy(**bad)
    # the tail outranks the warm-up: a 4-step run under balanced still ends on a full step
    assert [s for s in range(4) if PRESETS["balanced"].static_full(s, 4)] == [0, 2, 3]
    fresh.configure(cache="balanced")
    assert (
        isinstance(fresh.block_runner, StepCacheRunner) and fresh.block_runner.policy is PRESETS["balanced"]
    )
    fresh.configure(cache="off")
    assert type(fresh.block_runner) is BlockRunner


def test_cli_cache_flag(tmp_path):
    from qwenfast.cli import main

    out = tmp_path / "c.png"
    assert main(["generate", "a red circle", "--steps", "6", "--cache", "fast", "--seed", "1", "--quiet",
                 "--device", "cpu", "-o", str(out)]) == 0  # fmt: skip
    from PIL import Image

    assert Image.open(out).text["cache"] == "fast"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cache", ["fast", "balanced"])
def test_graph_and_eager_cached_paths_agree(cache):
    """Static caches under CUDA graphs (one graph per variant: first, full, cached) = the eager path."""
    p = QwenImagePipeline.from_pretrained(TINY, device="cuda", dtype=torch.bfloat16, cache=cache)
    p.set_progress_bar_config(disable=True)
    p.configure(graph_slots=16)  # room for both runners' variants
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **{**KW, "num_inference_steps": 12})
    graphed = [p("a red circle", generator=_gen(7), **kw).images for _ in range(2)]  # capture, then replay
    assert {k[-1][1] for k in p._graphs.graphs} >= {"first", "full", "cached"}
    assert_close_finite(graphed[0], graphed[1])
    p.configure(cache=None)
    uncached = p("a red circle", generator=_gen(7), **kw).images  # graphs of the plain runner
    # back to the cache: its graphs were kept (no recapture) and replay the same image
    n = p._graphs.captures
    p.configure(cache=cache)
    assert_close_finite(p("a red circle", generator=_gen(7), **kw).images, graphed[1])
    assert p._graphs.captures == n
    p.configure(cuda_graphs=False)  # (drops every graph: captured under other options)
    eager = p("a red circle", generator=_gen(7), **kw).images
    assert_close_finite(graphed[1], eager, atol=2e-3)
    assert np.abs(uncached - eager).max() > 0  # the cache was on in both runs above
    p.configure(cache=None)


def test_a_cache_switch_keeps_its_runner_and_the_graphs(fresh):
    """configure(cache=...) back and forth (a server's per-request presets) reuses one block runner per
    policy and drops no captured graph (their keys hold the runner whose buffers they read), and the
    images are those of a pipeline that never switched."""
    p = fresh
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **KW)
    p._graphs.graphs[("sentinel",)] = None  # stands for a captured graph (CPU: none are captured)
    try:
        p.configure(cache="fast")
        fast = p.transformer.block_runner
        a = p("a red circle", generator=_gen(3), **kw).images
        p.configure(cache=None)
        plain = p.transformer.block_runner
        p.configure(cache="balanced")
        p.configure(cache="fast")
        assert p.transformer.block_runner is fast and isinstance(fast, StepCacheRunner)
        p.configure(cache=None)
        assert p.transformer.block_runner is plain
        assert ("sentinel",) in p._graphs.graphs
        p.configure(cache="fast")
        b = p("a red circle", generator=_gen(3), **kw).images
    finally:
        p._graphs.graphs.pop(("sentinel",), None)
    assert_close_finite(a, b)


def test_snapshot_restore_undoes_a_step(demo_transformer):
    """CUDA-graph capture runs a step eagerly (warm-up) before recording it: the runner's state must
    be put back so that the replay is the step's only run."""
    tr = demo_transformer
    torch.manual_seed(5)
    x, emb = torch.randn(1, 6, 64), torch.randn(1, 5, tr.cfg.joint_attention_dim)
    runner = StepCacheRunner(CachePolicy(kind="static", warmup=1, tail=0, every=100, taylor=1))
    tr.block_runner = runner
    try:
        for i in range(2):
            tr(
                x + i,
                emb,
                None,
                torch.full((1,), 1.0 - 0.1 * i),
                [(1, 3, 2)],
                step=StepContext(i, 6, 1.0, "cond"),
            )
        before = runner.snapshot()
        tr(
            x + 5, emb, None, torch.full((1,), 0.5), [(1, 3, 2)], step=StepContext(1, 6, 1.0, "cond")
        )  # a full step again
        changed = runner.snapshot()
        runner.restore(before)
        after = runner.snapshot()
    finally:
        tr.block_runner = BlockRunner()
    (key,) = before  # the branch's arena: every shape's residuals live in it
    assert (before[key][1] - changed[key][1]).abs().max() > 1e-4
    assert_close_finite(before[key][1], after[key][1], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["fast", CachePolicy(kind="adaptive", threshold=1.1, taylor=1)])
def test_a_call_between_two_cached_steps_bypasses_the_cache(fresh, policy):
    """`step_cache_bypassed()` (the server runs a short request between two steps of a cached batch): the
    inner call equals a call with no cache configured, and the outer cached call's image is the one it
    makes undisturbed; the cache did skip work in the outer call, and a cached inner call would differ."""
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, **{**KW, "num_inference_steps": 12})
    inner_kw = dict(kw, num_inference_steps=6)
    plain = fresh("two blue stars", generator=_gen(9), **inner_kw).images
    fresh.configure(cache=policy)
    outer_alone = fresh("a red circle", generator=_gen(8), **kw).images
    cached_inner = fresh("two blue stars", generator=_gen(9), **inner_kw).images
    inner = []

    cached, runners = fresh.block_runner, []

    def cb(i, n, x):
        if i == 4:
            with fresh.step_cache_bypassed():
                runners.append(fresh.block_runner)
                inner.append(fresh("two blue stars", generator=_gen(9), **inner_kw).images)

    stats0 = dict(fresh.block_runner.stats)
    outer = fresh("a red circle", generator=_gen(8), callback=cb, **kw).images
    assert fresh.block_runner.stats["cached"] > stats0["cached"]  # the outer call did use its cache
    assert_close_finite(outer, outer_alone, rtol=0, atol=0)
    assert_close_finite(inner[0], plain, rtol=0, atol=1e-6)
    assert np.abs(cached_inner - plain).max() > 1e-4  # what the bypass avoids
    assert fresh.block_runner.variant(StepContext(3, 12, 0.5, "cond", cache=False)) == "plain"
    # inside, the runner a configure without a cache hands over (its CUDA graphs are the uncached ones);
    # the cached one is back after
    assert fresh.block_runner is cached and runners[0] is not cached
    fresh.configure(cache=None)
    assert fresh.block_runner is runners[0]


def test_every_shape_of_a_branch_shares_one_buffer(fresh):
    """The static cache's residuals of all shapes of a CFG branch are views of one arena, sized for the
    largest shape seen (memory stays flat when a server sees many sizes): a small size, a larger one and
    the small one again run as on pipelines that never saw another size; the arena grew once (`epoch`
    moved on once); and the adaptive policy keeps no state after a run's last step."""
    kw = dict(negative_prompt=" ", true_cfg_scale=2.5, output_type="np", num_inference_steps=8)
    small, large = dict(height=32, width=32), dict(height=48, width=64)
    want = {}
    for name, size in (("small", small), ("large", large)):
        alone = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32, cache="fast")
        alone.configure(batched_cfg=True)
        alone.set_progress_bar_config(disable=True)
        want[name] = alone("a red circle", generator=_gen(2), **size, **kw).images
    fresh.configure(cache="fast", batched_cfg=True)
    runner = fresh.block_runner
    runner._arena.clear(), runner.states.clear()  # (the module's pipeline: earlier tests used this runner)
    epoch = runner.epoch
    got = [fresh("a red circle", generator=_gen(2), **s, **kw).images for s in (small, large, small)]
    for g, name in zip(got, ("small", "large", "small")):
        assert_close_finite(g, want[name], rtol=0, atol=0)
    (arena,) = runner._arena.values()  # one branch: "both" (batched CFG)
    live = [st for st in runner.states.values() if st.res is not None]
    assert len(live) == 2 and runner.epoch == epoch + 1  # grew once, from the small size to the large
    for st in live:
        for t in (*st.res, *st.prev):
            assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    need = max(2 * (st.res[0].numel() + st.res[1].numel()) for st in live)
    assert arena.numel() == math.ceil(need * HEADROOM)
    # a slightly longer prompt (one more text token) fits the headroom: no reallocation, graphs stay valid
    fresh("a red circle now", generator=_gen(2), **large, **kw)
    assert runner.epoch == epoch + 1 and runner._arena["both"] is arena
    fresh.configure(cache=CachePolicy(kind="adaptive", threshold=1.1, taylor=1))
    fresh("a red circle", generator=_gen(2), **small, **kw)
    assert fresh.block_runner.stats["cached"] > 0 and not fresh.block_runner.states
