"""diffusers 0.42.1's own documented examples, run with qwenfast and with diffusers on tiny models.

Each Qwen-Image pipeline module of diffusers carries a usage example (`EXAMPLE_DOC_STRING`). This
test extracts each one from the installed diffusers source and runs it twice: once with its
`from diffusers import X` turned into `from qwenfast import X` (the only change a user makes), once
as it is, against diffusers. Both runs get the same mechanical rewrites, listed below and applied by
exact string replacement (each must match, so a changed example fails here instead of being skipped):

- hub ids -> local folders of tiny random models (`Qwen/Qwen-Image` -> a tiny Qwen-Image, ...) and
  image URLs -> local generated pictures (`diffusers.utils.load_image` reads them);
- `.to("cuda")` -> `.to("cpu")` and `torch.bfloat16` -> `torch.float32` (CPU, fp32 comparisons);
- per example, fewer steps and smaller sizes (CPU speed), written out in `EXAMPLES`;
- `torch.manual_seed(SEED)` inserted before each pipeline call: the examples pass no generator, so
  both libraries draw their noise from torch's global RNG; seeding it right before the call gives
  both the same noise (model loading may use the global RNG differently, so seeding at the top
  would not be fair).

Three size constants are shrunk for both libraries by patching (the examples' pictures are resized to
~1024² areas inside the pipelines, minutes per step of a tiny model on a CPU): the edit areas
(diffusers' `calculate_dimensions` / `VAE_IMAGE_SIZE` / `CONDITION_IMAGE_SIZE`, qwenfast's `VL_AREA` /
`VAE_AREA`) and the Layered picture area (both `calculate_dimensions`). diffusers loads the edit,
Layered and 2.1 processors through a torchvision-free stand-in (`qwenfast.testing`), since
transformers wants torchvision for them otherwise.

Outputs are the PNG files each example saves (plus the result variables it does not save), compared
as 8-bit images: a float difference far below 1e-3 can still flip one rounding, so at most 1 level
(and few such pixels) may differ. Tiny random models barely react to their inputs, so each example
is also run through diffusers with one input changed (a prompt word, a picture or the mask): its
output must move by >= 10 levels, so that the comparison could fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

SEED = 0
TOL = 1  # 8-bit levels
EDIT_AREA = 96 * 64  # the edit models' VAE (and v1 VL) area instead of 1024²
EDIT_VL_AREA = 64 * 64  # Edit-2509's VL area instead of 384²
LAYERED_AREA = 64 * 64  # Qwen-Image-Layered's picture area instead of resolution² (640²)
DIFFUSERS_MODULES = {
    "text-to-image": "diffusers.pipelines.qwenimage.pipeline_qwenimage",
    "img2img": "diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img",
    "inpaint": "diffusers.pipelines.qwenimage.pipeline_qwenimage_inpaint",
    "edit": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit",
    "edit-plus": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus",
    "edit-inpaint": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint",
    "controlnet": "diffusers.pipelines.qwenimage.pipeline_qwenimage_controlnet",
    "controlnet-inpaint": "diffusers.pipelines.qwenimage.pipeline_qwenimage_controlnet_inpaint",
    "layered": "diffusers.pipelines.qwenimage.pipeline_qwenimage_layered",
    "2.1": "diffusers.pipelines.qwenimage21.pipeline_qwenimage21",
}


@dataclass
class Example:
    rewrites: list[tuple[str, str, int]]  # (old, new, occurrences) for CPU speed
    perturb: tuple[str, str]  # one input changed (text, or picture keys), for the diffusers-only sensitivity run
    results: tuple[str, ...] = ()  # variables compared besides the saved files
    compare_files: bool = True
    notes: list[str] = field(default_factory=list)


EXAMPLES = {
    "text-to-image": Example(
        rewrites=[("num_inference_steps=50)", "num_inference_steps=2, height=64, width=64)", 1)],
        perturb=('"A cat holding', '"A dog holding'),
    ),
    "img2img": Example(
        rewrites=[(".resize((1024, 1024))", ".resize((64, 64))", 1),
                  ("strength=0.95)", "strength=0.95, num_inference_steps=2, height=64, width=64)", 1)],
        perturb=('"cat wizard,', '"dog wizard,'),
    ),
    "inpaint": Example(
        rewrites=[("strength=0.85)", "strength=0.85, num_inference_steps=2, height=64, width=64)", 1)],
        perturb=("Face of a yellow cat", "Face of a green dog"),
    ),
    "edit": Example(rewrites=[("num_inference_steps=50)", "num_inference_steps=2)", 1)],
                    perturb=("Make Pikachu hold", "Make Pikachu drop")),
    "edit-plus": Example(rewrites=[("num_inference_steps=50)", "num_inference_steps=2)", 1)],
                         perturb=("PIKACHU", "FLAT")),  # a prompt word moves a 64² VL encode too little
    "edit-inpaint": Example(rewrites=[("num_inference_steps=50\n", "num_inference_steps=2\n", 1)],
                            perturb=("Face of a yellow cat", "Face of a green dog")),
    "controlnet": Example(
        rewrites=[("num_inference_steps=30,", "num_inference_steps=2, height=64, width=64,", 2)],
        perturb=("traditional asian pagoda", "modern glass tower"),
    ),
    "controlnet-inpaint": Example(
        rewrites=[("true_cfg_scale=4.0,\n", "true_cfg_scale=4.0, num_inference_steps=2,\n", 1)],
        perturb=("MASK1", "MASK2"),  # the mask's file
        results=("result",),
        compare_files=False,  # the example saves its input picture (`image.save`), not `result`
    ),
    "layered": Example(rewrites=[("num_inference_steps=50,", "num_inference_steps=2,", 1)],
                       perturb=("PIKACHU", "FLAT")),  # the picture (an empty prompt: it is captioned)
    "2.1": Example(rewrites=[("pipe(prompt)", "pipe(prompt, num_inference_steps=2, output_resolution=64)", 1)],
                   perturb=('"A capybara wearing', '"A hamster wearing')),
}


def example_code(name: str) -> str:
    """The code block of a diffusers module's EXAMPLE_DOC_STRING, without its >>> / ... prompts."""
    mod = importlib.import_module(DIFFUSERS_MODULES[name])
    doc = mod.EXAMPLE_DOC_STRING
    block = re.search(r"```py\n(.*?)```", doc, re.S)
    assert block, f"{name}: no ```py block in EXAMPLE_DOC_STRING"
    lines = []
    for line in block.group(1).splitlines():
        s = line.strip()
        if s.startswith(">>> ") or s.startswith("... ") or s in (">>>", "..."):
            lines.append(s[4:])
    code = "\n".join(lines) + "\n"
    ast.parse(code)
    return code


