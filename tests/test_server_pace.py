"""The scheduler's step pace and its work rule (server/batcher.py: `StepPace`, `work`).

`StepPace` keeps the host a fixed number of steps ahead of the GPU, so that decisions made in a batch's
step callback (interleaving shorter requests, progress events) happen while the batch runs; checked
here with recorded fake events (the CUDA event is the same protocol). `work` makes "shorter" mean GPU
work: a small image with as many steps as a large batch has left runs inside it, which a step count
alone refused.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwenfast.server.pace import StepPace, work  # noqa: E402
from qwenfast.server.run import load_pipeline  # noqa: E402
from qwenfast.server.schemas import Params  # noqa: E402
from tests.test_server import (  # noqa: E402, F401
    OK,
    G,
    GatedPipe,
    Senders,
    _one_torch_thread,
    alone,
    assert_same_image,
    png_pixels,
    running,
)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None, device="cpu", dtype="fp32")


class FakeEvent:
    """Records when it was recorded and waited on, in one shared log."""

    log: list[tuple[str, int]] = []
    made = 0

    def __init__(self):
        self.n = FakeEvent.made
        FakeEvent.made += 1

    def record(self):
        FakeEvent.log.append(("record", self.n))

    def synchronize(self):
        FakeEvent.log.append(("wait", self.n))


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_step_pace_waits_for_the_step_lag_steps_back(lag):
    """Call k (after step k was queued) records event k and waits for event k - lag, so the GPU keeps
    `lag` steps queued and the host is never further ahead; each event is waited on once."""
    FakeEvent.log, FakeEvent.made = [], 0
    pace = StepPace(FakeEvent, lag=lag)
    for k in range(6):
        pace()
        waited = [n for what, n in FakeEvent.log if what == "wait"]
        assert waited == list(range(max(0, k - lag + 1))), (k, FakeEvent.log)
        assert FakeEvent.log[-1] == (("wait", k - lag) if k >= lag else ("record", k))
    assert len(pace.queued) == lag


def test_step_pace_without_cuda_does_nothing():
    pace = StepPace(None)
    for _ in range(3):
        pace()
    assert not pace.queued


def test_work_counts_pixels_rows_steps_and_cfg():
    p = Params(prompt="a", negative=None, width=64, height=32, steps=4, cfg=4.0, n=1, seed=0)
    assert work(p, 1, 4) == 64 * 32 * 4
    assert work(p, 3, 2) == 64 * 32 * 3 * 2
    q = Params(
        prompt="a", negative=" ", width=64, height=32, steps=4, cfg=4.0, n=1, seed=0
    )  # true CFG: two forwards
    assert work(q, 1, 4) == 2 * work(p, 1, 4)
    r = Params(
        prompt="a", negative=" ", width=64, height=32, steps=4, cfg=1.0, n=1, seed=0
    )  # scale 1: one forward
    assert work(r, 1, 4) == work(p, 1, 4)


def test_may_run_inside_by_work_per_image_or_shorter_class():
    """`may_run_inside` on the mixed load's shapes: a 4-step 1328² image enters an 8-step batch of four
    928x1664 images with two steps left (more than each image's two steps, less than the batch's eight
    image-steps: a shorter class), but not a 4-step batch of two 1664x928 images with one step left
    (as many steps: only the work per image counts); an 8-step 1024² image never enters a 4-step batch of
    two 1664x928 images past their first step (more steps, more work than each image has left), even
    though it is less than the batch has left in all."""
    from qwenfast.server.pace import may_run_inside

    def P(w, h, steps):
        return Params(prompt="a", negative=None, width=w, height=h, steps=steps, cfg=1.0, n=1, seed=0)

    four_1328 = P(1328, 1328, 4)
    assert may_run_inside(four_1328, P(928, 1664, 8), 4, 2)
    assert not may_run_inside(four_1328, P(928, 1664, 8), 1, 2)  # one image: more than its two steps
    assert not may_run_inside(four_1328, P(1664, 928, 4), 2, 1)
    assert may_run_inside(P(1024, 1024, 4), P(1664, 928, 4), 2, 3)  # Smith's rule: less than each image's
    eight = P(1024, 1024, 8)
    assert work(eight, 1, 8) < work(P(1664, 928, 4), 2, 3)  # less than the batch's total ...
    assert not may_run_inside(eight, P(1664, 928, 4), 2, 3)  # ... but more steps: it waits
    assert may_run_inside(eight, P(1664, 928, 50), 1, 10)  # a long batch: by the work per image


def test_a_small_request_runs_inside_a_larger_batch_with_as_many_steps_left(pipe):
    """A 3-step 32x32 request queued during the first step of a 4-step 64x64 batch (3 steps left): as
    many steps, a quarter of the pixels, so a quarter of the work; it runs between two of the long batch's
    steps and is answered first (by step count alone it waited for the whole batch). Images as alone."""
    gated = GatedPipe(pipe)
    with running(gated, max_batch=4) as (base, app):
        gated.gate.clear()
        send = Senders(base)
        send.start("long", {**OK, "seed": 3, "steps": 4, "size": "64x64"})
        assert gated.entered.wait(30)
        send.start("small", {**OK, "seed": 5, "steps": 3}, queued=1)
        gated.gate.set()
        send.join()
        interleaved = app.state.metrics.interleaved
    assert interleaved == 1 and send.done == ["small", "long"] and gated.steps == [3, 4], send.done
    for k, seed, steps, side in (("long", 3, 4, 64), ("small", 5, 3, 32)):
        assert send.res[k].status_code == 200
        got = png_pixels(send.res[k].json()["data"][0]["b64_json"])
        assert_same_image(got, alone(pipe, OK["prompt"], seed, side, side, steps=steps), k)


@pytest.mark.parametrize(
    "steps, side, enters", [(6, 48, False), (5, 48, True), (3, 80, True), (3, 96, False)]
)
def test_a_request_enters_a_batch_of_two_by_the_work_it_has_left(pipe, steps, side, enters):
    """A request queued during the first step of a 4-step batch of two 64x64 images (3 steps left: 12,288
    pixels each, 24,576 in all). As many steps or more: it runs inside only when it is less work than each
    of the batch's images has left (running it first would delay two images by more than it saves one):
    6 steps at 48x48 (13,824) waits, 5 steps (11,520) runs inside. Fewer steps: it runs inside when it is
    less work than the batch has left in all, though more than each image has: 3 steps at 80x80 (19,200)
    runs inside, at 96x96 (27,648) it waits. Images as alone either way."""
    gated = GatedPipe(pipe)
    with running(gated, max_batch=4) as (base, app):
        gated.gate.clear()
        send = Senders(base)
        send.start("long", {**OK, "seed": 3, "steps": 4, "size": "64x64", "n": 2})
        assert gated.entered.wait(30)
        send.start("other", {**OK, "seed": 5, "steps": steps, "size": f"{side}x{side}"}, queued=1)
        gated.gate.set()
        send.join()
        interleaved = app.state.metrics.interleaved
    order = ["other", "long"] if enters else ["long", "other"]
    assert interleaved == int(enters) and send.done == order, (interleaved, send.done)
    assert gated.steps == ([steps, 4] if enters else [4, steps]), gated.steps
    got = png_pixels(send.res["other"].json()["data"][0]["b64_json"])
    assert_same_image(got, alone(pipe, OK["prompt"], 5, side, side, steps=steps), "other")
    assert [png_pixels(d["b64_json"]).shape for d in send.res["long"].json()["data"]] == [(64, 64, 3)] * 2


def test_a_cuda_batch_waits_in_each_step_callback_for_the_step_before(pipe, monkeypatch):
    """The worker's step callback paces the batch (`Scheduler._generate`): on a CUDA pipeline each step
    records a blocking event and waits for the one a step back, before the callback's decisions; on
    CPU no event is made. The pipeline here runs on the CPU and only says it is on CUDA."""
    import torch

    made = []

    class Event(FakeEvent):
        def __init__(self, blocking=False):
            super().__init__()
            made.append(blocking)

    class OnCuda:
        def __init__(self, pipe):
            self._pipe, self.seen = pipe, []

        def __getattr__(self, name):
            return getattr(self._pipe, name)

        device = torch.device("cuda")

        def __call__(self, *args, callback=None, **kw):
            def cb(i, n, x):
                callback(i, n, x)
                self.seen.append([k for what, k in FakeEvent.log if what == "wait"])

            return self._pipe(*args, callback=cb, **kw)

    FakeEvent.log, FakeEvent.made = [], 0
    monkeypatch.setattr(torch.cuda, "Event", Event)
    wrapped = OnCuda(pipe)
    with running(wrapped, max_batch=2) as (base, _):
        r = httpx.post(base + G, json={**OK, "steps": 5}, timeout=60)
    assert r.status_code == 200
    assert made == [True] * 5  # one blocking event per step
    assert wrapped.seen == [[], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]  # step k waited for step k - 1
