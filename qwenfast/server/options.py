"""Flags of `qwenfast serve` and the limits every request is checked against.

Kept free of FastAPI/torch imports so that `qwenfast --help` and `qwenfast serve --help` work
without the `[server]` extra installed; `serve` itself says which package is missing.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from ..validation import MAX_CFG, MAX_PIXELS, MAX_SIDE, MAX_STEPS, parse_size


@dataclass
class Limits:
    """What one request may ask for. Defaults suit one GPU serving Qwen-Image at up to 2048²."""

    max_side: int = MAX_SIDE  # pixels, each of width and height (the CLI's --size limit too)
    min_side: int = 16
    max_pixels: int = MAX_PIXELS  # width*height
    max_n: int = 4  # images per request
    max_steps: int = MAX_STEPS  # the CLI checks --steps and --cfg against these defaults too
    max_prompt_chars: int = 4000
    max_cfg: float = MAX_CFG
    max_loras: int = 4
    max_lora_strength: float = 8.0
    max_json_bytes: int = 1 << 20  # JSON request bodies
    max_upload_bytes: int = 20 << 20  # a whole multipart edit request
    max_images: int | None = None  # input images per edit request; None: the model's own limit (1, 3 or 10)
    max_input_pixels: int = 4096 * 4096  # per uploaded image, checked before decoding (no pixel bombs)
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")  # allowed upload formats (PIL names)


@dataclass
class ServerConfig:
    """Everything `create_app` needs besides the pipeline; built from the flags or by tests."""

    api_key: str | None = None
    max_queue: int = 64  # requests waiting (not yet started); more -> 429 with Retry-After
    max_batch: int = 4  # images per pipeline call
    max_cfg_batch: int | None = None  # images per call with true CFG (two forwards a step); None: max_batch
    batch_wait_s: float = 0.02  # how long a lone request waits for batch-mates (added latency cap)
    timeout_s: float = 600.0  # per request, queue wait included
    lora_dir: str | None = None
    row_loras: int = 0  # > 0: each request its own LoRAs inside a batch, this many resident
    interleave: bool = True  # short requests run between two steps of a longer batch (batcher._interleave)
    age_bound_s: float = 30.0  # fewest steps first unless the oldest waited this long; pauses per long batch
    url_ttl_s: float = 3600.0  # response_format=url images live this long
    url_store_bytes: int = 1 << 30  # and at most this much memory; oldest go first
    preview_px: int = 192  # long side of the streamed preview images
    limits: Limits = field(default_factory=Limits)
    model_name: str | None = None  # id in /v1/models (default: the model folder's name)
    warm_up: tuple[tuple[int, int], ...] = ()  # sizes whose batch shapes run once before serving (warmup.py)


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """'1024x1024,1328x1328' -> ((1024, 1024), (1328, 1328)); ValueError with what to write otherwise."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            out.append(parse_size(part))
        except ValueError:
            raise ValueError(f"--warm-up: {part!r} is not WIDTHxHEIGHT (e.g. 1024x1024,1328x1328)") from None
    if not out:
        raise ValueError("--warm-up needs at least one WIDTHxHEIGHT (e.g. 1024x1024)")
    return tuple(dict.fromkeys(out))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine_args import add_engine_arguments
    from ..engine_args import positive_int as _positive

    d, lim = ServerConfig(), Limits()
    p.add_argument(
        "--model",
        default=None,
        help="diffusers-layout model folder (default: the embedded 128x128 demo model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*; also read from $QWENFAST_API_KEY "
        "(better: keeps the key out of `ps`)",
    )
    p.add_argument(
        "--max-queue", type=_positive, default=d.max_queue, help="waiting requests before new ones get 429"
    )
    p.add_argument("--max-batch", type=_positive, default=d.max_batch, help="images per pipeline call")
    p.add_argument(
        "--max-cfg-batch",
        type=_positive,
        default=None,
        help="images per pipeline call with true CFG (two forwards a step: two images already fill a GPU "
        "at 1024²; with --cuda-graphs and a step cache it also bounds the cache's buffers and the graphs "
        "--warm-up captures); default: --max-batch",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_s * 1e3,
        help="how long a request may wait for batch-mates (default 20)",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per request, queue included")
    p.add_argument("--lora-dir", default=None, help="folder of LoRA .safetensors files requests may name")
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="run batches strictly one after the other (default: a waiting batch of shorter text-to-image "
        "requests runs between two steps of a longer one)",
    )
    p.add_argument(
        "--age-bound",
        type=float,
        default=d.age_bound_s,
        metavar="S",
        help="the next batch starts with the waiting request of fewest steps, unless the oldest has "
        "waited S seconds: then that one; and a running batch pauses for shorter ones S seconds at "
        "most in all (default 30)",
    )
    p.add_argument(
        "--row-loras",
        type=int,
        default=0,
        metavar="N",
        help="batch requests with different LoRAs together, each row with its own, N adapters kept on the "
        "GPU (least recently used out first); needs --lora-dir and the transformer resident (no block offload); "
        "text-to-image only (default 0: requests batch by LoRA set)",
    )
    p.add_argument(
        "--warm-up",
        default=None,
        metavar="SIZES",
        help="before serving, run every batch shape of these sizes once (e.g. 1024x1024,1328x1328: batch "
        "sizes up to --max-batch, CFG on and off, with and without a per-row LoRA), so that with "
        "--cuda-graphs no graph is captured under load; requests that come meanwhile wait in the queue, "
        "/health shows the progress (pair it with --text-bucket)",
    )
    add_engine_arguments(p, cuda_graphs_default=False)  # --device --dtype --offload --fp8 --preset ...
    p.add_argument(
        "--max-size",
        type=_positive,
        default=lim.max_side,
        help="largest width or height a request may ask for (also caps width*height at its square)",
    )
    p.add_argument("--max-n", type=_positive, default=lim.max_n, help="most images per request")
    p.add_argument(
        "--max-steps", type=_positive, default=lim.max_steps, help="most denoising steps per request"
    )
    p.add_argument(
        "--max-prompt-chars",
        type=_positive,
        default=lim.max_prompt_chars,
        help="longest prompt (and negative prompt), in characters",
    )
    p.add_argument(
        "--max-upload-mb",
        type=float,
        default=lim.max_upload_bytes / 2**20,
        help="largest edit request (all images together)",
    )
    p.add_argument(
        "--url-ttl", type=float, default=d.url_ttl_s, help="seconds a response_format=url image lives"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=120.0,
        help="on SIGTERM/Ctrl-C, seconds to let running and queued requests finish",
    )
    p.add_argument("--model-name", default=None, help="model id shown in /v1/models (default: folder name)")
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    r = p.add_argument_group("Ray Serve (many GPUs and machines; the [ray] extra)")
    r.add_argument(
        "--ray", action="store_true", help="serve on a Ray Serve cluster: engine replicas behind one endpoint"
    )
    r.add_argument("--replicas", type=_positive, default=None, help="engine replicas (default 1)")
    r.add_argument(
        "--autoscale",
        type=parse_autoscale,
        default=None,
        metavar="MIN:MAX",
        help="autoscale the engine replicas on queue depth, between MIN and MAX",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (`auto`, or host:port of `ray start --head`); default: a new local one",
    )
    r.add_argument(
        "--num-gpus", type=float, default=None, help="GPUs per replica (default 1; 0 with --device cpu)"
    )
    r.add_argument(
        "--num-cpus", type=float, default=None, help="CPUs per replica (default 2; 1 with --device cpu)"
    )
    r.add_argument("--ingress-cpus", type=float, default=1.0, help="CPUs of the HTTP ingress replica")
    r.add_argument(
        "--max-replicas-per-node",
        type=_positive,
        default=None,
        help="spread engine replicas: at most this many on one node",
    )


