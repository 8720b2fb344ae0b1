"""ComfyUI end to end: its own Qwen-Image workflow beside the qwenfast nodes, inside one ComfyUI, over
the same seeded weights written as ComfyUI's three model files. A `bench peers` engine
(`comfyui-workflow`), end-to-end cases only.

Why: a ComfyUI user compares whole workflows (prompt in, image saved), not transformer forwards. The
native graph is the one ComfyUI's Qwen-Image template builds: UNETLoader (the transformer as a scaled
fp8 file, as ComfyUI distributes it), CLIPLoader type qwen_image, VAELoader, ModelSamplingAuraFlow
(shift 3.1), two CLIPTextEncode, EmptySD3LatentImage, KSampler (euler, simple), VAEDecode. The
qwenfast graph loads the same three files with QwenFastLoader (FP8 on, CUDA graphs on) and runs
QwenFastSampler. Both end at their IMAGE output (SaveImage's 8-bit rule is applied to it here, the PNG
write left out of both). Same steps, CFG scale, size and one model call per step
(both samplers are first-order Euler); their sigma schedules differ (ComfyUI's shift 3.1 against
Qwen-Image's dynamic shift), so the images are not compared with diffusers' (the node pack's image is
checked against `qwenfast generate` by integrations/comfyui/run_workflow.py).

Timing: each graph runs once with 2 steps (ComfyUI loads its models, qwenfast captures its graphs),
then once timed with a new seed and prompt (so ComfyUI's node cache re-runs the text encoder and the
sampler, as a user's next prompt does). ComfyUI's models are unloaded before the qwenfast graph runs.
ComfyUI comes from `$QWENFAST_COMFYUI` (peers_comfyui); the node pack from integrations/comfyui. The
graphs run through ComfyUI's node classes, called in graph order with its node-cache rule (`run_graph`),
not its server or embedded client, whose own dependencies (PyAV and more) the GPU machine may lack.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .peers_comfyui import import_comfyui, scaled_fp8, to_comfy

FILES = {  # ComfyUI models folder -> file name (the names of ComfyUI's own Qwen-Image downloads)
    "diffusion_models": "qwen_image_fp8_e4m3fn.safetensors",
    "text_encoders": "qwen_2.5_vl_7b.safetensors",
    "vae": "qwen_image_vae.safetensors",
}
ROWS = ("ComfyUI native workflow (fp8 scaled file)", "qwenfast nodes in ComfyUI (FP8, same files)")
SHIFT = 3.1  # ModelSamplingAuraFlow in ComfyUI's Qwen-Image template
NODE_PACK = Path(__file__).resolve().parents[2] / "integrations" / "comfyui"


# ------------------------------------------------------------------------------------------------ files
def legacy_te_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Qwen2.5-VL names (`model.language_model.*`, `model.visual.*`) -> the names of
    ComfyUI's text-encoder files (`model.*`, `visual.*`); `loading.single_file._te_name` reads both."""
    out = {}
    for k, v in sd.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model.") :]
        elif k.startswith("model.visual."):
            k = "visual." + k[len("model.visual.") :]
        out[k] = v
    return out


def comfy_files(pipe) -> dict[str, dict[str, torch.Tensor]]:
    """diffusers' pipeline -> the tensors of ComfyUI's three files, by models folder (on the CPU)."""
    from ..loading.wan_vae_keys import diffusers_to_wan_vae_keys

    def cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}

    fp8: dict[str, torch.Tensor] = {}
    for k, v in to_comfy(pipe.transformer.state_dict()).items():  # one tensor at a time: the GPU holds
        fp8.update(cpu(scaled_fp8({k: v})))  # the whole pipeline already (each call adds the marker)
    vsd = pipe.vae.state_dict()
    wan = diffusers_to_wan_vae_keys(list(vsd))
    return {
        "diffusion_models": fp8,
        "text_encoders": cpu(legacy_te_names(pipe.text_encoder.state_dict())),
        "vae": cpu({wan[k]: v for k, v in vsd.items()}),
    }


