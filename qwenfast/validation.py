"""Value rules shared by the CLI (`qwenfast generate|edit`) and the server (`qwenfast serve`).

One place decides what a valid number of steps, CFG scale, seed, image count and size is, so the
command line never accepts what the server refuses. Plain functions raising `ValueError` with a
message that names the parameter as the caller spells it (`--cfg` for the CLI, `` `true_cfg_scale` ``
for the server, which wraps the error into its OpenAI-shaped 400). No torch, no FastAPI: the server
and the CLI both import this module, and neither imports the other for it.

Also: `size_note`, the warning for a size far from the one a model was trained at (the 128² demo
draws a flat, empty picture at 256²); `image_seeds`, the seed of each image of a request (seed + i, everywhere);
`ulysses_choices` / `check_parallel`, the `--parallel` layouts a model allows (checked before any
process starts); `install_hint`, the one way every "missing extra" error says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SEED = 2**63 - 1  # seeds are torch.Generator seeds (int64); the server hands out seed + i
MAX_STEPS = 100  # default limits of `qwenfast serve` (its flags change them) and of the CLI
MAX_CFG = 20.0
MIN_SIDE = 16
MAX_SIDE = (
    2048  # the largest width or height, CLI and server (`qwenfast serve --max-size` changes the server's)
)
MAX_PIXELS = MAX_SIDE * MAX_SIDE
SIZE_MULTIPLE = (
    16  # every Qwen-Image model's (VAE 8x, patch 2); Qwen-Image-2.1: 32 (VAE 16x), checked after load
)


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


def check_strength(
    v: float | None, steps: int | None, name: str = "strength", steps_name: str = "steps"
) -> None:
    """img2img / inpainting strength: 0..1, and with `steps` steps it must leave at least one denoising
    step (diffusers' `get_timesteps`: the first `int(steps - min(steps * v, steps))` are skipped)."""
    check_range(name, v, 0.0, 1.0)
    if v is None or steps is None:
        return
    left = steps - int(max(steps - min(steps * v, steps), 0))
    if left < 1:
        raise ValueError(
            f"{name} {fmt(v)} with {steps} steps leaves {left} denoising steps; raise {name} or {steps_name}"
        )


def image_seeds(seed: int, n: int, max_seed: int = MAX_SEED) -> list[int]:
    """THE seed rule: image i of a request with seed s is drawn from its own `torch.Generator` seeded s + i
    (wrapping past max_seed), and reports / records s + i. So image i of `--seed S --n N` is the image of
    `--seed S+i --n 1` (the CLI, the server, the PNG metadata and the ComfyUI nodes all follow it)."""
    return [(seed + i) % (max_seed + 1) for i in range(n)]


def parse_size(text: str) -> tuple[int, int]:
    """'1024x768' -> (1024, 768) (WIDTHxHEIGHT, any case of x); ValueError naming the form otherwise. The
    CLI's --size and the server's --warm-up read sizes with it; the rule they must keep is `check_size`."""
    try:
        w, h = (int(v) for v in text.strip().lower().split("x"))
    except ValueError:
        raise ValueError(f"size must look like 1024x768 (WIDTHxHEIGHT), got {text!r}") from None
    return w, h


def check_size(
    width: int,
    height: int,
    *,
    min_side: int = MIN_SIDE,
    max_side: int = MAX_SIDE,
    max_pixels: int | None = MAX_PIXELS,
    multiple: int | None = SIZE_MULTIPLE,
    name: str = "size",
) -> None:
    """THE size rule of the CLI (`--size`) and the server (`size`): width and height in min_side..max_side,
    at most max_pixels, multiples of `multiple` (None: any). Nothing is rounded: a size that breaks the
    rule is refused, and the message names the nearest sizes that keep it."""
    what = f"{name} {width}x{height}" if name else f"{width}x{height}"  # "" for argparse, which names --size
    if not (min_side <= width <= max_side and min_side <= height <= max_side):
        raise ValueError(f"{what}: width and height must be in {min_side}..{max_side}")
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"{what} is {width * height} pixels; the limit is {max_pixels}")
    if multiple and (width % multiple or height % multiple):
        near = nearest_sizes(
            width, height, multiple, min_side=min_side, max_side=max_side, max_pixels=max_pixels
        )
        raise ValueError(
            f"{what}: width and height must be multiples of {multiple}; "
            f"nearest: {' or '.join(f'{w}x{h}' for w, h in near)}"
        )


