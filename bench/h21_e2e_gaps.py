"""Session 12 (issue 18): where our Qwen-Image-2.1 end-to-end call (1024², 40 steps, bf16, full-size
random transformer and VAE, a tiny random text encoder) spends its wall time beyond the transformer's
kernels: one call's GPU timeline (kernel time by category, idle time between kernels and the kernel
pairs around the largest gaps) against its wall time. `python bench/h21_e2e_gaps.py [--steps 40]`
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from fp8_gaps import kernel_summary, timeline

from qwenfast.benchmarks.qwenimage21_e2e import PROMPT, build


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--text-encoder", default="tiny")
    a = p.parse_args()
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        _, ours, _ = build(dev, torch.bfloat16, a.text_encoder, Path(tmp))
        ours.set_progress_bar_config(disable=True)

        def call():
            return ours(prompt=PROMPT, height=1024, width=1024, output_type="np", num_inference_steps=a.steps,
                        generator=torch.Generator(dev).manual_seed(0)).images  # fmt: skip

        call()
        walls = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        ks = timeline(call)
    busy, gaps, pairs = kernel_summary(ks)
    big = sorted(((g, k0[2][:50], k1[2][:50]) for g, k0, k1 in zip(gaps, ks, ks[1:])), reverse=True)[:12]
    rec = {"what": "2.1 e2e timeline", "steps": a.steps, "wall_s": [round(w, 3) for w in walls],
           "span_ms": round((ks[-1][1] - ks[0][0]) / 1000, 1), "kernels": len(ks),
           "busy_ms": {k: round(v / 1000, 1) for k, v in busy.most_common()}, "idle_ms": round(sum(gaps) / 1000, 1),
           "idle_by_pair_ms": {f"{a_}->{b}": round(v / 1000, 1) for (a_, b), v in pairs.most_common(8)},
           "largest_gaps_ms": [(round(g / 1000, 3), n0, n1) for g, n0, n1 in big]}  # fmt: skip
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