def write_files(pipe, base: Path) -> dict[str, Path]:
    """Write ComfyUI's three files under base/models/<folder>/; their paths by folder."""
    from safetensors.torch import save_file

    paths = {}
    for folder, sd in comfy_files(pipe).items():
        path = base / "models" / folder / FILES[folder]
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(sd, str(path))
        paths[folder] = path
        print(f"wrote {path} ({path.stat().st_size / 2**30:.1f} GiB)", flush=True)
    return paths


# ------------------------------------------------------------------------------------------------ graphs
def native_graph(size: int, steps: int, cfg: float, seed: int, prompt: str) -> dict:
    """ComfyUI's Qwen-Image template as an API-format graph (what "Save (API)" writes)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FILES["diffusion_models"], "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": FILES["text_encoders"], "type": "qwen_image"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": FILES["vae"]}},
        "4": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": SHIFT}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["2", 0]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": " ", "clip": ["2", 0]}},
        "7": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["4", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0],
            "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
    }  # fmt: skip


def qwenfast_graph(
    paths: dict[str, Path],
    tokenizer: Path,
    size: int,
    steps: int,
    cfg: float,
    seed: int,
    prompt: str,
    device: str = "cuda",
) -> dict:
    """The node pack over the same files: QwenFastLoader (FP8 and CUDA graphs on a GPU; fp32 on the CPU)
    -> QwenFastSampler."""
    gpu = device != "cpu"
    return {
        "1": {"class_type": "QwenFastLoader", "inputs": {
            "model": "", "device": device, "dtype": "bf16" if gpu else "fp32", "fp8": gpu, "offload": "none",
            "cache": "off", "cuda_graphs": gpu, "preset": "none", "transformer": str(paths["diffusion_models"]),
            "vae": str(paths["vae"]), "text_encoder": str(paths["text_encoders"]), "tokenizer": str(tokenizer),
            "mode": "text-to-image"}},
        "2": {"class_type": "QwenFastSampler", "inputs": {
            "model": ["1", 0], "prompt": prompt, "negative_prompt": " ", "seed": seed, "steps": steps,
            "cfg": cfg, "width": size, "height": size, "batch_size": 1}},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ running
def node_classes() -> dict[str, type]:
    """ComfyUI's node classes the graphs use (its base nodes, the SD3 latent and model-sampling nodes)
    and the qwenfast node pack's, by class_type."""
    import importlib.util

    import comfy.nodes.base_nodes as base
    from comfy_extras.nodes import nodes_model_advanced, nodes_sd3

    name = "qwenfast_comfyui"  # not "qwenfast": that name is the library
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, NODE_PACK / "__init__.py", submodule_search_locations=[str(NODE_PACK)]
        )
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    classes = dict(base.NODE_CLASS_MAPPINGS)
    classes["ModelSamplingAuraFlow"] = nodes_model_advanced.ModelSamplingAuraFlow
    classes["EmptySD3LatentImage"] = nodes_sd3.EmptySD3LatentImage
    return classes | dict(sys.modules[name].NODE_CLASS_MAPPINGS)


