"""`qwenfast bench quality` and `bench serve` on the CPU, as a newcomer runs them: a progress bar on
stderr while the suite runs, the record as the final JSON line, and bench serve at the model's own
size (it defaulted to 64x64 on the 128x128 demo and warned about its own default)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from qwenfast.cli import main


def test_bench_quality_prints_its_record_last_and_shows_progress(capsys):
    assert main(["bench", "quality", "--n", "2", "--steps", "1", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["bench"] == "quality" and rec["model"] == "demo-t2i" and rec["n"] == 2 and rec["steps"] == 1
    assert 0 <= rec["score"] <= 100 and set(rec["per_check"]) >= {"colour", "shape"} and rec["commit"]
    assert "quality" in err and "2/2" in err  # the tqdm bar: images done of the suite


def test_bench_serve_runs_at_the_models_own_size(capsys, caplog):
    pytest.importorskip("fastapi")
    with caplog.at_level(logging.WARNING, logger="qwenfast.server"):
        assert main(["bench", "serve", "--concurrency", "1", "--requests", "1", "--steps", "1", "--no-baseline",
                     "--device", "cpu"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["bench"] == "serve" and rec["size"] == 128 and rec["model"] == "demo-t2i"
    assert rec["levels"][0]["errors"] == 0 and rec["levels"][0]["images"] == 1
    assert not [r for r in caplog.records if "trained at" in r.getMessage()], caplog.text


def test_bench_serve_mixed_and_its_soak(capsys):
    """The mixed workload on the demo model: every request answered (or hung up on purpose), the server's
    200s equal the clients', the ratios against the old batcher computed; and a short soak with its
    broken LoRA dropped halfway: no 5xx, nothing lost or answered twice, memory windows recorded."""
    pytest.importorskip("fastapi")
    from qwenfast.benchmarks.serve_mixed import CLASSES, workload

    reqs = workload(200, 0, ["a", "b"])  # the mix is seeded and shaped as documented
    assert [r.k for r in reqs] == list(range(200)) and {r.cls for r in reqs} == set(CLASSES)
    assert {r.lora for r in reqs} == {"a", "b", None} and workload(200, 0, ["a", "b"]) == reqs
    assert main(["bench", "serve", "--workload", "mixed", "--concurrency", "2", "--requests", "4", "--loras", "2",
                 "--old-concurrency", "2", "--device", "cpu"]) == 0  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "serve_mixed" and rec["mode"] == "levels"
    for lv in rec["old_batcher"] + rec["per_row"]:
        assert lv["sent"] == 4 and lv["server_errors"] == 0
        assert lv["server_200"] == lv["outcomes"].get("200", 0) == lv["images"]
    assert "x_old_batcher" in rec["per_row"][0] and set(rec["idle_s"]) == {"4-step", "8-step"}
    sizes = {f"{w}x{h}" for w, h in rec["sizes"]}
    assert set(rec["idle_4step_by_size_s"]) <= sizes and min(rec["idle_4step_by_size_s"].values()) > 0
    for lv in rec["per_row"]:  # each class's requests by size: what the same-sizes idle ratio weighs
        for c in lv["classes"].values():
            assert set(c["sizes"]) <= sizes and sum(c["sizes"].values()) == c["n"]
    for lv in rec["per_row"]:  # the timed pass's trace: each request sent, the batches that served them
        tr = lv["trace"]
        assert len(tr["requests"]) == lv["sent"] and all(r[0] >= 0 and r[3] > 0 for r in tr["requests"])
        assert tr["requests"] == sorted(tr["requests"]) and {r[2] for r in tr["requests"]} <= sizes
        assert 1 <= len(tr["batches"]) and sum(b[2] for b in tr["batches"]) >= lv["images"]
        assert all(b[1] > 0 and b[3] in (4, 8, 50) and b[4] in sizes and b[5] >= 0 for b in tr["batches"])
    for ph in (rec["idle_server_phases_s"]["4-step"], rec["per_row"][0]["server_phases_s"]):
        assert set(ph) == {"queue", "generate", "encode", "other"} and ph["generate"] > 0
        assert min(ph.values()) >= 0 and ph["generate"] <= sum(ph.values())  # (they add up: test_server)
    assert main(["bench", "serve", "--workload", "mixed", "--concurrency", "2", "--loras", "2", "--duration", "6",
                 "--device", "cpu", "--warm-shapes", "--max-batch", "2"]) == 0  # fmt: skip
    soak = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = soak["soak"]
    assert soak["mode"] == "soak" and s["sent"] > 0 and s["broken_dropped_at_s"] is not None
    assert s["fivexx"] == s["lost"] == s["duplicated"] == 0
    # (--warm-shapes: that pass is the soak's warm-up, no untimed pass of its first requests; the soak keeps
    # no trace)
    assert "warm_captures" not in soak and "trace" not in s
    # every shape once first: 4 sizes x 3 CFG/cache kinds x with and without a LoRA x batches of 1 and 2
    assert soak["shapes_warm"]["requests"] == 4 * 3 * 2 * (1 + 2) and soak["shapes_warm"]["failed"] == 0
    # its 4-step p95 set against the same sizes each alone, measured after the warm-up
    assert len(soak["idle_4step_by_size_s"]) == 4 and min(soak["idle_4step_by_size_s"].values()) > 0
    if s["classes"].get("4-step", {}).get("p95_s"):
        assert s["p95_4step_x_idle_same_sizes"] > 0


def test_bench_task_edit_2511_smoke(capsys):
    """`bench pipeline --task edit-2511 --smoke`: the demo's weights in transformers built with Edit-2511's
    flag, `QwenImageEditPlusPipeline` on both sides, a --size² input to a --size² output: the two engines'
    images agree (the row's mean |difference|) and are not blank; --fp8 with several tasks is refused."""
    assert main(["bench", "pipeline", "--task", "edit-2511", "--smoke", "--steps", "2", "--size", "64"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = rec["rows"]["edit-2511"]
    assert rec["bench"] == "tasks_inpaint" and rec["size"] == 64 and row["shape"][1:3] == [64, 64]
    assert row["mean_abs_diff_images"] < 2e-3  # the same image (uint8 scale / 255), as the other task rows
    assert row["qwenfast"]["total_s"] > 0 and row["diffusers"]["total_s"] > 0
    assert main(["bench", "pipeline", "--task", "img2img", "--task", "edit-2511", "--fp8", "--smoke"]) == 2
    from qwenfast.benchmarks.pipeline import build

    ours, ref = build(True, zero_cond_t=True)  # the flag on both, the demo's weights in each
    assert ours.transformer.cfg.zero_cond_t and ref.transformer.config.zero_cond_t
    w = ours.transformer.state_dict()
    plain, _ = build(True)
    assert all(torch.equal(w[k], v) for k, v in plain.transformer.state_dict().items())


def test_shapes_warm_runs_the_largest_shape_first(monkeypatch):
    """The warm-up of `bench serve --warm-shapes` sends its largest size at its largest batch first, then
    smaller ones: the step cache sizes its buffers by the first shape, and a later larger one would
    reallocate them and leave every graph captured before unusable (runtime/cache.py)."""
    from qwenfast.benchmarks import serve_mixed as sm

    sent: list[tuple[int, tuple, int]] = []  # (pixels, (CFG, cache, LoRA), batch) per batch sent

    def closed_loop(base, reqs, c, *a, **kw):
        r = reqs[0]
        sent.append((r.width * r.height, (r.cfg, r.cache, r.lora), len(reqs)))
        return [{"outcome": "200"} for _ in reqs]

    class Pipe:
        def graph_stats(self):
            return {"captures": 0, "decode_captures": 0, "resident": 0, "stale": 0}

    monkeypatch.setattr(sm, "closed_loop", closed_loop)
    sizes = ((32, 32), (64, 48), (48, 48))
    reqs = [sm._plain(i, "4-step", size, None, sm.PROMPTS[0], i) for i, size in enumerate(sizes)]
    out = sm.shapes_warm(Pipe(), "http://unused", reqs, "style", max_batch=4)
    assert out["requests"] == sum(b for *_, b in sent) and out["failed"] == 0
    areas = [a for a, _, _ in sent]
    assert areas == sorted(areas, reverse=True) and areas[0] == 64 * 48
    groups = {(a, kind) for a, kind, _ in sent}
    assert len(groups) == 3 * 3 * 2  # sizes x CFG/cache kinds x with and without a LoRA
    for a, kind in groups:  # each shape's batches: the largest first
        bs = [b for a2, k2, b in sent if (a2, k2) == (a, kind)]
        assert bs == ([4, 2, 1] if kind[0] <= 1 else [2, 1]), (a, kind, bs)


def test_bench_pipeline_short_case_total_is_the_median_of_unstaged_calls(tmp_path):
    """A few-step case's total is the median of calls without the stage timers (which synchronise around
    the prompt encode and the decode); one more call gives the stages. The smoke run makes 2 such calls."""
    import json

    assert main(["bench", "pipeline", "--smoke", "--case", "1024:4:nocfg", "--results", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "pipeline.jsonl").read_text().splitlines()[-1])
    for engine in ("diffusers", "qwenfast"):
        row = rec["end_to_end"]["1024:4:nocfg"][engine]
        assert len(row["runs_s"]) == 2 and abs(row["total_s"] - sum(row["runs_s"]) / 2) <= 1e-3
        assert row["staged_total_s"] > 0 and row["denoise_s"] > 0 and row["text_encode_s"] > 0
    assert rec["end_to_end"]["1024:4:nocfg"]["mean_abs_diff_images"] < 1e-3
