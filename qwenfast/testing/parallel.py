"""Run a pipeline call on N CPU processes over gloo (what the multi-GPU tests compare with one
process). Importable by spawned processes, so it lives in the package, not in tests/."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..launch import free_port, spawn  # free_port: re-exported for the tests and benchmarks


def _worker(
    rank: int,
    world: int,
    port: int,
    model: str,
    layout: str,
    call: dict,
    out: str,
    fail_rank: int,
    options: dict | None = None,
    fail_how: str = "raise",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from qwenfast.options import EngineOptions
        from qwenfast.pipeline.auto import from_pretrained

        if rank == fail_rank and fail_how == "raise":
            raise RuntimeError(f"rank {rank} failed on purpose (test)")
        pipe = from_pretrained(
            model,
            device="cpu",
            dtype=torch.float32,
            options=EngineOptions(parallel=layout, **(options or {})),
        )
        if rank == fail_rank:  # "kill": SIGKILL in the second denoising step, the other ranks mid-collective
            import signal

            calls = []

            def kill_in_second_forward(*_):
                calls.append(1)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)

            pipe.transformer.register_forward_pre_hook(kill_in_second_forward)
        pipe.set_progress_bar_config(disable=True)
        modulated: set[int] = set()  # which blocks' img_mod this rank ran (split_over_ranks)
        blocks = getattr(pipe.transformer, "transformer_blocks", [])
        for i, b in enumerate(blocks):
            if hasattr(b, "img_mod"):
                b.img_mod.register_forward_hook(lambda *_, i=i: modulated.add(i))
        kw = dict(call)
        kw["generator"] = [torch.Generator().manual_seed(s) for s in kw.pop("seeds")]
        result = pipe(**kw, output_type="np")
        if rank == 0:
            np.save(out, result.images)
            # what ran: the multi-GPU wrapper around the forward, over this many ranks, the Ulysses
            # exchange (and what the call reported, when it did: Qwen-Image-2.1's `info["parallel"]`)
            from qwenfast.runtime.ulysses_peer import exchange_choice

            record = {
                "core": type(pipe._core_forward()).__name__,
                "world": dist.get_world_size(),
                "exchange": exchange_choice(torch.device("cpu")),
                "modulated_blocks": sorted(modulated),
            }
            if "parallel" in result.info:
                record["info"] = result.info["parallel"]
            Path(out).with_suffix(".json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def run_parallel(
    model: str | Path,
    layout: str,
    call: dict[str, Any],
    out: str | Path,
    world: int,
    fail_rank: int = -1,
    options: dict[str, Any] | None = None,
    fail_how: str = "raise",
) -> np.ndarray:
    """`call` (pipeline kwargs; `seeds` instead of generators) on `world` gloo processes -> rank 0's images.
    `options`: further EngineOptions fields for every rank (e.g. a step cache). fail_rank (tests): that
    rank raises before loading (`fail_how="raise"`) or is SIGKILLed in its second forward ("kill")."""
    spawn(
        _worker,
        (world, free_port(), str(model), layout, call, str(out), fail_rank, options, fail_how),
        world,
        f"parallel {layout}",
    )
    return np.load(out)
