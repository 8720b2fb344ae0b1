"""Run the qwenfast nodes inside a real ComfyUI and compare with `qwenfast generate` (same seed).

ComfyUI here is the pip-installable fork (`comfy.client.embedded_comfy_client.Comfy`, which runs
API-format workflows in-process and loads `custom_nodes/` like the server). This script:

1. writes a small LoRA for the embedded demo model (seeded, ComfyUI naming) into models/loras,
2. links this node pack into <dir>/custom_nodes/qwenfast,
3. runs the API workflow loader -> LoRA -> sampler -> SaveImage (workflow_api.json) through ComfyUI,
4. runs `qwenfast generate` with the same model, LoRA, seed, steps, cfg and size,
5. compares the two PNGs and prints / writes one JSON record (result.json).

Usage (ComfyUI importable, e.g. PYTHONPATH=<fork>:$PYTHONPATH):
    python integrations/comfyui/run_workflow.py --dir /tmp/comfy-run --device cpu --record integrations/comfyui/run-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PACK = Path(__file__).resolve().parent
PROMPT = "a small red star at the top left, white background"


def make_lora(path: Path, seed: int = 20, rank: int = 4) -> None:
    """A random rank-`rank` LoRA on every Linear of the demo transformer (ComfyUI / kohya naming with alpha)."""
    import torch
    from safetensors.torch import save_file

    from qwenfast import DEMO_MODEL
    from qwenfast.loading.diffusers_folder import load_transformer

    model = load_transformer(Path(DEMO_MODEL) / "transformer", torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks"):
            down = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            sd[f"diffusion_model.{n}.lora_down.weight"] = down
            sd[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.05
            sd[f"diffusion_model.{n}.alpha"] = torch.tensor(float(rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def workflow(a, lora_name: str) -> dict:
    """The API-format graph (what ComfyUI's 'Save (API)' writes)."""
    return {
        "1": {"class_type": "QwenFastLoader", "inputs": {
            "model": "demo", "device": a.device, "dtype": a.dtype, "fp8": False, "offload": "none",
            "cache": "off", "cuda_graphs": a.device != "cpu", "preset": "none"}},
        "2": {"class_type": "QwenFastLoRA", "inputs": {"model": ["1", 0], "lora_name": lora_name,
                                                       "strength": a.lora_strength}},
        "3": {"class_type": "QwenFastSampler", "inputs": {
            "model": ["2", 0], "prompt": PROMPT, "negative_prompt": " ", "seed": a.seed, "steps": a.steps,
            "cfg": a.cfg, "width": a.size, "height": a.size, "batch_size": 1}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 1], "filename_prefix": "qwenfast"}},
    }  # fmt: skip


async def run_comfy(graph: dict, base: Path) -> tuple[Path, dict]:
    sys.argv = sys.argv[:1]  # ComfyUI parses the command line at import; this script's flags are not its
    from comfy.cli_args import default_configuration
    from comfy.client.embedded_comfy_client import Comfy

    conf = default_configuration()
    conf.cwd = str(base)
    conf.base_directory = str(base)
    conf.output_directory = str(base / "output")
    async with Comfy(configuration=conf, executor="ContextVarExecutor") as client:
        outputs = await client.queue_prompt(graph)
    img = outputs["4"]["images"][0]
    print(f"ComfyUI ran the workflow: SaveImage wrote {img}", flush=True)
    return Path(img.get("abs_path") or base / "output" / img.get("subfolder", "") / img["filename"]), outputs


def run_direct(graph: dict, base: Path) -> Path:
    """The same graph through ComfyUI's node classes called in graph order (`bench peers`' runner: no
    server, executor or front end to install); node "4" (SaveImage) becomes its own rule: uint8(255 x)."""
    from PIL import Image

    from qwenfast.benchmarks.peers_comfyui import import_comfyui
    from qwenfast.benchmarks.peers_comfyui_e2e import node_classes, run_graph

    if os.environ.get("QWENFAST_COMFYUI"):
        import_comfyui()  # the work tree it names, else ComfyUI must be importable already
    sys.argv = sys.argv[:1]
    graph = {k: v for k, v in graph.items() if k != "4"}
    img = run_graph(graph, node_classes(), {})["3"][1][0].float().clamp(0, 1).cpu().numpy()
    path = base / "output" / "qwenfast_direct.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.clip(img * 255.0, 0, 255).astype(np.uint8)).save(path)
    print(f"ComfyUI's node classes ran the workflow: wrote {path}", flush=True)
    return path


