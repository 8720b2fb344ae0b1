"""`qwenfast bench report`: the published tables, rendered from the benchmark records.

A figure in README.md or docs/ is published only if a record in bench/results/*.jsonl holds it: the
tables live between markers that this command rewrites from the records,

    <!-- report:end-to-end -->
    | ... rendered table ... |
    <!-- /report -->

and every rendered table ends with where its figures come from (date, commit, GPU, record file) and
the command that measures them again. `--check` rewrites nothing; it fails when a block differs from
its rendering (a hand-edited or stale figure), names an unknown table, or when a measured figure
(a time, a speed-up, GiB, TFLOP/s, img/s) stands outside a block, where no record backs it.
The tables themselves are in `report_tables.py`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .records import Rec, load

BLOCK = re.compile(r"<!-- report:([\w-]+) -->\n(.*?)<!-- /report -->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# a measured figure: 12.5 s, 116 ms, 1.43×, 1.4x, 38.1 GiB, 808 TFLOP/s, 0.95 img/s ("4 steps", "128×128" and
# "1024²" are settings, not figures)
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|s|GiB|TFLOP/s|TOP/s|img/s)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?\s?[×x](?![\w\d]|\s?\d)"
)


def default_root() -> Path:
    """The checkout holding README.md, docs/ and bench/results (this package's parent folder)."""
    return Path(__file__).resolve().parents[2]


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render_file(text: str, recs: list[Rec]) -> tuple[str, list[str]]:
    """`text` with every report block rendered from `recs`; problems (unknown table names)."""
    TABLES = tables()
    problems = []

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            problems.append(f"unknown table `{name}` (known: {', '.join(sorted(TABLES))})")
            return m.group(0)
        return f"<!-- report:{name} -->\n{TABLES[name](recs).rstrip()}\n<!-- /report -->"

    return BLOCK.sub(one, text), problems


def unrecorded_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) of measured figures outside report blocks, code blocks and code spans."""
    blanked = text
    for pat in (BLOCK, FENCE):  # keep line numbers: replace each match by as many newlines
        blanked = pat.sub(lambda m: "\n" * m.group(0).count("\n"), blanked)
    found = []
    for n, line in enumerate(blanked.splitlines(), 1):
        line = CODE_SPAN.sub("", line)
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
        found += [(n, m.group(0)) for m in FIGURE.finditer(line)]
    return found


def check(root: Path, results: Path) -> list[str]:
    """Problems with the published figures under `root` (empty: every figure has its record)."""
    recs = load(results)
    problems = []
    for path in doc_files(root):
        if not path.exists():
            continue
        rel = path.relative_to(root)
        text = path.read_text()
        rendered, probs = render_file(text, recs)
        problems += [f"{rel}: {p}" for p in probs]
        if rendered != text:
            for name, body in BLOCK.findall(text):
                want = dict(BLOCK.findall(rendered)).get(name)
                if want is not None and want != body:
                    problems.append(
                        f"{rel}: table `{name}` differs from its records: run `qwenfast bench report`"
                    )
        for line, fig in unrecorded_figures(text):
            problems.append(f"{rel}:{line}: figure `{fig}` outside a report table (no record backs it)")
    return problems


def write(root: Path, results: Path) -> list[Path]:
    """Render every block in place; the files that changed."""
    recs = load(results)
    changed = []
    for path in doc_files(root):
        if not path.exists():
            continue
        text = path.read_text()
        rendered, probs = render_file(text, recs)
        for p in probs:
            print(f"warning: {path}: {p}", file=sys.stderr)
        if rendered != text:
            path.write_text(rendered)
            changed.append(path)
    return changed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if a table is stale or a figure has no record",
    )
    p.add_argument("--root", default=None, help="the checkout with README.md and docs/ (default: this one)")
    p.add_argument("--results", default=None, help="the records' folder (default: ROOT/bench/results)")
    p.add_argument("--table", default=None, help="print one table to stdout (see --list) and exit")
    p.add_argument("--list", action="store_true", help="list the tables and where each is published")


def tables() -> dict:
    """Every published table by name (the tables import records and each other's helpers: no cycle)."""
    from .report_gpus import forward_split, gpu_estimates, gpu_played, memory_tiers, memory_tiers_held
    from .report_peers import diffusers_baseline, peers, peers_highres, peers_summary
    from .report_quality import TABLES as QUALITY
    from .report_serve import serve_mixed, serve_soak
    from .report_tables import TABLES

    return {
        **TABLES,
        **QUALITY,
        "peers": peers,
        "peers-highres": peers_highres,
        "serve-mixed": serve_mixed,
        "serve-soak": serve_soak,
        "peers-summary": peers_summary,
        "diffusers-baseline": diffusers_baseline,
        "gpu-estimates": gpu_estimates,
        "forward-split": forward_split,
        "gpu-played": gpu_played,
        "memory-tiers": memory_tiers,
        "memory-tiers-held": memory_tiers_held,
    }


def run_from_args(a: argparse.Namespace) -> int:
    TABLES = tables()
    root = Path(a.root) if a.root else default_root()
    results = Path(a.results) if a.results else root / "bench" / "results"
    if not results.is_dir():
        print(f"error: no records folder {results} (--results DIR)", file=sys.stderr)
        return 2
    if a.list:
        where = {n: [] for n in TABLES}
        for path in doc_files(root):
            if path.exists():
                for name, _ in BLOCK.findall(path.read_text()):
                    where.setdefault(name, []).append(str(path.relative_to(root)))
        for name in sorted(where):
            print(f"{name:22} {', '.join(where[name]) or '(not published)'}")
        return 0
    if a.table:
        if a.table not in TABLES:
            print(f"error: unknown table {a.table!r}; known: {', '.join(sorted(TABLES))}", file=sys.stderr)
            return 2
        print(TABLES[a.table](load(results)))
        return 0
    if a.check:
        problems = check(root, results)
        for p in problems:
            print(p)
        n = len(load(results))
        print(f"{'FAILED' if problems else 'ok'}: {len(problems)} problem(s); {n} records in {results}")
        print(json.dumps({"bench": "report_check", "problems": len(problems), "records": n}))
        return 1 if problems else 0
    changed = write(root, results)
    for path in changed:
        print(f"rendered {path.relative_to(root)}")
    print(json.dumps({"bench": "report", "changed": [str(p.relative_to(root)) for p in changed]}))
    return 0
