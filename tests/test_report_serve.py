"""The mixed-load serving table (`qwenfast bench report`, benchmarks/report_serve.py): the newest run with
its baselines, then each later run of the per-row server alone, each set against its own idle latencies."""

from __future__ import annotations

from qwenfast.benchmarks.records import Rec
from qwenfast.benchmarks.report_serve import serve_mixed


def _level(ipm: float, p95: float, sent: int = 40, **kw) -> dict:
    classes = {
        "4-step": {"n": 16, "p50_s": 1.0, "p95_s": p95},
        "8-step": {"n": 18, "p50_s": 3.0, "p95_s": 9.0},
    }
    return {"concurrency": 8, "sent": sent, "images_per_min": ipm, "mean_batch": 1.2, "classes": classes,
            "server_errors": 0, **kw}  # fmt: skip


def _rec(line: int, commit: str, per_row: dict, old: dict | None = None, idle: float = 1.0) -> Rec:
    data = {"bench": "serve_mixed", "mode": "levels", "model": "random-full", "commit": commit,
            "date": f"2026-11-27T2{line % 10}:00Z", "idle_s": {"4-step": idle}, "per_row": [per_row],
            "command": f"qwenfast bench serve --workload mixed # {commit}"}  # fmt: skip
    if old is not None:
        data["old_batcher"] = [old]
    return Rec("serve_mixed.jsonl", line, data)


def test_later_runs_without_baselines_are_rows_of_their_own():
    base = _rec(1, "aaa", _level(36.0, 3.0, x_old_batcher=1.4), old=_level(26.0, 4.5))
    later = _rec(2, "bbb", _level(38.0, 2.4, sent=64, p95_4step_x_idle_same_sizes=1.76), idle=0.8)
    older = _rec(0, "zzz", _level(10.0, 9.0))  # a per-row-only run before the baseline run: not shown
    out = serve_mixed([older, base, later])
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| old batcher (LoRA set in the batch key)",
        "| per-row LoRAs",
        "| per-row LoRAs at `bbb` (no baselines), 64 requests",
    ]
    assert "1.40×" in rows[1] and "3.00×" in rows[1]  # against the baseline run's own idle 4-step
    assert "3.00×" in rows[2] and "1.76×" in rows[2]  # 2.4 s over its own run's idle 0.8 s
    assert "zzz" not in out and "`bbb`" in out


def test_without_a_baseline_run_the_newest_run_leads():
    out = serve_mixed([_rec(1, "aaa", _level(30.0, 3.0)), _rec(2, "bbb", _level(31.0, 2.0))])
    rows = [line for line in out.splitlines() if line.startswith("| per-row")]
    assert len(rows) == 1 and "31.0" in rows[0]
