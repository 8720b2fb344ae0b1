"""`qwenfast bench cache-pareto`: the forward counter, the Pareto fronts, a small run on the demo model
(CPU, few steps) and the published table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qwenfast
from qwenfast.benchmarks import cache_pareto as CP
from qwenfast.benchmarks.records import Rec
from qwenfast.benchmarks.report_quality import TABLES, cache_pareto
from qwenfast.options import CachePolicy

pytest.importorskip("cache_dit")  # the [test] extra pins cache-dit==1.5.3

PROMPT = "a small red circle at the top left, blue background"


def _call(pipe, steps: int) -> None:
    pipe(PROMPT, negative_prompt=" ", height=64, width=64, num_inference_steps=steps, true_cfg_scale=2.0,
         generator=torch.Generator("cpu").manual_seed(0), output_type="np")  # fmt: skip


@pytest.fixture(scope="module")
def pipes():
    from qwenfast.demo.bench import load

    ours = load(None, "cpu", torch.float32)
    theirs = CP.load_diffusers(Path(qwenfast.DEMO_MODEL), False, torch.device("cpu"), torch.float32)
    return ours, theirs


@pytest.mark.parametrize("engine", ["qwenfast", "diffusers"])
def test_uncached_counts_steps_times_two_forwards_with_cfg(pipes, engine):
    pipe = pipes[0] if engine == "qwenfast" else pipes[1]
    counter = CP.BlockCounter(list(pipe.transformer.transformer_blocks))
    try:
        _call(pipe, 3)
    finally:
        counter.close()
    assert counter.rows == [6] * 5  # 3 steps x (cond + uncond), every one of the 5 blocks
    assert counter.forwards == 6 and counter.computed_fraction() == 1.0 and counter.block_fraction() == 1.0
    _call(pipe, 2)
    assert counter.rows == [6] * 5  # closed: the hooks are gone


def test_a_qwenfast_policy_reduces_the_count_to_its_full_steps(pipes):
    ours = pipes[0]
    policy = CachePolicy(kind="static", warmup=2, tail=1, every=3, taylor=1)
    cfg = CP.Config("qwenfast", "static every 3", policy)
    with CP.enabled(ours, cfg):
        counter = CP.BlockCounter(list(ours.transformer.transformer_blocks))
        try:
            _call(ours, 8)
        finally:
            counter.close()
    full = sum(policy.static_full(i, 8) for i in range(8))  # steps 0, 1, 2, 5, 7
    assert counter.forwards == 16 and counter.rows[0] == 16  # the first block always runs
    assert counter.rows[1:] == [2 * full] * 4
    assert counter.computed_fraction() == pytest.approx(full / 8)
    assert counter.block_fraction() == pytest.approx((16 + 4 * 2 * full) / (5 * 16))
    assert ours.options.cache is None  # configured back


def test_cache_dit_reduces_the_count_and_is_removed_after(pipes):
    theirs = pipes[1]
    spec = {"config": {"Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 2,
                       "residual_diff_threshold": 10.0, "num_inference_steps": 8}, "taylorseer": 1}  # fmt: skip
    with CP.enabled(theirs, CP.Config("diffusers", "DBCache F1B1 R10", spec)):
        counter = CP.BlockCounter(list(theirs.transformer.transformer_blocks))
        try:
            _call(theirs, 8)
        finally:
            counter.close()
    assert counter.forwards == 16
    assert counter.rows[0] == counter.rows[-1] == 16  # Fn and Bn blocks run on every forward
    assert 0 < counter.rows[2] < 16 and counter.computed_fraction() < 1.0
    counter = CP.BlockCounter(list(theirs.transformer.transformer_blocks))
    try:
        _call(theirs, 4)  # cache-dit disabled: every block of every forward again
    finally:
        counter.close()
    assert counter.rows == [8] * 5


def test_pareto_front_on_a_hand_made_set():
    pts = [
        (0.3, 80.0),
        (0.5, 85.0),
        (0.4, 70.0),
        (0.5, 90.0),
        (0.2, 60.0),
        (1.0, 90.0),
        (0.3, 80.0),
        (0.6, 88.0),
    ]
    # (0.4, 70) is beaten by (0.3, 80); (0.5, 85) by (0.5, 90); (1.0, 90) and (0.6, 88) by (0.5, 90);
    # of the two (0.3, 80) the first stays
    assert CP.pareto_front(pts) == [4, 0, 3]
    front = [pts[i] for i in CP.pareto_front(pts)]
    assert CP.front_value(front, 0.1) is None
    assert CP.front_value(front, 0.35) == 80.0 and CP.front_value(front, 0.5) == 90.0
    assert CP.pareto_front([]) == []


def _row(engine, config, cf, score, psnr=None, cached=True, **kw):
    r = {"engine": engine, "config": config, "cached": cached, "computed_fraction": cf, "block_fraction": cf,
         "score": score, "params": {}, "forwards": 100, "s": 1.0}  # fmt: skip
    if cached:
        r.update(psnr_db=psnr, ssim=0.99)
    return {**r, **kw}


def test_margins_and_fronts_of_a_synthetic_run():
    rows = [
        _row("qwenfast", "uncached", 1.0, 90.0, cached=False),
        _row("qwenfast", "balanced", 0.38, 88.0, 50.0),
        _row("qwenfast", "fast", 0.30, 80.0, 45.0),
        _row("diffusers", "uncached", 1.0, 90.0, cached=False),
        _row("diffusers", "DBCache F1B0 R0.08", 0.35, 85.0, 48.0),
        _row("diffusers", "DBCache F1B0 R0.24", 0.25, 82.0, 40.0),
    ]
    CP.margins(rows)
    assert rows[1]["score_vs_cache_dit"] == 3.0 and rows[1]["psnr_db_vs_cache_dit"] == 2.0  # vs R0.08
    assert rows[2]["score_vs_cache_dit"] == -2.0 and rows[2]["psnr_db_vs_cache_dit"] == 5.0  # vs R0.24
    assert "score_vs_cache_dit" not in rows[0]
    fr = CP.fronts(rows)
    assert fr["qwenfast:score"] == ["fast", "balanced"]
    assert fr["diffusers:psnr_db"] == ["DBCache F1B0 R0.24", "DBCache F1B0 R0.08"]


def test_the_table_renders_from_a_synthetic_record():
    rows = [
        _row("qwenfast", "uncached", 1.0, 91.7, cached=False),
        _row("qwenfast", "balanced", 0.38, 87.5, 49.4, score_vs_cache_dit=4.2, psnr_db_vs_cache_dit=1.5),
        _row("diffusers", "uncached", 1.0, 91.7, cached=False),
        _row("diffusers", "cache-dit documented (F1B0 R0.12 + TaylorSeer + fast mask)", 0.56, 91.7, 60.0),
        _row("diffusers", "DBCache F1B0 R0.08", 0.35, 83.3, 47.9),
        _row("diffusers", "DBCache F1B0 R0.04", 0.60, 83.3, 47.0),  # off both fronts: not shown
    ]
    rec = {"bench": "cache_pareto", "suite": "text-to-image", "n": 24, "steps": 50, "cfg": 2.0, "rows": rows,
           "fronts": CP.fronts(rows), "uncached_psnr_db": 95.5, "uncached_max_abs_diff": 1, "gpu": "cpu",
           "date": "2026-11-25T20:00Z", "commit": "abcdef0"}  # fmt: skip
    out = cache_pareto([Rec("cache_pareto.jsonl", 3, rec)])
    assert TABLES["cache-pareto"] is cache_pareto
    lines = out.splitlines()
    assert lines[0].startswith("| suite, items | engine | configuration | computed (block work) |")
    assert "| text-to-image, 24 | qwenfast | **`balanced`** | 38% (38%) | 87.5% (-4.2) | 49.4 dB / 0.990 | score, PSNR | +4.2 / +1.5 dB |" in lines  # fmt: skip
    assert any("diffusers + cache-dit | cache-dit documented" in line for line in lines)
    assert any(
        "DBCache F1B0 R0.08 | 35% (35%) | 83.3% (-8.4) | 47.9 dB / 0.990 | score, PSNR |" in x for x in lines
    )
    assert not any("R0.04" in line for line in lines)
    assert (
        "PSNR 95.5 dB (max pixel difference 1/255); 1 more configurations, off both fronts, are in the record"
        in out
    )
    assert "cpu, 2026-11-25, commit `abcdef0` (`bench/results/cache_pareto.jsonl` line 3)" in out
    assert cache_pareto([]).startswith("*No cache-pareto record yet")


@pytest.mark.parametrize("model", [None, "edit"])
def test_a_small_run_gives_a_record_with_both_engines(model):
    """Every qwenfast configuration and a cache-dit one, 1 item, 3 steps: the record's shape, and the two
    engines' uncached images agree (same model, same seed)."""
    rec = CP.run(model, n=1, steps=3, thresholds=(0.5,), only="F1B0 R0.5", device="cpu", dtype="fp32")
    assert rec["suite"] == ("edits" if model else "text-to-image") and rec["n"] == 1
    names = [(r["engine"], r["config"]) for r in rec["rows"]]
    assert names == [("qwenfast", "uncached"), ("diffusers", "uncached"), ("diffusers", "DBCache F1B0 R0.5"),
                     ("diffusers", "DBCache F1B0 R0.5 + TaylorSeer")]  # fmt: skip
    assert all(r["forwards"] == 6 for r in rec["rows"])  # 3 steps x 2 (CFG), one image
    assert rec["uncached_max_abs_diff"] <= 2 and rec["uncached_psnr_db"] > 50
    assert rec["fronts"]["qwenfast:score"] == [] and len(rec["fronts"]["diffusers:psnr_db"]) >= 1


