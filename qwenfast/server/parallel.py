"""`qwenfast serve --parallel LAYOUT`: one engine spanning several GPUs; rank 0 answers HTTP, the other
ranks follow its batches.

Why a mirror and not a second scheduler: a multi-GPU forward is a sequence of collectives that every
rank must enter in the same order. So every rank runs the same pipeline calls with the same
arguments: rank 0's pipeline is wrapped in `Mirrored`, which, before any call that runs the model
or changes its state (`__call__`, `set_loras`, `load_lora`, `unload_lora`, `configure`, also through
`for_task(...)`), broadcasts the call (task, method, arguments) to the other ranks, which execute it
in `follow()`. Everything else (sizes, options, previews, the web page) is answered by rank 0 alone.

- Messages go over a separate gloo group with a long timeout: an idle server waits in a broadcast
  for as long as nobody asks for an image; the model's own collectives keep the normal timeout.
- Followers produce latents only (`output_type="latent"`): the VAE decode is rank 0's.
- Cancelling a streamed request stops sending previews but lets the batch finish on every rank
  (stopping rank 0 alone in the middle of a step would leave the others waiting in a collective).
- A rank that dies ends the run (the launcher reports it); shutdown sends a stop message.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

log = logging.getLogger("qwenfast.server")

MIRRORED = frozenset({"__call__", "set_loras", "load_lora", "unload_lora", "configure"})
IDLE_TIMEOUT = timedelta(days=365)  # followers wait in a broadcast while the server is idle


def control_group():
    """A gloo group over every rank for the call messages (created collectively on all ranks)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _send(msg: Any, group) -> Any:
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Mirrored:
    """Rank 0's pipeline: the calls in `MIRRORED` are broadcast to the followers before they run here."""

    def __init__(self, pipe: Any, group, task: str | None = None):
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_task", task)

    def __getattr__(self, name: str) -> Any:
        if name == "for_task":
            return lambda task: Mirrored(self._pipe.for_task(task), self._group, task)
        attr = getattr(self._pipe, name)
        if name in MIRRORED:
            return lambda *args, **kwargs: self._run(name, args, kwargs)
        return attr

    def __call__(self, *args, **kwargs):
        return self._run("__call__", args, kwargs)

    def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
        callback = kwargs.pop("callback", None)
        _send((self._task, name, args, kwargs), self._group)
        if callback is not None:
            kwargs["callback"] = _uncancellable(callback)
        fn = self._pipe if name == "__call__" else getattr(self._pipe, name)
        return fn(*args, **kwargs)

    def stop(self) -> None:
        """Tell the followers to return (the server is shutting down)."""
        _send(None, self._group)


def _uncancellable(callback):
    """The batcher's step callback, with its cancellation swallowed: every rank must finish the batch."""

    def cb(i, n, x):
        try:
            callback(i, n, x)
        except Exception as e:  # noqa: BLE001 - Cancelled, or a failed preview: the batch goes on
            log.debug(
                "step callback on rank 0 raised %s; the batch continues on every rank", type(e).__name__
            )

    return cb


def follow(pipe: Any, group) -> None:
    """A follower rank: run rank 0's calls until it sends the stop message."""
    while True:
        msg = _send(None, group)
        if msg is None:
            return
        task, name, args, kwargs = msg
        target = pipe if task is None else pipe.for_task(task)
        if name == "__call__":
            kwargs = {**kwargs, "output_type": "latent"}  # rank 0 decodes
        try:
            (target if name == "__call__" else getattr(target, name))(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - rank 0 runs the same call and answers the client
            log.warning("follower: %s failed: %s: %s", name, type(e).__name__, e)