def parse_autoscale(text: str) -> tuple[int, int]:
    """`--autoscale MIN:MAX` -> (MIN, MAX)."""
    try:
        lo, hi = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants MIN:MAX (e.g. 1:4), got {text!r}") from None
    if not 0 <= lo <= hi or hi < 1:
        raise argparse.ArgumentTypeError(f"{text}: need 0 <= MIN <= MAX and MAX >= 1")
    return lo, hi


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    lim = Limits(
        max_side=a.max_size,
        max_pixels=a.max_size * a.max_size,
        max_n=a.max_n,
        max_steps=a.max_steps,
        max_prompt_chars=a.max_prompt_chars,
        max_upload_bytes=int(a.max_upload_mb * 2**20),
    )
    key = a.api_key if a.api_key is not None else os.environ.get("QWENFAST_API_KEY") or None
    if a.row_loras < 0 or (a.row_loras and not a.lora_dir):
        raise SystemExit(
            "error: --row-loras N needs N >= 1 and --lora-dir (the folder the adapters come from)"
        )
    warm = ()
    if a.warm_up:
        try:
            warm = parse_sizes(a.warm_up)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    return ServerConfig(
        warm_up=warm,
        api_key=key,
        max_queue=a.max_queue,
        max_batch=a.max_batch,
        max_cfg_batch=a.max_cfg_batch,
        batch_wait_s=max(0.0, a.batch_wait_ms / 1e3),
        timeout_s=a.timeout,
        lora_dir=a.lora_dir,
        row_loras=a.row_loras,
        interleave=not a.no_interleave,
        age_bound_s=a.age_bound,
        url_ttl_s=a.url_ttl,
        limits=lim,
        model_name=a.model_name,
    )
