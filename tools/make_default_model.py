"""Build the embedded default model: a tiny Qwen-Image-architecture checkpoint with RANDOM weights.

It is saved by diffusers in the real Hugging Face layout and loaded by qwenfast's normal loader, so
`qwenfast generate "..."` works on a fresh CPU machine. A later step replaces it with a trained demo
model. Needs the [test] extra (diffusers).

    python tools/make_default_model.py [--out tests/assets/tiny-random]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from qwenfast.testing.tiny import build_tiny_pipeline

DEFAULTS = {"height": 256, "width": 256, "num_inference_steps": 20, "true_cfg_scale": 4.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/assets/tiny-random"))
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    build_tiny_pipeline(out, seed=0)
    note = {
        "description": "Tiny Qwen-Image-architecture model with RANDOM weights (qwenfast embedded default). "
        "It shows that the engine runs end to end; its pictures are noise-like.",
        "built_by": "tools/make_default_model.py (seed 0)",
        "defaults": DEFAULTS,
    }
    (out / "qwenfast.json").write_text(json.dumps(note, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
