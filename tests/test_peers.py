"""`qwenfast bench peers`: the harness on the demo model (CPU), the comparisons and the published tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwenfast.benchmarks import peers
from qwenfast.benchmarks.records import Rec
from qwenfast.benchmarks.report_peers import diffusers_baseline, peers_highres
from qwenfast.benchmarks.report_peers import peers as peers_table


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory) -> dict:
    """One smoke run of every engine (own processes, the demo model on the CPU), record kept."""
    out = tmp_path_factory.mktemp("peers")
    rec = peers.run(["e2e:1024:4:nocfg"], list(peers.ENGINES), ["fast"], out, smoke=True, timeout_s=600)
    assert (out / "peers.jsonl").is_file()
    return rec


def test_smoke_run_times_every_engine_over_the_same_weights(smoke_record):
    rows = {r["row"]: r for r in smoke_record["rows"] if "row" in r}
    assert not [r for r in smoke_record["rows"] if "error" in r], smoke_record["rows"]
    assert smoke_record["same_weights"]
    for name in ("diffusers eager", "qwenfast bf16", "qwenfast bf16 + fast cache",
                 "diffusers + cache-dit DBCache (F1B0, R 0.12)"):  # fmt: skip
        assert name in rows, sorted(rows)
    # qwenfast runs diffusers' model: same image (fp32 on the CPU), and the speed-up is against that row
    assert rows["qwenfast bf16"]["mean_abs_diff_vs_diffusers"] <= 1e-4
    assert rows["diffusers eager"]["speedup_vs_diffusers"] == 1.0
    for r in rows.values():
        assert r["s"] > 0 and np.isfinite(r["s"])
    for name in ("qwenfast bf16 + fast cache", "diffusers + cache-dit DBCache (F1B0, R 0.12)"):
        assert 0 < rows[name]["computed_fraction"] <= 1
        assert "mean_abs_diff_vs_diffusers" not in rows[name]  # a cached row's difference is a quality question


def test_the_high_resolution_suite_has_its_own_table(smoke_record, tmp_path):
    """`bench peers --highres` (2048², 2512²): its record says so, its table shows each call's peak memory,
    and it never displaces the main table's record (the newest of the main suite)."""
    rec = peers.run(["e2e:2048:4:nocfg", "e2e:2512:2:nocfg"], ["diffusers", "qwenfast"], [], tmp_path,
                    smoke=True, timeout_s=600)  # fmt: skip
    assert rec["suite"] == "highres" and smoke_record["suite"] == "main"
    assert not [r for r in rec["rows"] if "error" in r], rec["rows"]
    rows = {(r["row"], r["case"]) for r in rec["rows"] if "row" in r}
    assert {("diffusers eager", "e2e:2512:2:nocfg"), ("qwenfast bf16", "e2e:2048:4:nocfg")} <= rows
    recs = [Rec("peers.jsonl", 1, {**smoke_record, "smoke": False}), Rec("peers.jsonl", 2, {**rec, "smoke": False})]
    hi = peers_highres(recs)
    assert "2048², 4 steps" in hi and "2512², 2 steps" in hi and ", peak " in hi and "line 2" in hi
    assert "1024², 4 steps" in peers_table(recs) and "line 1" in peers_table(recs)
    assert "No high-resolution record" in peers_highres(recs[:1])


