"""A deterministic analyser that scores a picture against its prompt (numpy only).

1. Colour segmentation: every pixel takes the nearest named colour (:data:`qwenfast.demo.data.COLOURS`);
   the background is the most common colour of the 4-pixel border.
2. Objects: connected components (4-neighbour) of each non-background colour. Components whose
   3x3-opened area is under :data:`MIN_AREA` are dropped: that removes anti-aliasing fringes (a
   red-on-blue edge blends to "purple") and speckle; so are thin bands (under :data:`THIN` of the
   area left after a 5x5 opening), the blurred edge between two colours.
3. Shape: the component's mask, cropped to its bounding box and resampled to 24x24, is compared with
   a template of each shape drawn the same way; the best IoU wins (under 0.5: "unknown").
4. Position: the nearest of the nine anchors to the centroid. Size: bounding-box side <= 39 px is
   "small", else "large".

A prompt passes when every check passes: each named object is present in its colour, with its shape,
and its position and size where the prompt says them; the background where it says it; and no other
object is present. :func:`parse_prompt` reads the caption grammar of :mod:`qwenfast.demo.data`;
:func:`parse_edit` applies an edit instruction to a scene's spec.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from .data import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZE_THRESHOLD,
    ObjSpec,
    Scene,
    Spec,
    full_spec,
    nearest_position,
)

if TYPE_CHECKING:
    from PIL import Image

MIN_AREA = 30  # px, after a 3x3 opening
THIN = 0.2  # a component keeping less than this fraction of its area through a 5x5 opening is an edge
_PALETTE = np.array([COLOURS[c] for c in COLOURS], dtype=np.float32)
_NAMES = tuple(COLOURS)
_GRID = 24


@dataclass(frozen=True)
class Found:
    colour: str
    shape: str
    pos: str
    size: str
    cx: float
    cy: float
    side: int  # max bbox side, px
    area: int
    iou: float  # best template IoU


@dataclass
class Analysis:
    bg: str
    objects: list[Found] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- pixels


def to_uint8(image: Image.Image | np.ndarray) -> np.ndarray:
    """PIL image, (H, W, 3) uint8 array or float array in [0, 1] -> (H, W, 3) uint8."""
    a = np.asarray(image)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
    if a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"expected an RGB image (H, W, 3), got shape {a.shape}")
    return a


def label_colours(img: np.ndarray) -> np.ndarray:
    """(H, W) index into the named colours, nearest in RGB."""
    d = ((img.astype(np.float32)[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)
    return d.argmin(-1)


def _shift_min(a: np.ndarray, big) -> np.ndarray:
    """4-neighbour minimum (with itself)."""
    out = a.copy()
    out[1:] = np.minimum(out[1:], a[:-1])
    out[:-1] = np.minimum(out[:-1], a[1:])
    out[:, 1:] = np.minimum(out[:, 1:], a[:, :-1])
    out[:, :-1] = np.minimum(out[:, :-1], a[:, 1:])
    return out


def components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, as boolean masks (label propagation; shapes here
    are compact, so this converges in a few dozen rounds)."""
    if not mask.any():
        return []
    big = np.iinfo(np.int64).max
    lab = np.where(mask, np.arange(mask.size).reshape(mask.shape), big)
    while True:
        new = np.where(mask, _shift_min(lab, big), big)
        if np.array_equal(new, lab):
            break
        lab = new
    return [lab == v for v in np.unique(lab[mask])]


def _erode(m: np.ndarray) -> np.ndarray:
    p = np.pad(m, 1)
    out = np.ones_like(m)
    for dy in range(3):
        for dx in range(3):
            out &= p[dy : dy + m.shape[0], dx : dx + m.shape[1]]
    return out


def _dilate(m: np.ndarray) -> np.ndarray:
    p = np.pad(m, 1)
    out = np.zeros_like(m)
    for dy in range(3):
        for dx in range(3):
            out |= p[dy : dy + m.shape[0], dx : dx + m.shape[1]]
    return out