def replace(code: str, old: str, new: str, count: int | None = None, what: str = "") -> str:
    n = code.count(old)
    if n == 0 or (count is not None and n != count):
        raise AssertionError(f"{what}: expected {count or '>= 1'} x {old!r} in the example, found {n}")
    return code.replace(old, new)


def rewrite(name: str, code: str, folders: dict[str, str], pictures: dict[str, str]) -> str:
    """The mechanical rewrites of the module docstring (both libraries)."""
    for hub, folder in folders.items():
        if f'"{hub}"' in code:
            code = code.replace(f'"{hub}"', json.dumps(folder))
    for url, key in URLS.items():
        if f'"{url}"' in code:
            code = code.replace(f'"{url}"', f'"{key}"')
    for key, path in pictures.items():
        code = code.replace(f'"{key}"', json.dumps(path))
    code = replace(code, '.to("cuda")', '.to("cpu")', what=name)
    code = code.replace("torch.bfloat16", "torch.float32")
    for old, new, count in EXAMPLES[name].rewrites:
        code = replace(code, old, new, count, name)
    out = []
    for line in code.splitlines():  # seed torch's global RNG right before each pipeline call
        if re.search(r"=\s*pipe\(", line):
            out.append(line[: len(line) - len(line.lstrip())] + f"torch.manual_seed({SEED})")
        out.append(line)
    return "\n".join(out) + "\n"


def for_qwenfast(code: str) -> str:
    """The user's one change: `from diffusers import X` -> `from qwenfast import X`."""
    return re.sub(r"^from diffusers import ", "from qwenfast import ", code, flags=re.M)


