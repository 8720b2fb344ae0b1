"""The published figures and the tree: every figure has a record, the tree speaks of the project alone.

- `qwenfast bench report --check` on this checkout: each table in README.md and docs/ equals its rendering
  from bench/results, and no measured figure stands outside a table;
- the report machinery itself on a scratch tree (a stale table, a figure without a record, an unknown table
  are each caught);
- no label of who worked when (periods of work, tracker numbers) anywhere in the tracked tree (records included);
- bench/ stays a small, documented tool; every record names its date, commit and GPU.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from qwenfast.benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# Labels that name who worked when, not what the project is: a period of work or a tracker number.
# (Spelled in pieces so that this file does not match itself.)
LABEL = re.compile(
    r"\b(?:sess" r"ion|iss" r"ue|spr" r"int|mile" r"stone|itera" r"tion)[ _-]?#?\d+"
    r"|\bgpu_(?:iss" r"ue|sess" r"ion)\w*|\bwork[ -]peri" r"od\b",
    re.I,
)


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):  # an exported tree without .git: every file but caches
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_published_figures_have_records():
    problems = report.check(ROOT, RESULTS)
    assert not problems, "\n".join(problems[:40]) + "\n(run `qwenfast bench report`, or move the figure into a table)"


def test_every_table_is_published_and_every_block_known():
    TABLES = report.tables()

    used = set()
    for path in report.doc_files(ROOT):
        used |= {name for name, _ in report.BLOCK.findall(path.read_text())}
    assert used <= set(TABLES), used - set(TABLES)
    assert set(TABLES) - used == set(), f"tables rendered nowhere: {set(TABLES) - used}"


def _scratch(tmp_path: Path, doc: str, records: list[dict]) -> tuple[Path, Path]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n")
    (tmp_path / "docs" / "page.md").write_text(doc)
    res = tmp_path / "results"
    res.mkdir()
    (res / "serve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path, res


SERVE = {"bench": "serve", "model": "random-full", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-25T10:00Z",
         "commit": "abc1234", "size": 1024, "steps": 8,
         "levels": [{"concurrency": 1, "max_batch": 8, "images_per_s": 0.5, "p50_s": 2.0, "p95_s": 2.1,
                     "speedup_vs_sequential": 1.0},
                    {"concurrency": 8, "max_batch": 8, "images_per_s": 0.9, "p50_s": 8.0, "p95_s": 8.5,
                     "speedup_vs_sequential": 1.8}]}  # fmt: skip


def test_report_renders_blocks_and_check_catches_stale_unknown_and_unrecorded(tmp_path):
    root, res = _scratch(tmp_path, "Intro.\n\n<!-- report:serve -->\nold\n<!-- /report -->\n", [SERVE])
    assert any("differs from its records" in p for p in report.check(root, res))
    assert report.write(root, res) == [root / "docs" / "page.md"]
    text = (root / "docs" / "page.md").read_text()
    assert "0.90 img/s" in text and "1.80×" in text and "commit `abc1234`" in text and "H100" in text
    assert report.check(root, res) == []
    # a record changes: the rendered table is stale until rendered again
    (res / "serve.jsonl").write_text(json.dumps({**SERVE, "date": "2026-11-26", "commit": "def5678"}) + "\n")
    assert any("`serve` differs" in p for p in report.check(root, res))
    report.write(root, res)
    assert "commit `def5678`" in (root / "docs" / "page.md").read_text()
    # a hand-written figure outside a table, and an unknown table
    with open(root / "docs" / "page.md", "a") as f:
        f.write("\nIt is 2.5× faster and takes 12.3 s, 4 steps at 128×128 in `0.5 s` code.\n"
                "<!-- report:no-such-table -->\n<!-- /report -->\n")  # fmt: skip
    probs = report.check(root, res)
    figs = sorted(p.split("figure ")[1].split(" ")[0] for p in probs if "figure" in p)
    assert figs == ["`12.3", "`2.5×`"], probs  # settings (4 steps, 128×128) and code spans are not figures
    assert any("unknown table `no-such-table`" in p for p in probs)


def test_figure_pattern():
    found = [f for _, f in report.unrecorded_figures(
        "a 1.43× speed-up, 116 ms, 0.95 img/s, 38.1 GiB, 808 TFLOP/s, 1.4x\n"
        "not: 1024², 128×128, 1024 x 1024, 4 steps, 50 steps, sm_90, 2x2 grid, `9.9 ms`, [a](b/1.5s)\n"
        "```\n12 s in a code block\n```\n")]  # fmt: skip
    assert found == ["1.43×", "116 ms", "0.95 img/s", "38.1 GiB", "808 TFLOP/s", "1.4x"]


def test_no_work_period_or_tracker_labels_in_the_tree():
    hits = []
    for path in _tracked():
        if not path.is_file() or path.suffix in {".png", ".jpg", ".safetensors", ".onnx", ".bin", ".gz", ".whl"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = LABEL.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "identify figures by date, commit, device and command instead:\n" + "\n".join(hits[:40])


def test_label_pattern_catches_the_usual_forms():
    for s in ("sess" "ion 9", "Sess" "ion12", "iss" "ue 16", "iss" "ue #21", "iss" "ue18.jsonl", "gpu_" "iss" "ue16_b.sh",
              "gpu_" "sess" "ion11_e.sh", "spr" "int 3"):  # fmt: skip
        assert LABEL.search(s), s
    for s in ("a session of the server", "issues with masks", "iteration over the blocks", "tis" "sue 4"):
        assert not LABEL.search(s), s


def test_bench_is_a_small_documented_tool():
    files = [p for p in (ROOT / "bench").rglob("*") if p.is_file() and "results" not in p.relative_to(ROOT).parts]
    assert len(files) <= 25, sorted(str(p) for p in files)
    readme = (ROOT / "bench" / "README.md").read_text()
    for p in files:
        if p.suffix == ".sh" and p.name != "env.sh":
            head = p.read_text().split("\nsource", 1)[0]
            assert "#" in head and re.search(r"H100|H200|GPU", head) and "minute" in head, p.name  # what, GPU, time
            assert f"`{p.name}`" in readme, p.name
        elif p.suffix == ".py":
            doc = p.read_text().split('"""')[1]
            assert re.search(r"GPU|CPU|any", doc) and re.search(r"minute", doc), p.name
            assert f"`{p.name}`" in readme, p.name


def test_every_record_says_when_where_and_at_which_commit():
    n = 0
    for rec in report.load(RESULTS):
        n += 1
        where = f"{rec.file}:{rec.line}"
        assert re.match(r"\d{4}-\d{2}-\d{2}", str(rec.get("date", ""))), where
        assert re.match(r"[0-9a-f]{7}|v\d", str(rec.get("commit", ""))), where
        assert rec.get("gpu") or rec.get("device"), where
    assert n > 100


@pytest.mark.parametrize("page", ["models", "tasks", "diffusers", "speed", "memory", "multi-gpu", "serving",
                                  "comfyui", "export", "benchmarks", "quality", "architecture"])  # fmt: skip
def test_docs_pages_exist_and_the_readme_stays_short(page):
    assert (ROOT / "docs" / f"{page}.md").is_file()
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert f"docs/{page}.md" in readme or page == "diffusers" and "docs/diffusers.md" in readme
