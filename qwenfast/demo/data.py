"""A synthetic world for the demo model: coloured shapes on plain backgrounds, with captions.

Everything is a pure function of a seed (numpy ``Generator``), so the training set, the held-out
suites and the tests are reproducible. Images are 128x128 RGB uint8, drawn with PIL at 2x and
box-filtered down (soft edges).

- :class:`Obj` / :class:`Scene`: what is in a picture (semantic attributes + where it is drawn).
- :func:`render`: Scene -> image.
- :func:`random_scene` + :func:`caption`: a random scene and a caption that mentions some of its
  attributes (colour and shape always; size, position and background sometimes). The caption's
  meaning is a :class:`Spec` (attributes left out are None); :func:`qwenfast.demo.score.parse_prompt`
  recovers it from the text.
- :func:`random_edit`: (before scene, instruction, after scene) for "make the circle red",
  "move the square to the left", "add a blue star", "remove the triangle", "turn the star into a
  circle", "make the background black".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SIZE = 128

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 135, 20),
    "yellow": (245, 215, 30),
    "green": (40, 170, 60),
    "cyan": (40, 200, 220),
    "blue": (35, 70, 215),
    "purple": (135, 55, 185),
    "pink": (245, 125, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")

# Anchor centres (pixels) of the nine named positions.
POSITIONS: dict[str, tuple[int, int]] = {
    "centre": (64, 64),
    "left": (32, 64),
    "right": (96, 64),
    "top": (64, 32),
    "bottom": (64, 96),
    "top left": (32, 32),
    "top right": (96, 32),
    "bottom left": (32, 96),
    "bottom right": (96, 96),
}
POSITION_NAMES = tuple(POSITIONS)
JITTER = 3  # max offset (px) of a drawn centre from its anchor

# Half-extent (px) ranges of the two named sizes; an unnamed size is drawn from the union.
SIZES: dict[str, tuple[int, int]] = {"small": (12, 16), "large": (24, 28)}
SIZE_THRESHOLD = 39  # bbox side (px) that separates small (<=) from large (>), for the analyser

# How a caption says a position ("in the centre" ...); training picks among the synonyms.
POSITION_PHRASES: dict[str, tuple[str, ...]] = {
    "centre": ("in the centre", "in the center", "in the middle"),
    "left": ("on the left",),
    "right": ("on the right",),
    "top": ("at the top",),
    "bottom": ("at the bottom",),
    "top left": ("in the top left corner", "at the top left"),
    "top right": ("in the top right corner", "at the top right"),
    "bottom left": ("in the bottom left corner", "at the bottom left"),
    "bottom right": ("in the bottom right corner", "at the bottom right"),
}
SIZE_WORDS = {"small": ("small",), "large": ("large", "big")}


@dataclass(frozen=True)
class Obj:
    colour: str
    shape: str
    size: str | None = None  # "small" | "large" | None (not said)
    pos: str | None = None  # a POSITIONS key | None (not said)
    cx: float = 64.0  # where it is drawn
    cy: float = 64.0
    r: float = 18.0  # half-extent


@dataclass(frozen=True)
class Scene:
    bg: str
    objects: tuple[Obj, ...]


@dataclass(frozen=True)
class ObjSpec:
    colour: str
    shape: str
    size: str | None = None
    pos: str | None = None


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for; None = not said (anything goes)."""

    objects: tuple[ObjSpec, ...]
    bg: str | None = None


def full_spec(scene: Scene) -> Spec:
    """Every attribute of a scene, sizes and positions included (the expected result of an edit)."""
    return Spec(
        tuple(ObjSpec(o.colour, o.shape, size_of(o.r), nearest_position(o.cx, o.cy)) for o in scene.objects),
        scene.bg,
    )


def size_of(r: float) -> str:
    return "small" if r <= (SIZES["small"][1] + SIZES["large"][0]) / 2 else "large"


