"""Loading the pipeline a server serves, shared by `qwenfast serve` (run.py) and the Ray Serve engine
replicas (ray_app.py), so both serve exactly the same engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    import torch

    from ..options import EngineOptions
    from ..pipeline.base import PipelineBase


def load_pipeline(
    model: str | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    options: EngineOptions | None = None,
    preset: str | None = None,
    fp8: bool = False,
) -> PipelineBase:
    """The pipeline class the folder needs (the pipeline registry's, `pipeline.auto.from_pretrained`), with
    engine options, preset, FP8. What it can serve is its `capabilities` (server/capabilities.py)."""
    from ..options import EngineOptions
    from ..pipeline.auto import from_pretrained
    from ..pipeline.common import DEFAULT_MODEL

    if options is None:  # a server default: no graphs (every new prompt length or batch size is a capture)
        options = EngineOptions.from_env(cuda_graphs=False)
    # batched requests get the image each gets alone (the decode is batch-invariant this way)
    options = options.replace(decode_per_image=True, fp8=options.fp8 or fp8)  # FP8: quantised while loading
    pipe = from_pretrained(model or DEFAULT_MODEL, device=device, dtype=dtype, options=options)
    pipe.set_progress_bar_config(disable=True)
    if preset:
        pipe.apply_preset(preset)
    return pipe


def server_engine_options(a: argparse.Namespace) -> EngineOptions:
    """The engine options of `qwenfast serve` (and its Ray replicas): the command line's, with
    `text_bucket="auto"` unless --text-bucket was given (64-token buckets where CUDA graphs replay and
    the padding is free: `EngineOptions.text_bucket`)."""
    from ..engine_args import engine_options_from_args

    opts = engine_options_from_args(a)
    return opts if getattr(a, "text_bucket", None) is not None else opts.replace(text_bucket="auto")
