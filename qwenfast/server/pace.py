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
    queued, so it never waits for the host. A no-op without CUDA (`event` None)."""

    def __init__(self, event=None, lag: int = 2):
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