def nearest_position(x: float, y: float) -> str:
    return min(POSITIONS, key=lambda p: (POSITIONS[p][0] - x) ** 2 + (POSITIONS[p][1] - y) ** 2)


# --------------------------------------------------------------------------------------------- drawing


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Vertices of a polygonal shape (None for the circle), inside the square [cx-r, cx+r]^2."""
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "cross":
        a = 0.36 * r
        return [
            (cx - a, cy - r),
            (cx + a, cy - r),
            (cx + a, cy - a),
            (cx + r, cy - a),
            (cx + r, cy + a),
            (cx + a, cy + a),
            (cx + a, cy + r),
            (cx - a, cy + r),
            (cx - a, cy + a),
            (cx - r, cy + a),
            (cx - r, cy - a),
            (cx - a, cy - a),
        ]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.45 * r
            ang = -np.pi / 2 + k * np.pi / 5
            pts.append((cx + rad * np.cos(ang), cy + 0.08 * r + rad * np.sin(ang)))  # centred vertically
        return pts
    if shape == "circle":
        return None
    raise ValueError(f"unknown shape {shape!r}")


def render(scene: Scene, size: int = SIZE, supersample: int = 2) -> np.ndarray:
    """Scene -> (size, size, 3) uint8. Objects are drawn in order (later ones on top)."""
    from PIL import Image, ImageDraw

    s = supersample * size / SIZE
    big = Image.new("RGB", (size * supersample, size * supersample), COLOURS[scene.bg])
    draw = ImageDraw.Draw(big)
    for o in scene.objects:
        fill = COLOURS[o.colour]
        poly = shape_polygon(o.shape, o.cx * s, o.cy * s, o.r * s)
        if poly is None:
            draw.ellipse(
                [o.cx * s - o.r * s, o.cy * s - o.r * s, o.cx * s + o.r * s, o.cy * s + o.r * s], fill=fill
            )
        else:
            draw.polygon(poly, fill=fill)
    if supersample > 1:
        big = big.resize((size, size), Image.BOX)
    return np.asarray(big, dtype=np.uint8).copy()


# --------------------------------------------------------------------------------------------- scenes


def _place(rng: np.random.Generator, pos: str, size: str | None) -> tuple[float, float, float]:
    ax, ay = POSITIONS[pos]
    lo, hi = SIZES[size] if size else (SIZES["small"][0], SIZES["large"][1])
    r = float(rng.uniform(lo, hi))
    # keep the whole shape inside the picture
    cx = float(np.clip(ax + rng.uniform(-JITTER, JITTER), r + 1, SIZE - r - 1))
    cy = float(np.clip(ay + rng.uniform(-JITTER, JITTER), r + 1, SIZE - r - 1))
    return cx, cy, r


def _far_enough(p: str, q: str) -> bool:
    (x1, y1), (x2, y2) = POSITIONS[p], POSITIONS[q]
    return (x1 - x2) ** 2 + (y1 - y2) ** 2 >= 60**2


def free_positions(taken: list[str]) -> list[str]:
    """Anchors where a new object cannot touch objects at the `taken` anchors (any sizes)."""
    return [p for p in POSITION_NAMES if all(_far_enough(p, q) for q in taken)]


def random_scene(rng: np.random.Generator, n_objects: int | None = None) -> Scene:
    """1 object (70%) or 2 (30%), distinct colours that differ from the background's."""
    if n_objects is None:
        n_objects = 1 if rng.random() < 0.7 else 2
    bg = COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))]
    colours = rng.permutation([c for c in COLOUR_NAMES if c != bg])[:n_objects]
    objs, taken = [], []
    for colour in colours:
        shape = SHAPES[rng.integers(len(SHAPES))]
        size = ("small", "large")[rng.integers(2)]
        if n_objects == 1:
            pos = POSITION_NAMES[rng.integers(len(POSITION_NAMES))]
        else:
            pos = rng.choice([p for p in free_positions(taken) if p != "centre"])
        taken.append(str(pos))
        cx, cy, r = _place(rng, str(pos), size)
        objs.append(Obj(str(colour), shape, size, str(pos), cx, cy, r))
    return Scene(bg, tuple(objs))