URLS = {
    "https://huggingface.co/datasets/huggingface/documentation-images/resolve/main/diffusers/yarn-art-pikachu.png":
        "PIKACHU",
    "https://raw.githubusercontent.com/CompVis/stable-diffusion/main/assets/stable-samples/img2img/sketch-mountains-input.jpg":
        "SKETCH",
    "https://raw.githubusercontent.com/CompVis/latent-diffusion/main/data/inpainting_examples/overture-creations-5sI6fQgYIuo.png":
        "OVERTURE",
    "https://raw.githubusercontent.com/CompVis/latent-diffusion/main/data/inpainting_examples/overture-creations-5sI6fQgYIuo_mask.png":
        "OVERTURE_MASK",
    "https://huggingface.co/InstantX/Qwen-Image-ControlNet-Union/resolve/main/conds/canny.png": "CANNY",
    "https://huggingface.co/InstantX/Qwen-Image-ControlNet-Inpainting/resolve/main/assets/images/image1.png":
        "IMAGE1",
    "https://huggingface.co/InstantX/Qwen-Image-ControlNet-Inpainting/resolve/main/assets/masks/mask1.png":
        "MASK1",
}  # fmt: skip


def _noise(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _ellipse(w: int, h: int, box: tuple):
    from PIL import Image, ImageDraw

    m = Image.new("L", (w, h), 0)
    ImageDraw.Draw(m).ellipse(box, fill=255)
    return m


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tiny_t2i, tmp_path_factory):
    """hub id -> a tiny model folder of the same kind (diffusers layout)."""
    from qwenfast.testing.tiny import build_tiny_pipeline
    from qwenfast.testing.tiny21 import build_tiny21_pipeline
    from qwenfast.testing.tiny_control import build_controlnet, build_tiny_layered

    root = tmp_path_factory.mktemp("examples")
    build_tiny_pipeline(root / "edit", seed=0, edit="edit")
    build_tiny_pipeline(root / "edit-plus", seed=0, edit="edit-plus")
    build_tiny_layered(root / "layered", seed=0)
    build_tiny21_pipeline(root / "qwen-image-2.1", seed=0)
    dim = tiny_t2i[0].text_encoder.config.text_config.hidden_size
    build_controlnet(dim, seed=1).save_pretrained(root / "cn-union")
    build_controlnet(dim, seed=2, extra_condition_channels=4).save_pretrained(root / "cn-inpaint")
    return {
        "Qwen/Qwen-Image": str(tiny_t2i[1]),
        "Qwen/Qwen-Image-Edit": str(root / "edit"),
        "Qwen/Qwen-Image-Edit-2509": str(root / "edit-plus"),
        "Qwen/Qwen-Image-Layered": str(root / "layered"),
        "Qwen/Qwen-Image-2.1": str(root / "qwen-image-2.1"),
        "InstantX/Qwen-Image-ControlNet-Union": str(root / "cn-union"),
        "InstantX/Qwen-Image-ControlNet-Inpainting": str(root / "cn-inpaint"),
    }


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, str]:
    """The examples' pictures, generated: random noise (what a tiny random model sees best), masks
    with a white (repaint) ellipse, and a flat picture for the perturbation runs."""
    from PIL import Image

    d = tmp_path_factory.mktemp("pictures")
    items = {
        "PIKACHU": _noise(72, 40, 1), "SKETCH": _noise(80, 56, 2), "OVERTURE": _noise(64, 64, 3),
        "OVERTURE_MASK": _ellipse(64, 64, (8, 8, 40, 48)), "CANNY": _noise(64, 64, 4),
        "IMAGE1": _noise(64, 64, 5), "MASK1": _ellipse(64, 64, (16, 8, 56, 40)),
        "MASK2": _ellipse(64, 64, (0, 24, 40, 64)), "FLAT": Image.new("RGB", (72, 40), (250, 250, 250)),
    }  # fmt: skip
    out = {}
    for key, im in items.items():
        out[key] = str(d / f"{key.lower()}.png")
        im.save(out[key])
    return out