def nearest_sizes(
    width: int,
    height: int,
    multiple: int,
    *,
    min_side: int = MIN_SIDE,
    max_side: int = MAX_SIDE,
    max_pixels: int | None = MAX_PIXELS,
) -> list[tuple[int, int]]:
    """The sizes of multiples of `multiple` next to (width, height) within the limits: rounded down, and
    rounded up when that differs and fits (1000x1000, 16 -> [(992, 992), (1008, 1008)])."""
    lo = max(min_side, multiple)
    hi = max_side // multiple * multiple

    def fit(v: int) -> int:
        return min(max(v, lo), hi)

    down = (fit(width // multiple * multiple), fit(height // multiple * multiple))
    up = (fit(-(-width // multiple) * multiple), fit(-(-height // multiple) * multiple))
    out = [down]
    if up != down and (max_pixels is None or up[0] * up[1] <= max_pixels):
        out.append(up)
    return out


def round_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """Round down to multiples of `multiple` (what the pipeline does), never below one multiple: for sizes
    taken from an input picture ("auto"), never for a size the user typed (`check_size` refuses those)."""
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


# ------------------------------------------------------------------ the size a model was trained at
FAR_SIDE = 0.25  # a side more than 25% off the trained side ...
FAR_AREA = 1.5  # ... or an area more than 1.5x off the trained area counts as "far"


def parse_trained_size(value: object, where: str = "qwenfast.json") -> tuple[int, int] | None:
    """qwenfast.json `"trained_size": [WIDTH, HEIGHT]` -> (w, h); None when absent; ValueError when malformed."""
    if value is None:
        return None
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= MIN_SIDE for v in value)
    ):
        raise ValueError(f"{where}: trained_size must be [WIDTH, HEIGHT] in pixels, got {value!r}")
    return int(value[0]), int(value[1])


def size_note(trained: tuple[int, int] | None, width: int, height: int) -> str | None:
    """A one-line note when (width, height) is far from the size the model was trained at, else None."""
    if trained is None:
        return None
    tw, th = trained
    area = (width * height) / (tw * th)
    far = (
        abs(width / tw - 1) > FAR_SIDE
        or abs(height / th - 1) > FAR_SIDE
        or not 1 / FAR_AREA <= area <= FAR_AREA
    )
    if not far:
        return None
    return (
        f"note: this model was trained at {tw}x{th}; {width}x{height} will likely give a flat, empty picture "
        f"(pick a size near {tw}x{th})"
    )


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


# ------------------------------------------------------------------ --parallel layouts
def ulysses_choices(heads: int) -> list[int]:
    """Every Ulysses degree a model with `heads` attention heads allows (1 included: no split)."""
    return [g for g in range(1, heads + 1) if heads % g == 0]


def check_parallel(cfg: int, ulysses: int, heads: int | None, name: str = "--parallel") -> None:
    """A layout (cfg=C, ulysses=U) the model can run: C in 1, 2; U divides the attention heads. Checked
    before any process is started; `heads` None (unknown before loading) checks C only."""
    if cfg not in (1, 2):
        raise ValueError(f"{name}: cfg must be 1 or 2, got cfg={cfg}")
    if heads is not None and heads % ulysses:
        ok = ", ".join(f"ulysses={g}" for g in ulysses_choices(heads))
        raise ValueError(
            f"{name}: ulysses={ulysses} must divide the model's {heads} attention heads; "
            f"valid: {ok} (each with cfg=1 or cfg=2)"
        )


# ------------------------------------------------------------------ optional extras
def install_hint(extra: str) -> str:
    """How to install an optional extra, for both kinds of install: from PyPI, and from a checkout
    (what the README does). Every "needs the X extra" message ends with this."""
    return f"pip install 'qwenfast[{extra}]' (or, from a checkout: pip install -e \".[{extra}]\")"


class MissingExtra(ImportError):
    """An optional extra is not installed; the message names the missing module and how to install it."""

    def __init__(self, what: str, extra: str, module: str | None = None):
        missing = f" ({module} is missing)" if module else ""
        super().__init__(f"{what} needs the {extra} extra{missing}: {install_hint(extra)}")
        self.extra, self.module = extra, module


def require_extra(what: str, extra: str, *modules: str) -> None:
    """Import-check `modules` (without importing them); MissingExtra naming the first one absent."""
    import importlib.util

    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtra(what, extra, m)
