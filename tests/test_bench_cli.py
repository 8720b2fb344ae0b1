"""`qwenfast bench quality` and `bench serve` on the CPU, as a newcomer runs them: a progress bar on
stderr while the suite runs, the record as the final JSON line, and bench serve at the model's own
size (it defaulted to 64x64 on the 128x128 demo and warned about its own default)."""

from __future__ import annotations

import json
import logging

import pytest

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