def _normalised(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    crop = mask[y0:y1, x0:x1]
    iy = ((np.arange(_GRID) + 0.5) * crop.shape[0] / _GRID).astype(int)
    ix = ((np.arange(_GRID) + 0.5) * crop.shape[1] / _GRID).astype(int)
    return crop[iy][:, ix]


@lru_cache(maxsize=1)
def _templates() -> dict[str, np.ndarray]:
    from .data import Obj, Scene, render

    out = {}
    for s in SHAPES:
        img = render(Scene("black", (Obj("white", s, cx=64, cy=64, r=50),)))
        out[s] = _normalised(img[:, :, 0] > 128)
    return out


def classify_shape(mask: np.ndarray) -> tuple[str, float]:
    m = _normalised(mask)
    best, best_iou = "unknown", 0.0
    for s, t in _templates().items():
        iou = float((m & t).sum() / max((m | t).sum(), 1))
        if iou > best_iou:
            best, best_iou = s, iou
    return (best if best_iou >= 0.5 else "unknown"), best_iou


def analyse(image: Image.Image | np.ndarray) -> Analysis:
    img = to_uint8(image)
    lab = label_colours(img)
    b = 4
    border = np.concatenate([lab[:b].ravel(), lab[-b:].ravel(), lab[:, :b].ravel(), lab[:, -b:].ravel()])
    bg = int(np.bincount(border, minlength=len(_NAMES)).argmax())
    found = []
    for ci in np.unique(lab):
        if ci == bg:
            continue
        mask = lab == ci
        if _dilate(_erode(mask)).sum() < MIN_AREA:
            continue
        for comp in components(mask):
            area = int(comp.sum())
            if _dilate(_erode(comp)).sum() < MIN_AREA:
                continue
            if _dilate(_dilate(_erode(_erode(comp)))).sum() < THIN * area:
                continue  # a thin band: the blended edge between two colours, not an object
            ys, xs = np.nonzero(comp)
            side = int(max(ys.max() - ys.min() + 1, xs.max() - xs.min() + 1))
            shape, iou = classify_shape(comp)
            cx, cy = float(xs.mean()) + 0.5, float(ys.mean()) + 0.5
            # the star's centroid sits below its bbox centre; positions use the bbox centre
            bx, by = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2
            found.append(
                Found(
                    _NAMES[ci],
                    shape,
                    nearest_position(bx, by),
                    "small" if side <= SIZE_THRESHOLD else "large",
                    cx,
                    cy,
                    side,
                    int(comp.sum()),
                    iou,
                )
            )
    found.sort(key=lambda f: -f.area)
    return Analysis(_NAMES[bg], found)


# --------------------------------------------------------------------------------------------- checks


def check(image: Image.Image | np.ndarray, spec: Spec, analysis: Analysis | None = None) -> dict[str, bool]:
    """Named pass/fail checks of an image against a spec."""
    a = analysis or analyse(image)
    checks: dict[str, bool] = {}
    used = set()
    for i, o in enumerate(spec.objects):
        cands = [f for f in a.objects if f.colour == o.colour]
        f = cands[0] if cands else None  # largest of its colour
        checks[f"object{i}.colour"] = f is not None
        checks[f"object{i}.shape"] = f is not None and f.shape == o.shape
        if o.pos is not None:
            checks[f"object{i}.position"] = f is not None and f.pos == o.pos
        if o.size is not None:
            checks[f"object{i}.size"] = f is not None and f.size == o.size
        if f is not None:
            used.add(id(f))
    if spec.bg is not None:
        checks["background"] = a.bg == spec.bg
    checks["count"] = len(a.objects) == len(spec.objects)
    return checks


def passes(image: Image.Image | np.ndarray, spec: Spec) -> bool:
    return all(check(image, spec).values())


# --------------------------------------------------------------------------------------------- text

_POS_WORDS = ("top", "bottom", "left", "right")
_CENTRE_WORDS = ("centre", "center", "middle")
_SIZE_WORDS = {"small": "small", "large": "large", "big": "large"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def _position(words: list[str]) -> str | None:
    v = [w for w in ("top", "bottom") if w in words]
    h = [w for w in ("left", "right") if w in words]
    if v or h:
        return " ".join(v[:1] + h[:1])
    if any(w in words for w in _CENTRE_WORDS):
        return "centre"
    return None


def _object(words: list[str]) -> ObjSpec:
    colour = next((w for w in words if w in COLOURS or w == "grey"), None)
    shape = next((w for w in words if w in SHAPES), None)
    if colour is None or shape is None:
        raise ValueError(f"cannot find a colour and a shape in {' '.join(words)!r}")
    size = next((_SIZE_WORDS[w] for w in words if w in _SIZE_WORDS), None)
    return ObjSpec("gray" if colour == "grey" else colour, shape, size, _position(words))


def parse_prompt(prompt: str) -> Spec:
    """The meaning of a caption in the demo grammar, e.g. "a small red circle on the left and a blue
    star at the top right, black background" -> Spec."""
    text = prompt.lower().strip()
    bg = None
    m = re.search(r"(?:,|\bon an?)\s+(\w+)\s+background\b", text)
    if m:
        bg = "gray" if m.group(1) == "grey" else m.group(1)
        if bg not in COLOURS:
            raise ValueError(f"unknown background colour {m.group(1)!r}")
        text = text[: m.start()] + text[m.end() :]
    parts = re.split(r"\band\b", text)
    return Spec(tuple(_object(_words(p)) for p in parts if _words(p)), bg)


def parse_edit(instruction: str, before: Spec) -> Spec:
    """The spec an edited picture should meet: `before` (a full spec of the input picture) changed by
    the instruction. Objects are named by their shape."""
    w = _words(instruction)
    objs = list(before.objects)

    def target(shape: str) -> int:
        hits = [i for i, o in enumerate(objs) if o.shape == shape]
        if len(hits) != 1:
            raise ValueError(f"{instruction!r}: the picture has {len(hits)} {shape}s")
        return hits[0]

    if w[:3] == ["make", "the", "background"]:
        return Spec(tuple(objs), w[3])
    if w[0] == "make":  # make the <shape> <colour>
        i = target(w[2])
        objs[i] = ObjSpec(w[3], objs[i].shape, objs[i].size, objs[i].pos)
    elif w[0] == "move":  # move the <shape> to the <position>
        i = target(w[2])
        objs[i] = ObjSpec(objs[i].colour, objs[i].shape, objs[i].size, _position(w[3:]))
    elif w[0] == "remove":
        del objs[target(w[2])]
    elif w[0] == "turn":  # turn the <shape> into a <shape>
        i = target(w[2])
        objs[i] = ObjSpec(objs[i].colour, w[-1], objs[i].size, objs[i].pos)
    elif w[0] == "add":  # add a [size] <colour> <shape> [position]
        objs.append(_object(w[1:]))
    else:
        raise ValueError(f"unknown edit instruction {instruction!r}")
    return Spec(tuple(objs), before.bg)


def edit_spec(before_scene: Scene, instruction: str) -> Spec:
    return parse_edit(instruction, full_spec(before_scene))


# --------------------------------------------------------------------------------------------- suites


@dataclass
class SuiteResult:
    score: float  # % of items whose checks all pass
    attribute: float  # % of single checks that pass
    per_check: dict[str, float]
    items: list[dict]


def summarise(all_checks: list[dict[str, bool]], labels: list[str]) -> SuiteResult:
    per: dict[str, list[bool]] = {}
    for c in all_checks:
        for k, v in c.items():
            per.setdefault(k.split(".")[-1], []).append(v)
    flat = [v for c in all_checks for v in c.values()]
    return SuiteResult(
        score=100.0 * float(np.mean([all(c.values()) for c in all_checks])),
        attribute=100.0 * float(np.mean(flat)),
        per_check={k: 100.0 * float(np.mean(v)) for k, v in sorted(per.items())},
        items=[{"prompt": p, "pass": all(c.values()), "checks": c} for p, c in zip(labels, all_checks)],
    )


def score_prompts(images: Sequence[Image.Image | np.ndarray], prompts: list[str]) -> SuiteResult:
    return summarise([check(img, parse_prompt(p)) for img, p in zip(images, prompts)], prompts)


def score_edits(
    images: Sequence[Image.Image | np.ndarray], befores: Sequence[Scene], instructions: list[str]
) -> SuiteResult:
    checks = [check(img, edit_spec(b, ins)) for img, b, ins in zip(images, befores, instructions)]
    return summarise(checks, instructions)


_ = POSITIONS  # re-exported for callers that draw their own pictures
