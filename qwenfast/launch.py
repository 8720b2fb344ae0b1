"""`--parallel`: start one process per GPU (or per CPU rank with `--device cpu`, over gloo) and run
the same command in each; rank 0 writes the output. Under torchrun (RANK / WORLD_SIZE set) the
processes exist already and only join the group.

A rank that fails ends the whole run: `torch.multiprocessing.spawn` terminates the others and the
error is reported once, naming the rank (collectives also time out after `TIMEOUT`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta

TIMEOUT = timedelta(minutes=10)


def is_worker() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_worker() else 0


def run(cmd: Callable[[argparse.Namespace], int], a: argparse.Namespace) -> int:
    """Run `cmd(a)` on every rank of `a.parallel`'s layout; returns rank 0's exit status."""
    import torch

    from .runtime.parallel import ParallelConfig

    layout = ParallelConfig.parse(a.parallel)
    cpu = (a.device or "").startswith("cpu") or not torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: join, don't spawn
        return _join_and_run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cpu, cmd, a, env=True)
    if not cpu and torch.cuda.device_count() < layout.world:
        raise ValueError(
            f"--parallel {layout} needs {layout.world} GPUs; this machine has "
            f"{torch.cuda.device_count()} (use fewer ranks, or --device cpu to test on CPU processes)"
        )
    spawn(_spawned, (layout.world, free_port(), cpu, cmd, a), layout.world, f"--parallel {layout}")
    return 0


def free_port() -> int:
    """A free TCP port on this machine for the process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, args: tuple, nprocs: int, what: str) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`; a failure becomes one `ParallelError` naming
    the rank that caused it. A rank killed by a signal (OOM killer, `kill -9`) is named as the cause
    even when a survivor reports first: the others then fail in a collective ("connection reset"), and
    that message alone would blame the wrong rank."""
    import signal

    import torch.multiprocessing as mp

    from .errors import ParallelError

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not ctx.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if isinstance(e, mp.ProcessRaisedException):
            msg = f"process {e.error_index} failed: " + [ln for ln in str(e).splitlines() if ln.strip()][-1]
        else:
            msg = f"process {e.error_index} exited with code {e.exit_code}"
        killed = next(
            (
                (i, p.exitcode)
                for i, p in enumerate(ctx.processes)  # (not by the clean-up's SIGTERM)
                if p.exitcode is not None and p.exitcode < 0 and -p.exitcode != signal.SIGTERM
            ),
            None,
        )
        if killed is not None:
            i, code = killed
            msg = f"process {i} was killed by {signal.Signals(-code).name}" + (
                "" if i == e.error_index else f"; then {msg}"
            )
        raise ParallelError(f"{what}: {msg}") from None


def _spawned(r: int, world: int, port: int, cpu: bool, cmd, a: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    status = _join_and_run(r, world, cpu, cmd, a)
    if status:
        raise SystemExit(status)


def _join_and_run(r: int, world: int, cpu: bool, cmd, a: argparse.Namespace, env: bool = False) -> int:
    import torch
    import torch.distributed as dist

    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        local = int(os.environ.get("LOCAL_RANK", r))
        torch.cuda.set_device(local)
        a.device = f"cuda:{local}"
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        rank=r,
        world_size=world,
        timeout=TIMEOUT,
        **({} if env else {"init_method": "env://"}),
    )
    try:
        return cmd(a)
    finally:
        dist.destroy_process_group()