def reference_float(a, lora: Path) -> np.ndarray:
    """The float image `qwenfast generate` saves (same model, LoRA, seed and settings), in-process."""
    import torch

    from qwenfast import QwenImagePipeline

    torch.set_float32_matmul_precision("highest")  # as in `qwenfast generate` (importing ComfyUI set "high")
    pipe = QwenImagePipeline.from_pretrained(None, device=a.device, dtype=None if a.dtype == "auto" else a.dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora(str(lora), a.lora_strength)
    out = pipe(PROMPT, negative_prompt=" ", height=a.size, width=a.size, num_inference_steps=a.steps,
               true_cfg_scale=a.cfg, generator=torch.Generator("cpu").manual_seed(a.seed), output_type="np")  # fmt: skip
    return out.images[0].astype(np.float64)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="scratch folder for ComfyUI's base directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cfg", type=float, default=2.0)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--lora-strength", type=float, default=0.8)
    p.add_argument("--tolerance", type=float, default=1e-3, help="GPU: max |difference| of the PNGs in [0, 1] (bf16); on CPU the check is exact to 8 bits")
    p.add_argument("--record", default=None, help="copy workflow, image, log and result here")
    p.add_argument("--extra-site", default=None, help="a folder of packages ComfyUI needs (appended: installed ones win)")
    p.add_argument("--results", default=None, help="append the JSON record to RESULTS/comfyui.jsonl")
    p.add_argument("--direct", action="store_true", help="call ComfyUI's node classes in graph order instead of its "
                   "embedded client (where its server's dependencies are not installed)")
    a = p.parse_args()
    if a.extra_site:
        import site

        site.addsitedir(a.extra_site)

    base = Path(a.dir).resolve()
    if base.exists():
        shutil.rmtree(base)
    (base / "custom_nodes").mkdir(parents=True)
    os.symlink(PACK, base / "custom_nodes" / "qwenfast_comfyui")  # not "qwenfast": that name is the library
    lora = base / "models" / "loras" / "qwenfast_demo_lora.safetensors"
    make_lora(lora)
    graph = workflow(a, str(lora) if a.direct else lora.name)  # embedded: a name under models/loras
    (base / "workflow_api.json").write_text(json.dumps(graph, indent=2))

    t0 = time.perf_counter()
    comfy_png = run_direct(graph, base) if a.direct else asyncio.run(run_comfy(graph, base))[0]
    t_comfy = time.perf_counter() - t0
    ref_png, nolora_png = base / "qwenfast_generate.png", base / "qwenfast_generate_nolora.png"

    def generate(out: Path, loras: list[str]) -> None:
        cmd = [sys.executable, "-m", "qwenfast.cli", "generate", PROMPT, "-o", str(out), "--seed", str(a.seed),
               "--steps", str(a.steps), "--cfg", str(a.cfg), "--size", f"{a.size}x{a.size}", "--device", a.device,
               "--negative", " ", "--quiet", *loras]  # fmt: skip
        cmd += ["--dtype", a.dtype] if a.dtype != "auto" else []
        cmd += ["--no-cuda-graphs"] if a.device == "cpu" else []
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)

    t1 = time.perf_counter()
    generate(ref_png, ["--lora", f"{lora}:{a.lora_strength}"])
    t_cli = time.perf_counter() - t1
    generate(nolora_png, [])  # the LoRA must matter, or the comparison proves little

    from PIL import Image

    def load(path):
        return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)  # 0..255

    c, r, n = load(comfy_png), load(ref_png), load(nolora_png)
    # The two savers quantise differently: ComfyUI's SaveImage truncates (uint8(255 x)), qwenfast rounds
    # (round(255 x)), so the PNGs may differ by one level where they hold the very same float image. So we
    # also make that float image x in-process (the same call `qwenfast generate` makes) and check each PNG
    # against its own saver's rule: both exact <=> ComfyUI's image and generate's are the same x to 8 bits.
    x = reference_float(a, lora)  # (H, W, 3) in [0, 1]
    floor_err = float(np.abs(c - np.clip(np.floor(255 * x), 0, 255)).max()) / 255
    round_err = float(np.abs(r - np.round(255 * x)).max()) / 255
    diff, lora_effect = float(np.abs(c - r).max()) / 255, float(np.abs(r - n).max()) / 255
    same = floor_err == 0 and round_err == 0 if a.device == "cpu" else diff <= a.tolerance
    rec = {"what": "comfyui_workflow_vs_qwenfast_generate", "comfyui": os.environ.get("COMFYUI_LABEL", "?"), "runner": "node classes in graph order" if a.direct else "embedded client", "device": a.device, "dtype": a.dtype, "seed": a.seed,
           "steps": a.steps, "cfg": a.cfg, "size": a.size, "lora_strength": a.lora_strength,
           "png_max_abs_diff": diff, "comfy_png_vs_floor_of_float": floor_err, "generate_png_vs_round_of_float": round_err,
           "tolerance": a.tolerance, "lora_moves_image_by": lora_effect, "comfy_s": round(t_comfy, 2),
           "cli_s": round(t_cli, 2), "ok": bool(same and lora_effect > 10 * a.tolerance)}  # fmt: skip
    print(json.dumps(rec))
    (base / "result.json").write_text(json.dumps(rec, indent=2) + "\n")
    if a.results:
        Path(a.results).mkdir(parents=True, exist_ok=True)
        with open(Path(a.results) / "comfyui.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    if a.record:
        out = Path(a.record)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(base / "workflow_api.json", out / "workflow_api.json")
        shutil.copy(comfy_png, out / "comfyui_output.png")
        shutil.copy(ref_png, out / "qwenfast_generate.png")
        shutil.copy(base / "result.json", out / "result.json")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
