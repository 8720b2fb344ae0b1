"""Choose the step-cache presets: score candidate policies on the demo model's held-out suites at 50
steps with CFG (text-to-image 120 prompts, edits 36), against the uncached images of the same seeds.
Runs on any device (CPU: about 40 minutes; one H100 / H200: about 5).

    python bench/cache_sweep.py [--device cuda] [--results DIR]

Prints one line per (suite, policy) and a JSON record (quality.jsonl under --results).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwenfast.runtime.cache import CachePolicy

CANDIDATES = [
    CachePolicy(kind="static", warmup=3, tail=2, every=2, taylor=0, name="s-w3t2e2"),
    CachePolicy(kind="static", warmup=3, tail=2, every=2, taylor=1, name="s-w3t2e2-taylor"),
    CachePolicy(kind="static", warmup=2, tail=1, every=3, taylor=0, name="s-w2t1e3"),
    CachePolicy(kind="static", warmup=2, tail=1, every=3, taylor=1, name="s-w2t1e3-taylor"),
    CachePolicy(kind="static", warmup=4, tail=2, every=3, taylor=1, name="s-w4t2e3-taylor"),
    CachePolicy(kind="static", warmup=2, tail=1, every=4, taylor=1, name="s-w2t1e4-taylor"),
    CachePolicy(kind="adaptive", threshold=0.05, taylor=1, name="a-0.05-taylor"),
    CachePolicy(kind="adaptive", threshold=0.15, taylor=1, name="a-0.15-taylor"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None)
    ap.add_argument("--results", default=None)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    from qwenfast.benchmarks import emit, versions
    from qwenfast.demo.bench import quality_cache

    rec = {"bench": "cache_sweep", **versions(), "steps": a.steps}
    for model in (None, "edit"):
        print(f"== {model or 't2i'}", flush=True)
        rec[model or "t2i"] = quality_cache(model, tuple(CANDIDATES), device=a.device, steps=a.steps)
    emit(rec, "quality.jsonl", Path(a.results) if a.results else None)
    print(json.dumps({k: v for k, v in rec.items() if k in ("t2i", "edit")})[:2000])


if __name__ == "__main__":
    main()
