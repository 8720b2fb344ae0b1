"""Value rules shared by the CLI (`qwenfast generate|edit`) and the server (`qwenfast serve`).

One place decides what a valid number of steps, CFG scale, seed, image count and size is, so the
command line never accepts what the server refuses. Plain functions raising `ValueError` with a
message that names the parameter as the caller spells it (`--cfg` for the CLI, `` `true_cfg_scale` ``
for the server, which wraps the error into its OpenAI-shaped 400). No torch, no FastAPI: the server
and the CLI both import this module, and neither imports the other for it.

Also: `size_note`, the warning for a size far from the one a model was trained at (the 128² demo
draws noise at 256²).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SEED = 2**63 - 1  # seeds are torch.Generator seeds (int64); the server hands out seed + i
MAX_STEPS = 100  # default limits of `qwenfast serve` (its flags change them) and of the CLI
MAX_CFG = 20.0
MIN_SIDE = 16


def fmt(v: float | int | str | None) -> str:
    """2.0 -> '2', 0.25 -> '0.25', 7 -> '7' (messages read like the user typed them)."""
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:g}"
    return str(v)


def check_range(name: str, v: float | None, lo: float, hi: float, what: str = "") -> None:
    """`lo <= v <= hi` and finite, else ValueError("NAME must be in LO..HI, got V"). None passes."""
    if v is None:
        return
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in {fmt(lo)}..{fmt(hi)}{what}, got {fmt(v)}")


def check_steps(v: int | None, max_steps: int = MAX_STEPS, name: str = "steps") -> None:
    check_range(name, v, 1, max_steps)


def check_cfg(v: float | None, max_cfg: float = MAX_CFG, name: str = "true_cfg_scale") -> None:
    """0 <= cfg <= max_cfg (1 or less runs without classifier-free guidance)."""
    check_range(name, v, 0.0, max_cfg)


def check_seed(v: int | None, name: str = "seed") -> None:
    check_range(name, v, 0, MAX_SEED)


def check_n(v: int | None, max_n: int, name: str = "n") -> None:
    check_range(name, v, 1, max_n, " (images per request)")


def check_size(width: int, height: int, *, min_side: int = MIN_SIDE, max_side: int, max_pixels: int | None = None,
               multiple: int | None = None, name: str = "size") -> None:  # fmt: skip
    """Width and height in min_side..max_side, at most max_pixels, multiples of `multiple` (None: any)."""
    if not (min_side <= width <= max_side and min_side <= height <= max_side):
        raise ValueError(f"{name} {width}x{height}: width and height must be in {min_side}..{max_side}")
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"{name} {width}x{height} is {width * height} pixels; the limit is {max_pixels}")
    if multiple and (width % multiple or height % multiple):
        raise ValueError(f"{name} {width}x{height}: width and height must be multiples of {multiple}")


def round_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """Round down to multiples of `multiple` (what the pipeline does), never below one multiple."""
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


# ------------------------------------------------------------------ the size a model was trained at
FAR_SIDE = 0.25  # a side more than 25% off the trained side ...
FAR_AREA = 1.5  # ... or an area more than 1.5x off the trained area counts as "far"


def parse_trained_size(value: object, where: str = "qwenfast.json") -> tuple[int, int] | None:
    """qwenfast.json `"trained_size": [WIDTH, HEIGHT]` -> (w, h); None when absent; ValueError when malformed."""
    if value is None:
        return None
    if (not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= MIN_SIDE for v in value)):  # fmt: skip
        raise ValueError(f"{where}: trained_size must be [WIDTH, HEIGHT] in pixels, got {value!r}")
    return int(value[0]), int(value[1])


def size_note(trained: tuple[int, int] | None, width: int, height: int) -> str | None:
    """A one-line note when (width, height) is far from the size the model was trained at, else None."""
    if trained is None:
        return None
    tw, th = trained
    area = (width * height) / (tw * th)
    far = abs(width / tw - 1) > FAR_SIDE or abs(height / th - 1) > FAR_SIDE or not 1 / FAR_AREA <= area <= FAR_AREA
    if not far:
        return None
    return (f"note: this model was trained at {tw}x{th}; {width}x{height} will likely give noise "
            f"(pick a size near {tw}x{th})")  # fmt: skip


def path_and_number(s: str, default: float = 1.0) -> tuple[str, float]:
    """`PATH[:NUMBER]` (a LoRA's strength, a ControlNet's scale); a last `:` part that is not a number
    belongs to the path (C:\\loras\\x.safetensors)."""
    path, sep, tail = s.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return s, default