def random_mention(rng: np.random.Generator, scene: Scene) -> Spec:
    """Which attributes a caption says: colour and shape always; size 50%, background 70%;
    position 70% for one object and always for two (so each object can be told apart)."""
    two = len(scene.objects) > 1
    objs = tuple(
        ObjSpec(
            o.colour,
            o.shape,
            o.size if rng.random() < 0.5 else None,
            o.pos if (two or rng.random() < 0.7) else None,
        )
        for o in scene.objects
    )
    return Spec(objs, scene.bg if rng.random() < 0.7 else None)


def caption(spec: Spec, rng: np.random.Generator | None = None) -> str:
    """The text of a Spec. With `rng`, synonyms are picked at random; without, the first of each."""

    def pick(options: Sequence[str]) -> str:
        return options[0] if rng is None else options[rng.integers(len(options))]

    parts = []
    for o in spec.objects:
        words = [pick(SIZE_WORDS[o.size])] if o.size else []
        words += [o.colour, o.shape]
        text = article(words[0]) + " " + " ".join(words)
        if o.pos:
            text += " " + pick(POSITION_PHRASES[o.pos])
        parts.append(text)
    text = " and ".join(parts)
    if spec.bg:
        text += pick((f" on {article(spec.bg)} {spec.bg} background", f", {spec.bg} background"))
    return text


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def spec_key(spec: Spec) -> tuple:
    """Hashable identity of a prompt's meaning (used to keep held-out prompts out of training)."""
    return (spec.bg, tuple((o.colour, o.shape, o.size, o.pos) for o in spec.objects))


def random_example(rng: np.random.Generator) -> tuple[Scene, Spec, str]:
    scene = random_scene(rng)
    spec = random_mention(rng, scene)
    return scene, spec, caption(spec, rng)


def unmentioned_scene(rng: np.random.Generator, spec: Spec) -> Scene:
    """A scene that satisfies `spec`, with the unsaid attributes drawn at random."""
    bg = spec.bg
    if bg is None:
        bg = str(rng.choice([c for c in COLOUR_NAMES if c not in {o.colour for o in spec.objects}]))
    objs, taken = [], [o.pos for o in spec.objects if o.pos]
    for o in spec.objects:
        pos = o.pos
        if pos is None:
            pos = str(rng.choice(free_positions(taken) or ["centre"]))
            taken.append(pos)
        cx, cy, r = _place(rng, pos, o.size)
        objs.append(Obj(o.colour, o.shape, o.size, o.pos, cx, cy, r))
    return Scene(bg, tuple(objs))


# --------------------------------------------------------------------------------------------- edits

EDIT_KINDS = ("recolour", "move", "add", "remove", "reshape", "background")


def _unique_shapes(scene: Scene) -> list[Obj]:
    shapes = [o.shape for o in scene.objects]
    return [o for o in scene.objects if shapes.count(o.shape) == 1]


def random_edit(
    rng: np.random.Generator, kind: str | None = None, max_tries: int = 50
) -> tuple[Scene, str, Scene]:
    """(before, instruction, after). The instruction names objects by shape (unique in the scene)."""
    for _ in range(max_tries):
        k = kind or EDIT_KINDS[rng.integers(len(EDIT_KINDS))]
        n = 1 if rng.random() < 0.6 else 2
        if k == "remove":
            n = 2
        before = random_scene(rng, n)
        out = _apply_random(rng, before, k)
        if out is not None:
            return before, out[0], out[1]
    raise RuntimeError(f"could not make a {kind} edit")


