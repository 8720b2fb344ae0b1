"""Loading the pipeline a server serves, shared by `qwenfast serve` (run.py) and the Ray Serve engine
replicas (ray_app.py), so both serve exactly the same engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


SERVER_TEXT_BUCKET = 64  # tokens: the bucket a graph-replaying server pads prompts to by default


def default_text_bucket(pipe: PipelineBase) -> int:
    """A server with CUDA graphs and no `--text-bucket`: pad prompts to SERVER_TEXT_BUCKET tokens where
    that costs attention nothing (key lengths on FlashAttention-3), so one graph serves every prompt of
    a bucket (measured on the mixed load: captures fell from about one per request to a few per level;
    docs/serving.md). Elsewhere padding would run as a mask: left off. Returns the bucket set (0: none)."""
    from ..runtime.attention import key_lengths_free

    o = pipe.options
    if not (o.cuda_graphs and not o.text_bucket and o.parallel is None):
        return 0
    if not getattr(pipe.transformer, "takes_key_lengths", False) or not key_lengths_free(pipe.device):
        return 0
    pipe.configure(text_bucket=SERVER_TEXT_BUCKET)
    return SERVER_TEXT_BUCKET
