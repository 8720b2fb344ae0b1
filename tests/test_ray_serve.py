"""qwenfast serve on Ray Serve (qwenfast/server/ray_app.py), CPU, on a real local Ray cluster of 2 simulated
nodes (the `ray_serve` fixture of conftest.py) with the embedded demo model.

- the official `openai` client: generations (API key on), edits and streaming, images equal to the
  pipeline run directly;
- 200 requests from 16 clients with mixed sizes while one engine replica's process is SIGKILLed: every
  request answered once (0 lost, 0 duplicated, retried ones included), every image equal to the same
  request run alone, both replicas served (per-replica /metrics), Ray brings the replica back and
  /health shows it;
- graceful drain: deleting the app lets queued and running requests finish;
- the router's ranking, the deployment options (autoscaling on queue depth) and the `serve run` config.
The hostile-request suite runs against a Ray endpoint in test_server_hostile.py (its `backend` param).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from qwenfast.server.options import Limits, ServerConfig  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from tests.test_server import (  # noqa: E402
    _image_bytes,
    _one_torch_thread,  # noqa: E402, F401  (autouse: one intra-op thread)
    alone,
    assert_same_image,
    metric,
    png_pixels,
)
from tests.test_server_load import load_requests  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "ray-s3cret"
G = "/v1/images/generations"
FLAGS = {"device": "cpu", "dtype": "fp32", "replicas": 2, "num_cpus": 0.5, "ingress_cpus": 0.25,
         "max_replicas_per_node": 1, "max_batch": 8, "batch_wait_ms": 10, "api_key": KEY}  # fmt: skip
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def main(ray_serve):
    """Base URL of a 2-replica app (one engine per node), API key on."""
    return ray_serve.deploy("main", FLAGS, prefix="/main")


def _health(base):
    return httpx.get(base + "/health", timeout=10).json()


def _wait(cond, timeout=120.0, what=""):
    """Poll `cond` until true: a hang guard counted in polls (timeout/0.25 of them), not a wall-clock limit."""
    for _ in range(int(timeout / 0.25)):
        if cond():
            return
        time.sleep(0.25)
    assert cond(), f"not reached in {int(timeout / 0.25)} polls: {what}"


# ------------------------------------------------------------------ no cluster needed
def _replica(rid, stats=None):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats or {})


def test_router_joins_a_forming_batch_only_when_every_replica_is_busy():
    import threading as th

    from qwenfast.server.ray_router import BatchAffinityRouter

    r = object.__new__(BatchAffinityRouter)  # the ranking alone; Ray's router machinery is not needed
    r.max_batch, r.sent, r.lock = 4, {}, th.Lock()
    queue_lens = {}
    r._replica_queue_len_cache = SimpleNamespace(get=lambda rid: queue_lens.get(rid.unique_id))
    a, b, c = _replica("a"), _replica("b", {"keys": {"K": 1}}), _replica("c")
    queue_lens.update(a=0, b=3, c=2)
    assert r.rank([a, b, c], "K") == [[a, b, c]]  # an idle replica: run alone there (least-loaded)
    queue_lens.update(a=5)
    assert r.rank([a, b, c], "K") == [[b], [a, b, c]]  # all busy: join b's forming batch of K
    assert r.rank([a, b, c], "other") == [[a, b, c]]  # nothing of that key is forming anywhere
    queue_lens.update(b=9)
    assert r.rank([a, b, c], "K") == [[a, b, c]]  # b is over a batch busier than c: not worth it
    b.routing_stats = {"keys": {"K": 4}}
    queue_lens.update(b=3)
    assert r.rank([a, b, c], "K") == [[a, b, c]]  # b's batch of K is full already
    r.sent = {"req1": ("c", "K")}  # what the router itself just sent counts before the stats say so
    assert r.rank([a, b, c], "K") == [[c], [a, b, c]]
    assert r.rank([a, b, c], "") == [[a, b, c]]  # edits carry no key: never batched


def test_flags_config_file_and_deployment_options():
    import yaml

    from qwenfast.server.options import config_from_args
    from qwenfast.server.ray_app import args_from_dict, engine_options

    a = args_from_dict({"device": "cpu", "autoscale": "1:4", "max_batch": 6, "max_queue": 10})
    cfg = config_from_args(a)
    eng = engine_options(a, cfg)
    assert eng["autoscaling_config"]["target_ongoing_requests"] == 6  # queue depth per replica: one batch
    assert (eng["autoscaling_config"]["min_replicas"], eng["autoscaling_config"]["max_replicas"]) == (1, 4)
    assert eng["max_ongoing_requests"] == 16 and eng["ray_actor_options"]["num_gpus"] == 0
    assert "num_replicas" not in eng
    gpu = engine_options(args_from_dict({"replicas": 3}), cfg)
    assert gpu["num_replicas"] == 3 and gpu["ray_actor_options"]["num_gpus"] == 1
    with pytest.raises(SystemExit):
        args_from_dict({"autoscale": "4:1"})
    for name in ("ray-serve.yaml", "kuberay-rayservice.yaml"):
        doc = yaml.safe_load((ROOT / "deploy" / name).read_text())
        if "spec" in doc:
            doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
        (app,) = doc["applications"]
        assert app["import_path"] == "qwenfast.server.ray_app:build_app"
        a = args_from_dict(app["args"])  # the same parser as `qwenfast serve`: every key is a real flag
        assert a.autoscale == (1, 4) and a.num_gpus == 1 and a.model.startswith("/models/")


def test_serve_ray_flags_need_ray_and_parallel_is_not_there_yet():
    from qwenfast.cli import main

    assert main(["serve", "--replicas", "2", "--device", "cpu"]) == 2
    assert main(["serve", "--ray", "--parallel", "ulysses=2", "--device", "cpu"]) == 2


def test_engine_replica_alone_streams_events_then_its_image_and_checks_health(pipe):
    """The engine deployment's class, outside Ray: a job's events, then the image the pipeline gives alone;
    its stats count it; its health check fails once the batcher's worker has stopped."""
    import asyncio

    from qwenfast.server.options import config_from_args
    from qwenfast.server.ray_app import EngineReplica, args_from_dict
    from qwenfast.server.schemas import validate

    a = args_from_dict({"device": "cpu", "dtype": "fp32"})
    eng = EngineReplica(a, config_from_args(a))
    desc = eng.describe()
    assert desc["is_edit"] is False and desc["lora_support"] and desc["vae_scale_factor"] == 8
    p = validate({"prompt": "a red cat", "size": "32x32", "steps": 2, "seed": 5}, Limits(), eng.pipe.defaults, multiple=16)

    async def run():
        return [ev async for ev in eng.generate({"params": p, "kind": "t2i", "loras": (), "images": None}, key="k")]

    events = asyncio.run(run())
    kinds = [e["type"] for e in events]
    assert kinds == ["image_generation.started"] + ["image_generation.progress"] * 2 + ["result"], kinds
    assert_same_image(np.asarray(events[-1]["images"][0]), alone(pipe, "a red cat", 5, 32, 32), "engine")
    stats = eng.record_routing_stats()
    assert (stats["images_total"], stats["queue"], stats["running"]) == (1, 0, 0)
    eng.check_health()
    eng.sched.stop(10)
    with pytest.raises(RuntimeError, match="worker thread"):
        eng.check_health()