def test_every_preset_and_the_documented_settings_are_configurations():
    from qwenfast.options import CACHE_PRESETS

    ours = [c.name for c in CP.qwenfast_configs()]
    assert ours[: len(CACHE_PRESETS)] == list(CACHE_PRESETS)
    theirs = [c.name for c in CP.cache_dit_configs((0.1, 0.2))]
    assert sum(n.startswith("cache-dit documented (") or "documented, no mask" in n for n in theirs) == 2
    assert "cache-dit documented settings at R0.2 (no mask)" in theirs
    assert "DBCache F1B0 R0.1" in theirs and "DBCache F1B0 R0.2 + TaylorSeer" in theirs
    assert "DBCache F2B0 R0.2 + TaylorSeer" in theirs and "DBCache F1B1 R0.1 + TaylorSeer" not in theirs


def test_the_cli_has_the_subcommand():
    from qwenfast.cli import build_parser

    a = build_parser().parse_args(["bench", "cache-pareto", "--model", "edit", "--n", "3", "--results", "x"])
    assert (a.what, a.model, a.n, a.results, a.steps) == ("cache-pareto", "edit", 3, "x", 50)


def test_the_cached_step_table_takes_the_newest_run_per_first_blocks():
    from qwenfast.benchmarks.report_quality import cache_step

    def rec(line, first, cached_ms, date, **kw):
        return Rec("profile_forward.jsonl", line, {
            "bench": "profile_step_in_run", "cache": "fast", "fp8": True, "steps": 50, "cfg": 4.0,
            "first": first, "gpu_ms_cached_median": cached_ms, "gpu_ms_full_median": 170.0,
            "cached_steps": 35, "full_steps": 15, "total_s": 2.6, "gpu": "NVIDIA H200", "date": date,
            "commit": "abcdef0", **kw})  # fmt: skip

    assert "No record yet" in cache_step([])
    recs = [rec(1, 0, 0.7, "2026-11-27"), rec(2, 0, 0.59, "2026-11-28"), rec(3, 1, 3.43, "2026-11-28"),
            rec(4, 0, 9.0, "2026-11-29", cfg=1.0), rec(5, None, 3.38, "2026-11-29")]  # fmt: skip
    out = cache_step(recs)
    assert TABLES["cache-step"] is cache_step
    assert (
        "| `fast`, 0 first blocks on a cached step (the preset) | 0.59 ms | 170.0 ms | 35 / 15 | 2.60 s |"
        in out
    )
    assert "| `fast`, 1 first block on a cached step | 3.43 ms |" in out
    assert "lines 2, 3" in out and "0.70 ms" not in out and "9.00 ms" not in out
