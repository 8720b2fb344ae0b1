"""The scheduler's choice of the next batch (server/batcher.py `Scheduler._next_batch`, `_take`), on a stub
pipeline (nothing runs): the pick is made again after the wait for batch-mates, so a shorter request that
came during the wait goes first; with CUDA graphs a batch takes a power of two of the images of its key
(each batch size of a shape is a graph of its own), without them (or on the CPU, where none are captured)
all it may.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")

from qwenfast.server.batcher import Scheduler  # noqa: E402
from qwenfast.server.jobs import Job  # noqa: E402
from qwenfast.server.metrics import Metrics  # noqa: E402
from qwenfast.server.options import ServerConfig  # noqa: E402
from qwenfast.server.schemas import Params  # noqa: E402


def _scheduler(graphs: bool, device: str = "cuda", **cfg) -> Scheduler:
    pipe = SimpleNamespace(
        capabilities=SimpleNamespace(lora=True, row_loras=False),
        options=SimpleNamespace(cache=None, cuda_graphs=graphs, parallel=None),
        device=torch.device(device),  # (a stub: nothing runs, so no GPU is needed)
    )
    return Scheduler(pipe, ServerConfig(**cfg), Metrics())  # (its worker thread is never started)


def _job(loop, steps: int, n: int = 1, size: int = 64, cfg: float = 1.0, negative: str | None = None) -> Job:
    p = Params(prompt="a cat", negative=negative, width=size, height=size, steps=steps, cfg=cfg, n=n, seed=0)
    return Job(p, loop)


@pytest.fixture()
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_a_shorter_request_that_comes_during_the_wait_goes_first(loop):
    s = _scheduler(False, batch_wait_s=0.5)
    long_job, short_job = _job(loop, 8), _job(loop, 4)
    s.submit(long_job)
    got = []
    th = threading.Thread(target=lambda: got.append(s._next_batch()))
    th.start()
    time.sleep(0.05)  # the worker holds the 8-step request, waiting for batch-mates
    s.submit(short_job)
    th.join(10)
    assert [it.job for it in got[0]] == [short_job]  # picked again after the wait
    assert [it.job for it in s._next_batch()] == [long_job]


@pytest.mark.parametrize(
    "graphs,device,sizes", [(True, "cuda", [4, 2, 1]), (False, "cuda", [7]), (True, "cpu", [7])]
)
def test_batches_take_a_power_of_two_with_graphs(loop, graphs, device, sizes):
    s = _scheduler(graphs, device, batch_wait_s=0.0, max_batch=8)
    jobs = [_job(loop, 4) for _ in range(5)] + [_job(loop, 4, n=2)]  # 7 images of one key
    for j in jobs:
        s.submit(j)
    other = _job(loop, 4, size=96)  # another shape: its own batch, after those
    s.submit(other)
    got = [s._next_batch() for _ in sizes]
    assert [len(b) for b in got] == sizes
    order = [it.job for b in got for it in b]
    assert order == [j for j in jobs for _ in range(j.params.n)]  # arrival order, nothing lost or doubled
    assert [it.job for it in s._next_batch()] == [other] and not s.pending


@pytest.mark.parametrize("cap, sizes", [(2, [2, 2, 2, 1]), (None, [4, 2, 1])])
def test_true_cfg_batches_take_at_most_max_cfg_batch(loop, cap, sizes):
    """--max-cfg-batch: a true-CFG batch (a scale above 1 and a negative prompt: two forwards a step) takes
    at most that many images; one without a negative prompt (one forward) takes what --max-batch allows."""
    s = _scheduler(True, batch_wait_s=0.0, max_batch=8, max_cfg_batch=cap)
    cfg_job = _job(loop, 50, n=7, cfg=4.0, negative=" ")
    plain = _job(loop, 50, n=4, cfg=4.0, size=96)  # no negative prompt: no true CFG
    s.submit(cfg_job)
    s.submit(plain)
    got = [len(s._next_batch()) for _ in sizes]
    assert got == sizes
    assert len(s._next_batch()) == 4 and not s.pending