# ------------------------------------------------------------------ on the cluster
def test_openai_client_auth_page_edits_and_streaming(main, ray_serve, pipe, tmp_path_factory):
    openai = pytest.importorskip("openai")
    assert httpx.post(main + G, json={"prompt": "x"}).status_code == 401  # the same auth rule
    assert httpx.get(main + "/").status_code == 200 and "<title>qwenfast</title>" in httpx.get(main + "/").text
    h = _health(main)
    assert h["replicas"]["up"] == h["replicas"]["total"] == 2 and h["replicas"]["nodes"] == 2, h
    cl = openai.OpenAI(base_url=main + "/v1", api_key=KEY, max_retries=0)
    r = cl.images.generate(prompt="a red cat", size="48x32", n=2, extra_body={"steps": 2, "seed": 11})
    for i, d in enumerate(r.data):
        assert_same_image(png_pixels(d.b64_json), alone(pipe, "a red cat", 11 + i, 48, 32), f"image {i}")
    r = cl.images.generate(prompt="a red cat", size="32x32", response_format="url", extra_body={"steps": 1})
    assert httpx.get(r.data[0].url).status_code == 200  # /files is served by the (single) ingress
    kinds = []
    for ev in cl.images.generate(prompt="a red cat", size="64x64", stream=True, partial_images=2,
                                 extra_body={"steps": 6, "seed": 3}):  # fmt: skip
        kinds.append(ev.type)
        if ev.type == "image_generation.completed":
            final = png_pixels(ev.b64_json)
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert_same_image(final, alone(pipe, "a red cat", 3, 64, 64, steps=6), "streamed")
    with pytest.raises(openai.BadRequestError, match="multiples of 16"):
        cl.images.generate(prompt="x", size="50x64")
    # inpainting (OpenAI mask: transparent = repaint) runs in a replica with the mask: the local pipeline's image
    from PIL import ImageDraw

    from tests.test_server_inpaint import _alpha_mask, _png

    src = Image.fromarray(alone(pipe, "a small red circle at the top left, blue background", 1, 64, 64))
    r = cl.images.edit(image=("in.png", _png(src), "image/png"), mask=("m.png", _alpha_mask((64, 64), (32, 32, 63, 63)),
                       "image/png"), prompt="a large yellow square, blue background", extra_body={"steps": 3, "seed": 9})  # fmt: skip
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((32, 32, 63, 63), fill=255)
    import torch

    want = pipe.for_task("inpaint")("a large yellow square, blue background", negative_prompt=" ", image=src,
                                    mask_image=mask, strength=1.0, height=64, width=64, num_inference_steps=3,
                                    generator=torch.Generator("cpu").manual_seed(9))  # fmt: skip
    assert_same_image(png_pixels(r.data[0].b64_json), np.asarray(want.images[0]), "inpaint through Ray")

    from tests.test_server_hostile import DEMO_EDIT, RAY_FLAGS, RAY_PREFIX  # the hostile suite's edit app

    d = tmp_path_factory.mktemp("loras-edit")
    lim = Limits(max_upload_bytes=256 << 10, max_json_bytes=64 << 10, max_prompt_chars=1000)
    edit = ray_serve.deploy("hostile-edit", {**RAY_FLAGS, "model": str(DEMO_EDIT), "lora_dir": str(d)},
                            ServerConfig(lora_dir=str(d), limits=lim), prefix=RAY_PREFIX["hostile-edit"])  # fmt: skip
    img = _image_bytes("JPEG", (48, 40))
    ecl = openai.OpenAI(base_url=edit + "/v1", api_key="x", max_retries=0)
    r = ecl.images.edit(image=("a.jpg", img, "image/jpeg"), prompt="make it blue", size="32x32",
                        extra_body={"steps": 2, "seed": 4})  # fmt: skip
    epipe = load_pipeline(str(DEMO_EDIT), device="cpu", dtype="fp32")
    import torch

    want = epipe(image=[Image.open(io.BytesIO(img)).convert("RGB")], prompt="make it blue", negative_prompt=" ",
                 height=32, width=32, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(4))  # fmt: skip
    assert_same_image(png_pixels(r.data[0].b64_json), np.asarray(want.images[0]), "edit")


