"""`bench peers --engine comfyui-workflow`: ComfyUI's three files from the shared weights, the two graphs,
and the graph runner's cache (CI, without ComfyUI). The run itself needs ComfyUI at Qwen-Image's full
size (a GPU); integrations/comfyui/run_workflow.py --direct checks the node pack through the same runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwenfast.benchmarks import peers, peers_comfyui
from qwenfast.benchmarks import peers_comfyui_e2e as E


@pytest.fixture(scope="module")
def demo_pipe():
    from qwenfast.benchmarks.peers_worker import build_diffusers

    return build_diffusers(smoke=True)


def test_three_files_are_what_qwenfast_loads_back(demo_pipe, tmp_path):
    """Written as ComfyUI names them, read back by qwenfast's single-file loader: same pixels as the
    diffusers folder they came from, except the scaled fp8 transformer (its error bounded)."""
    from qwenfast import QwenImagePipeline
    from qwenfast.about import DEMO_MODEL

    paths = E.write_files(demo_pipe, tmp_path)
    assert {p.parent.name for p in paths.values()} == set(E.FILES)
    te = E.comfy_files(demo_pipe)["text_encoders"]
    assert te and not any(k.startswith(("model.language_model.", "model.visual.")) for k in te)
    assert any(k.startswith("visual.") for k in te) and any(k.startswith("model.layers.") for k in te)
    demo = Path(DEMO_MODEL)
    kw = dict(tokenizer=demo / "tokenizer", device="cpu", dtype=torch.float32, transformer_config=demo / "transformer",
              vae_config=demo / "vae", text_encoder_config=demo / "text_encoder")  # fmt: skip
    from qwenfast.loading.single_file import load_single_files

    c = load_single_files(paths["diffusion_models"], paths["vae"], paths["text_encoders"], **kw)
    ref = QwenImagePipeline.from_pretrained(DEMO_MODEL, device="cpu", dtype=torch.float32)
    got = dict(c.text_encoder.model.state_dict())
    want = dict(ref.text_encoder.model.state_dict())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    vae_got, vae_want = c.vae.state_dict(), ref.vae.state_dict()
    assert all(torch.equal(vae_got[k], vae_want[k]) for k in vae_want)


def test_graphs_name_the_same_files_steps_cfg_and_size(tmp_path):
    paths = {f: tmp_path / f / n for f, n in E.FILES.items()}
    native = E.native_graph(1024, 50, 4.0, 7, "a fox")
    ks = native["8"]["inputs"]
    assert (ks["steps"], ks["cfg"], ks["seed"], ks["sampler_name"]) == (50, 4.0, 7, "euler")
    assert native["7"]["inputs"] == {"width": 1024, "height": 1024, "batch_size": 1}
    assert native["1"]["inputs"]["unet_name"] == paths["diffusion_models"].name
    assert native["2"]["inputs"] == {"clip_name": paths["text_encoders"].name, "type": "qwen_image"}
    ours = E.qwenfast_graph(paths, tmp_path, 1024, 50, 4.0, 7, "a fox")
    load, samp = ours["1"]["inputs"], ours["2"]["inputs"]
    assert load["transformer"] == str(paths["diffusion_models"]) and load["fp8"] and load["cuda_graphs"]
    assert (samp["steps"], samp["cfg"], samp["seed"], samp["width"], samp["height"]) == (
        50,
        4.0,
        7,
        1024,
        1024,
    )
    cpu = E.qwenfast_graph(paths, tmp_path, 64, 2, 1.0, 0, "x", device="cpu")["1"]["inputs"]
    assert (cpu["dtype"], cpu["fp8"], cpu["cuda_graphs"]) == ("fp32", False, False)


class _Counted:
    calls: list = []


def _node(name, fn):
    cls = type(
        name, (), {"FUNCTION": "go", "go": lambda self, **kw: (_Counted.calls.append(name), fn(**kw))[1]}
    )
    return cls


def test_runner_reuses_unchanged_nodes_and_reruns_what_a_new_seed_reaches():
    classes = {
        "Load": _node("Load", lambda path: ({"w": path},)),
        "Enc": _node("Enc", lambda model, text: (text.upper(),)),
        "Sample": _node("Sample", lambda model, cond, seed: (f"{model['w']}:{cond}:{seed}",)),
    }

    def graph(seed, text):
        return {"1": {"class_type": "Load", "inputs": {"path": "m"}},
                "2": {"class_type": "Enc", "inputs": {"model": ["1", 0], "text": text}},
                "3": {"class_type": "Sample", "inputs": {"model": ["1", 0], "cond": ["2", 0], "seed": seed}}}  # fmt: skip

    cache: dict = {}
    _Counted.calls = []
    assert E.run_graph(graph(1, "a"), classes, cache)["3"] == ("m:A:1",)
    assert _Counted.calls == ["Load", "Enc", "Sample"]
    _Counted.calls = []
    assert E.run_graph(graph(2, "a"), classes, cache)["3"] == ("m:A:2",)
    assert _Counted.calls == ["Sample"]  # the loader and the unchanged prompt come from the cache
    _Counted.calls = []
    assert E.run_graph(graph(2, "b"), classes, cache)["3"] == ("m:B:2",)
    assert _Counted.calls == ["Enc", "Sample"]


def test_v3_nodes_return_their_node_output():
    class Out:  # what a v3 node's execute returns (comfy_api NodeOutput: .result)
        def __init__(self, *a):
            self.result = a

    class V3:
        @classmethod
        def execute(cls, width):
            return Out(width * 2)

    assert E.run_graph({"1": {"class_type": "V3", "inputs": {"width": 8}}}, {"V3": V3}, {})["1"] == (16,)


def test_without_a_work_tree_the_workflow_rows_are_listed_not_run(monkeypatch, tmp_path):
    monkeypatch.delenv(peers_comfyui.ENV, raising=False)
    rec = peers.run(["e2e:1024:4:nocfg"], ["comfyui-workflow"], [], tmp_path)
    assert rec["rows"] == []
    assert any(n["row"] == peers.COMFYUI_E2E and peers_comfyui.ENV in n["why"] for n in rec["not_run"])
    monkeypatch.setenv(peers_comfyui.ENV, str(tmp_path))
    assert peers.COMFYUI_E2E not in peers.not_run(["comfyui-workflow"], ["e2e:1024:4:nocfg"])
    assert peers.COMFYUI_E2E in peers.not_run(["comfyui"], ["fwd:1024", "e2e:1024:4:nocfg"])