def run_graph(graph: dict, classes: dict[str, type], cache: dict) -> dict[str, tuple]:
    """Run an API-format graph by calling each node as ComfyUI's executor does (`FUNCTION` on an
    instance, or a v3 node's `execute`), upstream first. A node whose class and inputs (upstream nodes
    by their own keys) are unchanged since an earlier run reuses that run's outputs, as ComfyUI's node
    cache does: the loaders load once; a changed seed or prompt re-runs what depends on it."""
    outs: dict[str, tuple] = {}
    keys: dict[str, str] = {}

    def key(nid: str) -> str:
        if nid not in keys:
            node = graph[nid]
            ins = {k: ["@", key(v[0]), v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
            keys[nid] = json.dumps([node["class_type"], ins], sort_keys=True)
        return keys[nid]

    def run(nid: str) -> tuple:
        if nid not in outs and key(nid) in cache:
            outs[nid] = cache[key(nid)]
        if nid in outs:
            return outs[nid]
        node = graph[nid]
        cls = classes[node["class_type"]]
        kw = {k: run(v[0])[v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
        fn = getattr(cls, "FUNCTION", None)
        r = getattr(cls(), fn)(**kw) if fn and fn != "EXECUTE_NORMALIZED" else cls.execute(**kw)
        r = r.result if not isinstance(r, (tuple, list, dict)) else r  # v3: NodeOutput
        r = r["result"] if isinstance(r, dict) else r
        outs[nid] = cache[key(nid)] = tuple(r)
        return outs[nid]

    for nid in graph:
        run(nid)
    return outs


def _run_all(jobs: list[tuple[str, str, Callable]], emit, fp) -> None:
    """jobs: (row, case, graph(warm) -> (graph, (node, output) of its IMAGE)); each job runs once with
    2 steps (warm-up), then timed with its own seed and prompt."""
    import comfy.model_management as mm

    classes, cache, last = node_classes(), {}, None
    for row, case, graph in jobs:
        if last is not None and row != last:  # the native models leave the GPU before qwenfast loads
            cache.clear()
            mm.unload_all_models()
            mm.soft_empty_cache()
        last = row
        t0 = time.perf_counter()
        g, _ = graph(warm=True)
        with torch.inference_mode():
            run_graph(g, classes, cache)
        setup = round(time.perf_counter() - t0, 1)
        g, (nid, idx) = graph(warm=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.inference_mode():
            img = run_graph(g, classes, cache)[nid][idx]  # IMAGE (1, H, W, 3) in [0, 1]
        torch.cuda.synchronize()
        r = {
            "s": round(time.perf_counter() - t0, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        }
        r["out"] = np.floor(255 * img[0].float().clamp(0, 1).cpu().numpy()) / 255  # SaveImage's 8 bits
        print(f"{row} {case}: {r['s']} s (warm-up run {setup} s)", flush=True)
        emit(row, case, r, fingerprint=fp, setup_s=setup, not_compared="ComfyUI's sampler schedule")


def run_comfyui_e2e(cases: list[str], emit, smoke: bool, helpers: SimpleNamespace) -> None:
    """Rows ROWS for the end-to-end cases (the GPU only: ComfyUI builds Qwen-Image at its full size)."""
    if smoke:
        print("comfyui-workflow: ComfyUI's Qwen-Image workflow needs the full-size model; nothing on the CPU")
        return
    import_comfyui()
    from ..about import DEMO_MODEL

    pipe = helpers.build_diffusers(False)
    fp = helpers.fingerprint(pipe.transformer.transformer_blocks, pipe.vae, pipe.text_encoder)
    base = Path(tempfile.mkdtemp(prefix="qwenfast-comfyui-", dir=os.environ.get("QWENFAST_SCRATCH")))
    try:
        paths = write_files(pipe, base)
        del pipe
        helpers.free()
        from comfy.cmd import folder_paths  # its loaders look the file names up under base/models

        for folder, path in paths.items():
            folder_paths.add_model_folder_path(folder, str(path.parent), is_default=True)
        tok = Path(DEMO_MODEL) / "tokenizer"
        jobs = []
        for native, row in ((True, ROWS[0]), (False, ROWS[1])):
            for case in cases:
                _, size, steps, cfg = helpers.CASES[case]
                scale = 4.0 if cfg else 1.0

                def graph(warm: bool, native=native, case=case, size=size, steps=steps, scale=scale):
                    seed, prompt = (1, "a lighthouse at dusk") if warm else (2, f"{helpers.PROMPT} ({case})")
                    n = 2 if warm else steps
                    if native:
                        return native_graph(size, n, scale, seed, prompt), ("9", 0)
                    return qwenfast_graph(paths, tok, size, n, scale, seed, prompt), ("2", 1)

                jobs.append((row, case, graph))
        _run_all(jobs, emit, fp)
    finally:
        shutil.rmtree(base, ignore_errors=True)