def _replica_images(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("qwenfast_replica_images_generated_total{"):
            out[line.split('replica="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_200_requests_16_clients_with_a_replica_killed(main, pipe):
    reqs, n_clients = load_requests(200, first_seed=5000), 16
    results: dict[int, list] = {}
    latency: dict[int, float] = {}
    errors: list[str] = []
    todo = iter(range(len(reqs)))
    lock = threading.Lock()
    killed: dict = {}

    def client():
        with httpx.Client(base_url=main, timeout=300, headers=AUTH) as c:
            while True:
                with lock:
                    k = next(todo, None)
                if k is None:
                    return
                t = time.perf_counter()
                try:
                    r = c.post(G, json=reqs[k])
                except httpx.HTTPError as e:
                    errors.append(f"{k}: {e!r}")
                    continue
                with lock:
                    results.setdefault(k, []).append(r)
                    latency[k] = time.perf_counter() - t

    def killer():
        """Once 40 answers are in, SIGKILL the engine process with the most work on it."""
        _wait(lambda: len(results) >= 40 or not any(t.is_alive() for t in threads), 600, "40 answers")
        _wait(lambda: all(x["pid"] for x in _health(main)["replicas"]["list"]), 60, "replica stats")
        reps = _health(main)["replicas"]["list"]
        victim = max(reps, key=lambda x: (x["queue"] or 0) + (x["running"] or 0))
        killed.update(victim, busy=(victim["queue"] or 0) + (victim["running"] or 0), at=len(results))
        os.kill(victim["pid"], signal.SIGKILL)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    kt = threading.Thread(target=killer)
    kt.start()
    for t in threads:
        t.join()
    kt.join()
    wall = time.perf_counter() - t0

    assert not errors, errors[:5]
    assert killed.get("pid"), "no replica was killed"
    assert sorted(results) == list(range(len(reqs))), "lost requests"
    assert all(len(v) == 1 for v in results.values()), "a request answered twice"
    bad = {k: (v[0].status_code, v[0].text[:200]) for k, v in results.items() if v[0].status_code != 200}
    assert not bad, bad
    images = {}
    for k, (r,) in results.items():
        (d,) = r.json()["data"]
        assert d["seed"] == reqs[k]["seed"], f"request {k}: someone else's image"
        im = Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))
        assert im.text["prompt"] == reqs[k]["prompt"] and f"{im.width}x{im.height}" == reqs[k]["size"]
        images[k] = np.asarray(im.convert("RGB"))
    assert len({im.tobytes() for im in images.values()}) == len(reqs), "two requests got the same image"

    text = httpx.get(main + "/metrics").text
    retries = metric(text, "qwenfast_ray_retries_total")
    assert retries >= 1, f"the killed replica had {killed['busy']} requests, none was retried"
    assert metric(text, 'qwenfast_requests_total{endpoint="generations",status="200"}') >= len(reqs)
    served = _replica_images(text)
    assert served.get(killed["id"], 0) > 0 and sum(1 for v in served.values() if v > 0) >= 2, served

    # Ray replaces the killed replica; /health counts it back
    _wait(lambda: (h := _health(main)["replicas"])["up"] == 2 and killed["id"] not in {x["id"] for x in h["list"]},
          240, "the replacement replica")  # fmt: skip
    h = _health(main)
    assert h["status"] == "ok" and h["replicas"]["total"] == 2 and h["ray_retries"] == retries, h
    assert httpx.post(main + G, json={**reqs[0], "seed": 1}, headers=AUTH, timeout=120).status_code == 200

    worst, identical, off = 0, 0, 0
    for k, q in enumerate(reqs):  # every image equals the same request run alone, retried ones included
        w, hh = (int(v) for v in q["size"].split("x"))
        d = np.abs(images[k].astype(int) - alone(pipe, q["prompt"], q["seed"], w, hh).astype(int))
        # CPU BLAS is batch-variant inside the transformer (test_server.py::test_batched_equals_alone): in
        # batches of up to 8 mixed by two replicas, one 8-bit level on a few values (~0.1% of a 32x48 image)
        assert d.max() <= 1 and (d > 0).mean() < 5e-3, f"request {k}: max diff {d.max()}, {(d > 0).sum()} values"
        worst, identical, off = max(worst, int(d.max())), identical + int(d.max() == 0), off + int((d > 0).sum())
    lat = sorted(latency.values())
    print(f"\nray serve load test: {len(reqs)} requests, {n_clients} clients, 2 replicas on 2 nodes, {wall:.1f} s, "
          f"{len(reqs) / wall:.1f} req/s, p50 {statistics.median(lat):.3f} s, p95 {lat[int(0.95 * (len(lat) - 1))]:.3f} s; "
          f"replica {killed['id']} killed after {killed['at']} answers with {killed['busy']} requests on it: "
          f"{int(retries)} retried; 0 lost, 0 duplicated; {identical}/{len(reqs)} bit-identical to alone, {off} values "
          f"off by one elsewhere (max diff {worst}); images per replica {served}")  # fmt: skip


def test_graceful_drain_when_the_app_is_deleted(main, ray_serve):
    """Deleting the app (what SIGTERM of `qwenfast serve --ray` does) while 3 requests are queued or
    running: Ray stops routing new ones, waits for those, and each gets its image."""
    res = []
    body = {"prompt": "a lighthouse", "size": "64x64", "steps": 40}
    ts = [threading.Thread(target=lambda s=s: res.append(httpx.post(main + G, json={**body, "seed": s}, headers=AUTH,
                                                                    timeout=300))) for s in range(3)]  # fmt: skip
    for t in ts:
        t.start()
    _wait(lambda: (q := _health(main)["queue"])["requests"] + q["running"] == 3, 120, "3 requests in")
    ray_serve.delete("main")
    for t in ts:
        t.join()
    assert [r.status_code for r in res] == [200] * 3 and all(len(r.json()["data"]) == 1 for r in res)


def test_cli_serve_ray_serves_and_drains_on_sigterm(tmp_path):
    """`qwenfast serve --ray` starts its own local Ray cluster, serves, and on SIGTERM lets a running
    request finish before it exits 0."""
    import subprocess
    import sys

    from tests.test_server import _free_port

    port, log = _free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # not the session's cluster
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qwenfast.cli", "serve", "--ray", "--device", "cpu", "--dtype", "fp32",
                             "--replicas", "1", "--num-cpus", "0.5", "--ingress-cpus", "0.25", "--port", str(port),
                             "--api-key", KEY], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _up(base), 240, f"the server ({log.read_text()[-2000:]})")
        assert _health(base)["replicas"]["up"] == 1
        res = []
        slow = threading.Thread(target=lambda: res.append(httpx.post(base + G, headers=AUTH, timeout=300,
                                json={"prompt": "a lighthouse", "size": "64x64", "steps": 40})))  # fmt: skip
        slow.start()
        _wait(lambda: (q := _health(base)["queue"])["requests"] + q["running"] == 1, 60, "the request")
        proc.send_signal(signal.SIGTERM)
        slow.join()
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert res[0].status_code == 200 and len(res[0].json()["data"]) == 1
    assert "draining" in log.read_text()


def _up(base) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