def test_compare_sees_a_changed_output(tmp_path):
    """The difference column is real: an output moved by 1e-2 shows it, NaN never passes as equal."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 37, 64)).astype(np.float32)
    np.save(tmp_path / "a.npy", ref)
    np.save(tmp_path / "b.npy", ref + 1e-2 * rng.standard_normal(ref.shape).astype(np.float32))
    bad = ref.copy()
    bad[0, 3, 5] = np.nan
    np.save(tmp_path / "c.npy", bad)
    rows = [
        {"engine": "diffusers", "row": "diffusers eager", "case": "fwd:1024", "ms": 10.0, "output": "a.npy"},
        {"engine": "qwenfast", "row": "x", "case": "fwd:1024", "ms": 5.0, "output": "b.npy"},
        {"engine": "qwenfast", "row": "y", "case": "fwd:1024", "ms": 5.0, "output": "c.npy"},
    ]
    peers.compare(rows, tmp_path)
    assert rows[0]["rel_err_vs_diffusers"] == 0.0
    assert 5e-3 < rows[1]["rel_err_vs_diffusers"] < 2e-2
    assert rows[1]["speedup_vs_diffusers"] == 2.0
    assert np.isnan(rows[2]["rel_err_vs_diffusers"])


def test_fingerprints_must_agree():
    assert peers.check_same_weights([{"fingerprint": [1.0, 2.0]}, {"fingerprint": [1.0, 2.0]}])
    assert not peers.check_same_weights([{"fingerprint": [1.0, 2.0]}, {"fingerprint": [1.0, 2.5]}])


def test_keep_adds_engines_of_a_later_invocation(tmp_path, monkeypatch):
    """--keep: a second invocation adds its engines to the first's rows (one record with all of them)."""
    calls = []

    def fake_worker(engine, cases, caches, out, smoke, timeout_s):
        calls.append(engine)
        np.save(out / f"{engine}.npy", np.ones((2, 2), np.float32))
        name = "diffusers eager" if engine == "diffusers" else f"{engine} row"
        return [{"engine": engine, "row": name, "case": "fwd:1024", "ms": 4.0, "output": f"{engine}.npy",
                 "fingerprint": [1.0]}]  # fmt: skip

    monkeypatch.setattr(peers, "_worker", fake_worker)
    peers.run(["fwd:1024"], ["diffusers"], [], None, keep=str(tmp_path))
    rec = peers.run(["fwd:1024"], ["qwenfast"], [], None, keep=str(tmp_path))
    assert calls == ["diffusers", "qwenfast"]
    assert [r["row"] for r in rec["rows"]] == ["diffusers eager", "qwenfast row"]
    assert rec["rows"][1]["rel_err_vs_diffusers"] == 0.0


def test_report_tables_render_from_records():
    rows = [
        {"engine": "diffusers", "row": "diffusers eager", "case": "fwd:1024", "ms": 180.0, "host_ms": 150.0,
         "speedup_vs_diffusers": 1.0, "rel_err_vs_diffusers": 0.0},
        {"engine": "qwenfast", "row": "qwenfast FP8", "case": "fwd:1024", "ms": 90.0, "host_ms": 1.0,
         "speedup_vs_diffusers": 2.0, "rel_err_vs_diffusers": 0.013},
        {"engine": "qwenfast", "row": "qwenfast FP8 + fast cache", "case": "e2e:1024:50:cfg", "s": 3.0,
         "speedup_vs_diffusers": 6.0, "computed_fraction": 0.3},
        {"engine": "diffusers-torchao", "error": "killed at the limit"},
    ]  # fmt: skip
    rec = {"bench": "peers", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-25", "commit": "abc1234",
           "rows": rows, "same_weights": True, "not_run": [{"row": "X", "why": "why", "published": "1 s"}]}  # fmt: skip
    text = peers_table([Rec("peers.jsonl", 1, rec)])
    assert "| qwenfast FP8 | 90.0 ms (2.00×) |" in text
    assert "3.00 s (6.00×), 30% computed" in text
    assert "killed at the limit" in text and "**X**: why" in text
    assert "commit `abc1234`" in text
    base = {"bench": "diffusers_baseline", "gpu": "H100", "date": "2026-11-25", "commit": "abc1234", "mode": "alone",
            "fa3_installed": False, "ms": 184.4, "host_ms": 152.9, "ms_after_2s_idle": 185.7,
            "host_ms_after_2s_idle": 154.0}  # fmt: skip
    text = diffusers_baseline([Rec("diffusers_baseline.jsonl", 1, base)])
    assert "| diffusers alone, fresh process | no | — | 184.4 ms | 152.9 ms |" in text


def test_bench_peers_is_on_the_cli():
    from qwenfast.cli import build_parser

    a = build_parser().parse_args(["bench", "peers", "--smoke", "--case", "e2e:1024:4:nocfg", "--keep", "/tmp/x"])
    assert a.smoke and a.case == ["e2e:1024:4:nocfg"] and a.keep == "/tmp/x"


def test_published_record_is_complete():
    """The published peers record: same weights, diffusers eager in every case it has."""
    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "peers.jsonl"
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["same_weights"]
    cases = {r["case"] for r in rec["rows"] if "case" in r}
    assert {r["case"] for r in rec["rows"] if r.get("row") == "diffusers eager"} == cases
