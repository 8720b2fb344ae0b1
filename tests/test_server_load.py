"""Load test: 200 requests from 16 concurrent clients, mixed sizes and prompt lengths, against one
live server (max batch 8) on the embedded tiny model. Every request must come back once, with its
own seed and prompt (0 lost, 0 duplicated), and every image must equal the same request run alone
(batch of one, straight through the pipeline). Tiny images and 2 steps keep it to seconds on CPU.

Equal means bit-identical or, where CPU BLAS is batch-variant inside the transformer (see
`test_server.py::test_batched_equals_alone`), one 8-bit level on < 0.1% of the values. The figures
are printed (run with `-s`).
"""

from __future__ import annotations

import base64
import io
import random
import statistics
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from qwenfast.server.app import create_app  # noqa: E402
from qwenfast.server.options import ServerConfig  # noqa: E402
from qwenfast.server.run import load_pipeline, start_server, stop_server  # noqa: E402
from tests.test_server import _one_torch_thread  # noqa: E402, F401  (autouse: one intra-op thread)

SIZES = [(32, 32), (48, 32), (32, 48), (64, 32), (64, 64)]
WORDS = "red blue small large cat dog house tree river moon over under a the with painting photo".split()
N_REQUESTS, N_CLIENTS = 200, 16


def load_requests(n: int = N_REQUESTS, seed: int = 0, first_seed: int = 1000) -> list[dict]:
    """n generation requests of mixed sizes and prompt lengths (also the Ray load test's)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        w, h = rng.choice(SIZES)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + f" #{k}"
        out.append({"prompt": prompt, "size": f"{w}x{h}", "steps": 2, "seed": first_seed + k})
    return out


def test_200_requests_16_clients(tmp_path):
    import torch

    pipe = load_pipeline(None, device="cpu", dtype="fp32")
    reqs = load_requests()
    app = create_app(pipe, ServerConfig(max_batch=8, max_queue=64, batch_wait_s=0.01))
    server, th, base = start_server(app)
    results: dict[int, httpx.Response] = {}
    latency: dict[int, float] = {}
    errors: list[str] = []
    todo = iter(range(N_REQUESTS))
    lock = threading.Lock()

    def client():
        with httpx.Client(base_url=base, timeout=120) as c:
            while True:
                with lock:
                    k = next(todo, None)
                if k is None:
                    return
                t = time.perf_counter()
                try:
                    r = c.post("/v1/images/generations", json=reqs[k])
                except httpx.HTTPError as e:
                    errors.append(f"{k}: {e!r}")
                    continue
                with lock:
                    assert k not in results
                    results[k], latency[k] = r, time.perf_counter() - t

    t0 = time.perf_counter()
    try:
        threads = [threading.Thread(target=client) for _ in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        hist = app.state.metrics.batch_size
        mean_batch = hist.sum / max(1, hist.count)
        depth = app.state.scheduler.depth()
    finally:
        stop_server(server, th)

    assert not errors, errors[:5]
    bad = {k: r.status_code for k, r in results.items() if r.status_code != 200}
    assert not bad, bad
    assert sorted(results) == list(range(N_REQUESTS)), "lost requests"
    assert depth == (0, 0, 0)
    images = {}
    for k, r in results.items():
        data = r.json()["data"]
        assert len(data) == 1 and data[0]["seed"] == reqs[k]["seed"], (
            f"request {k}: wrong or duplicated image"
        )
        im = Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"])))
        assert im.text["prompt"] == reqs[k]["prompt"] and im.text["seed"] == str(reqs[k]["seed"])
        assert f"{im.width}x{im.height}" == reqs[k]["size"]
        images[k] = np.asarray(im.convert("RGB"))
    assert len({im.tobytes() for im in images.values()}) == N_REQUESTS, "two requests got the same image"

    identical, off_by_one, worst = 0, 0, 0
    for k, q in enumerate(reqs):
        w, h = (int(v) for v in q["size"].split("x"))
        want = pipe(prompt=[q["prompt"]], negative_prompt=[" "], height=h, width=w, num_inference_steps=2,
                    generator=[torch.Generator("cpu").manual_seed(q["seed"])]).images[0]  # fmt: skip
        d = np.abs(images[k].astype(int) - np.asarray(want).astype(int))
        worst = max(worst, int(d.max()))
        assert d.max() <= 1 and (d > 0).mean() < 1e-3, f"request {k}: {int((d > 0).sum())} values differ"
        identical += int(d.max() == 0)
        off_by_one += int((d > 0).sum())
    lat = sorted(latency.values())
    print(f"\nload test: {N_REQUESTS} requests, {N_CLIENTS} clients, {wall:.1f} s, {N_REQUESTS / wall:.1f} img/s, "
          f"latency p50 {statistics.median(lat):.3f} s p95 {lat[int(0.95 * (len(lat) - 1))]:.3f} s, "
          f"mean batch {mean_batch:.2f}; 0 lost, 0 duplicated; {identical}/{N_REQUESTS} bit-identical to alone, "
          f"{off_by_one} values off by one level elsewhere (max diff {worst})")  # fmt: skip


def test_bench_serve_writes_results_only_with_results_flag(tmp_path, monkeypatch, capsys):
    """`qwenfast bench serve` (CPU smoke) run from any folder leaves no bench/results behind; only
    `--results DIR` writes DIR/serve.jsonl. The other benchmarks' `--results` default to nothing too."""
    import json

    from qwenfast.cli import build_parser, main

    for what in ("transformer", "serve", "pipeline", "quality"):
        assert build_parser().parse_args(["bench", what]).results is None, what
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    args = ["bench", "serve", "--size", "32", "--steps", "1", "--concurrency", "1", "--requests", "1",
            "--no-baseline", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["bench"] == "serve" and record["levels"][0]["errors"] == 0
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    assert main([*args, "--results", "out"]) == 0
    lines = (tmp_path / "out" / "serve.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["bench"] == "serve"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "serve.jsonl"]
