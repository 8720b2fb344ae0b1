"""Benchmark records as the report reads them: every line of bench/results/*.jsonl with its place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rec:
    """One benchmark record and where it is (`file`: the JSONL's name, `line`: 1-based)."""

    file: str
    line: int
    data: dict

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)


def load(results: Path) -> list[Rec]:
    """Every record of `results/*.jsonl`, file by file in name order, lines in order."""
    recs = []
    for path in sorted(Path(results).glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                recs.append(Rec(path.name, i, json.loads(line)))
    return recs
