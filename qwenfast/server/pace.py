"""How the worker paces a batch against the GPU, and what "shorter" means when it interleaves batches
(`batcher.Scheduler._interleave`)."""

from __future__ import annotations

from collections import deque

from .schemas import Params


def work(p: Params, rows: int, steps: int) -> float:
    """The GPU work of `steps` denoising steps of a batch of `rows` images like `p`, in image pixels: a
    step costs about its tokens times its rows (the 60 blocks' GEMMs; attention grows faster, the text is
    short), twice with true CFG (a forward per branch)."""
    return float(p.width * p.height * rows * (2 if true_cfg(p) else 1) * steps)


def may_run_inside(p: Params, p0: Params, rows0: int, left: int) -> bool:
    """Whether a request like `p` may run to its end between two steps of a running batch of `rows0` images
    like `p0` with `left` steps to go (`batcher.Scheduler._interleave`; in GPU work, `work`):

    - its image is less work than each of the batch's images has left: running it first delays each of
      them by less than it saves it (Smith's rule, the least total waiting); or
    - it has fewer steps than the batch (a shorter class: 4-step requests inside 8-step or 50-step batches)
      and is less work than the batch has left in all.

    The second rule favours short requests over the sum of everyone's waiting: a 4-step 1328² image may
    run inside an 8-step batch of four 928x1664 images with two steps left (less than those eight
    image-steps, more than each image's two), so its latency stays near its idle latency, the figure a
    user of Lightning-style LoRAs sees. A request with as many steps or more enters by the first rule
    only: an 8-step 1024² request no longer runs inside a 4-step batch of two 1664x928 images after their
    first step (the burst that set a mixed load's 4-step p95 when the batch's total decided alone)."""
    mine = work(p, 1, p.steps)
    if mine < work(p0, 1, left):
        return True
    return p.steps < p0.steps and mine < work(p0, rows0, left)


def true_cfg(p: Params) -> bool:
    """Whether a request runs true CFG: two forwards a step (a scale above 1 and a negative prompt)."""
    return p.cfg > 1 and p.negative is not None


class StepPace:
    """Keeps the host at most `lag` denoising steps ahead of the GPU inside a batch (called from its step
    callback, once per step).

    Why: the step callback is where a running batch lets shorter requests through (`_interleave`), and it
    runs when the host has queued a step, not when the GPU has run it. With CUDA graphs a step is a replay
    or two, so the host queued a whole 8-step batch in milliseconds and made every interleaving decision
    before the GPU had finished the first step (a mixed load on an H100 interleaved one batch in 40
    requests); the progress events streamed to clients ran ahead likewise. Each call records an event on
    the current stream and waits for the one `lag` steps back: the GPU always has the next `lag` steps
    queued, so it never waits for the host. One step: a batch run inside a running one queues behind
    the steps the host has already queued, so each step of lag is a step of the long batch added to the
    short request's latency (four 928x1664 images' step is about half a second on an H100); a step is
    far longer than the host needs to queue the next (a graph replay or an eager forward's launches). A
    no-op without CUDA (`event` None)."""

    def __init__(self, event=None, lag: int = 1):
        self.event, self.lag = event, lag  # event: a factory of objects with record() and synchronize()
        self.queued: deque = deque()

    def __call__(self) -> None:
        if self.event is None:
            return
        e = self.event()
        e.record()
        self.queued.append(e)
        while len(self.queued) > self.lag:
            self.queued.popleft().synchronize()  # (torch releases the GIL while it waits)