@contextlib.contextmanager
def small_areas():
    """The edit and Layered areas shrunk for both libraries (see the module docstring)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as d_edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint as d_edit_inpaint
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as d_plus
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as d_layered

    import qwenfast.pipeline.edit as q_edit
    import qwenfast.pipeline.layered as q_layered

    def area(mod, new):
        real = mod.calculate_dimensions
        return mock.patch.object(mod, "calculate_dimensions",
                                 lambda a, ratio: real(new if a == 1024 * 1024 else a, ratio))  # fmt: skip

    q_real = q_layered.calculate_dimensions
    with contextlib.ExitStack() as stack:
        for m in (area(d_edit, EDIT_AREA), area(d_edit_inpaint, EDIT_AREA), area(d_plus, EDIT_AREA),
                  mock.patch.object(d_plus, "VAE_IMAGE_SIZE", EDIT_AREA),
                  mock.patch.object(d_plus, "CONDITION_IMAGE_SIZE", EDIT_VL_AREA),
                  mock.patch.object(d_layered, "calculate_dimensions",
                                    lambda a, ratio, real=d_layered.calculate_dimensions: real(LAYERED_AREA, ratio)),
                  mock.patch.dict(q_edit.VL_AREA, {"edit": EDIT_AREA, "edit-plus": EDIT_VL_AREA}),
                  mock.patch.object(q_edit, "VAE_AREA", EDIT_AREA),
                  mock.patch.object(q_layered, "calculate_dimensions",
                                    lambda a, ratio: q_real(LAYERED_AREA, ratio))):  # fmt: skip
            stack.enter_context(m)
        yield


@contextlib.contextmanager
def diffusers_processors():
    """diffusers loads the processors of the saved tiny folders through the torchvision-free builders."""
    import transformers

    from qwenfast.testing import tiny, tiny21

    with mock.patch.object(transformers.Qwen2VLProcessor, "from_pretrained",
                           classmethod(lambda cls, path, **kw: tiny.load_processor(path))), \
         mock.patch.object(transformers.Qwen3VLProcessor, "from_pretrained",
                           classmethod(lambda cls, path, **kw: tiny21.load_processor(path))):  # fmt: skip
        yield


def run(code: str, cwd: Path, results: tuple[str, ...], shims, library: str) -> dict[str, np.ndarray]:
    """Execute an example in `cwd`; -> {saved file or result variable: 8-bit image(s)}. Checks that the
    pipeline it built (`pipe`) is `library`'s."""
    cwd.mkdir(parents=True, exist_ok=True)
    ns: dict = {"__name__": "__diffusers_example__"}
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with small_areas(), shims:
            exec(compile(code, str(cwd / "example.py"), "exec"), ns)  # noqa: S102 - diffusers' own example
    finally:
        os.chdir(old)
    assert type(ns["pipe"]).__module__.split(".")[0] == library, type(ns["pipe"])
    out = {p.name: np.asarray(_open(p), dtype=np.int16) for p in sorted(cwd.glob("*.png"))}
    for r in results:
        out[r] = np.asarray(ns[r], dtype=np.int16)
    return out


def _open(p: Path):
    from PIL import Image

    with Image.open(p) as im:
        return im.copy()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_diffusers_example_runs_on_qwenfast_with_diffusers_pixels(name, models, pictures, tmp_path):
    ex = EXAMPLES[name]
    code = rewrite(name, example_code(name), models, pictures)
    assert "from diffusers import" in code
    ours = run(for_qwenfast(code), tmp_path / "qwenfast", ex.results, contextlib.nullcontext(), "qwenfast")
    theirs = run(code, tmp_path / "diffusers", ex.results, diffusers_processors(), "diffusers")
    old, new = ex.perturb
    if old in pictures:  # another picture file
        old, new = json.dumps(pictures[old]), json.dumps(pictures[new])
    moved = run(replace(code, old, new, what=name), tmp_path / "perturbed", ex.results, diffusers_processors(),
                "diffusers")
    keys = [k for k in theirs if ex.compare_files or k in ex.results]
    assert keys and sorted(ours) == sorted(theirs)
    for k in keys:
        a, b = ours[k], theirs[k]
        assert a.shape == b.shape, (k, a.shape, b.shape)
        assert b.std() > 5, f"{k}: diffusers' output is flat"  # a picture, not a constant
        diff = np.abs(a - b)
        print(f"{name} {k}: max diff {int(diff.max())}, {100 * float((diff > 0).mean()):.3f}% differ; "
              f"perturbed: max {int(np.abs(moved[k] - b).max())}")
        assert diff.max() <= TOL and (diff > 0).mean() < 0.01, (k, int(diff.max()), float((diff > 0).mean()))
    assert max(int(np.abs(moved[k] - theirs[k]).max()) for k in keys) >= 10 * TOL, "the changed input moved nothing"


def test_every_qwen_pipeline_module_has_an_example_here():
    """A diffusers upgrade that adds a Qwen-Image pipeline module (with its example) shows up here."""
    import diffusers.pipelines.qwenimage as q
    import diffusers.pipelines.qwenimage21 as q21

    mods = {f"{pkg.__name__}.{p.stem}" for pkg in (q, q21) for p in Path(pkg.__file__).parent.glob("pipeline_*.py")
            if p.stem != "pipeline_output"}  # fmt: skip
    assert mods == set(DIFFUSERS_MODULES.values())