def _apply_random(rng, before: Scene, kind: str):
    targets = _unique_shapes(before)
    used = {o.colour for o in before.objects}
    objs = list(before.objects)
    if kind == "background":
        options = [c for c in COLOUR_NAMES if c not in used and c != before.bg]
        bg = str(rng.choice(options))
        return f"make the background {bg}", Scene(bg, before.objects)
    if kind == "add":
        if len(objs) >= 2:
            return None
        free = [p for p in free_positions([o.pos for o in objs]) if p != "centre"]
        options = [c for c in COLOUR_NAMES if c not in used and c != before.bg]
        if not free or not options:
            return None
        colour, shape, pos = (
            str(rng.choice(options)),
            SHAPES[rng.integers(len(SHAPES))],
            str(rng.choice(free)),
        )
        size = ("small", "large")[rng.integers(2)]
        cx, cy, r = _place(rng, pos, size)
        say_pos = rng.random() < 0.5
        text = f"add {article(colour)} {colour} {shape}" + (f" {POSITION_PHRASES[pos][0]}" if say_pos else "")
        return text, Scene(before.bg, (*objs, Obj(colour, shape, size, pos, cx, cy, r)))
    if not targets:
        return None
    t = targets[rng.integers(len(targets))]
    i = objs.index(t)
    if kind == "recolour":
        options = [c for c in COLOUR_NAMES if c not in used and c != before.bg]
        colour = str(rng.choice(options))
        objs[i] = dataclasses.replace(t, colour=colour)
        return f"make the {t.shape} {colour}", Scene(before.bg, tuple(objs))
    if kind == "move":
        others = [o.pos for o in objs if o is not t]
        free = [p for p in free_positions(others) if p != t.pos and (not others or p != "centre")]
        if not free:
            return None
        pos = str(rng.choice(free))
        ax, ay = POSITIONS[pos]
        dx, dy = t.cx - POSITIONS[t.pos][0], t.cy - POSITIONS[t.pos][1]  # keep the jitter
        cx = float(np.clip(ax + dx, t.r + 1, SIZE - t.r - 1))
        cy = float(np.clip(ay + dy, t.r + 1, SIZE - t.r - 1))
        objs[i] = dataclasses.replace(t, pos=pos, cx=cx, cy=cy)
        return f"move the {t.shape} to the {move_phrase(pos)}", Scene(before.bg, tuple(objs))
    if kind == "remove":
        del objs[i]
        return f"remove the {t.shape}", Scene(before.bg, tuple(objs))
    if kind == "reshape":
        options = [s for s in SHAPES if s not in {o.shape for o in objs}]
        shape = str(rng.choice(options))
        objs[i] = dataclasses.replace(t, shape=shape)
        return f"turn the {t.shape} into {article(shape)} {shape}", Scene(before.bg, tuple(objs))
    raise ValueError(f"unknown edit kind {kind!r}")


def move_phrase(pos: str) -> str:
    return {
        "centre": "centre",
        "top left": "top left corner",
        "top right": "top right corner",
        "bottom left": "bottom left corner",
        "bottom right": "bottom right corner",
    }.get(pos, pos)


# --------------------------------------------------------------------------------------------- suites

EVAL_SEED = 20261121
EDIT_EVAL_SEED = 20261122


def eval_prompts(n: int = 120, seed: int = EVAL_SEED) -> list[tuple[str, Spec]]:
    """The held-out text-to-image suite: `n` distinct prompts (fixed by `seed`). Training skips every
    scene whose meaning (:func:`spec_key`) equals one of these."""
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    while len(out) < n:
        _, spec, text = random_example(rng)
        if spec_key(spec) in seen:
            continue
        seen.add(spec_key(spec))
        out.append((text, spec))
    return out


def eval_edits(n: int = 36, seed: int = EDIT_EVAL_SEED) -> list[tuple[Scene, str, Scene]]:
    """The held-out edit suite: `n` (before, instruction, after) triples, each edit kind equally often."""
    rng = np.random.default_rng(seed)
    return [random_edit(rng, EDIT_KINDS[i % len(EDIT_KINDS)]) for i in range(n)]


def edit_key(before: Scene, instruction: str) -> tuple:
    return (spec_key(full_spec(before)), instruction)
