"""`bench peers --engine comfyui`: the key conversion to ComfyUI's layout (CI), and ComfyUI's own forward
against diffusers' on the demo model (only where a ComfyUI work tree is given: `QWENFAST_COMFYUI`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from qwenfast.benchmarks import peers, peers_comfyui
from qwenfast.benchmarks.peers_comfyui import COMFY_PREFIX, from_comfy, scaled_fp8, to_comfy


@pytest.fixture(scope="module")
def demo_sd() -> dict[str, torch.Tensor]:
    import diffusers

    from qwenfast.about import DEMO_MODEL

    tr = diffusers.QwenImageTransformer2DModel.from_pretrained(str(DEMO_MODEL), subfolder="transformer")
    return {k: v.contiguous() for k, v in tr.state_dict().items()}


def test_conversion_round_trips_every_key(demo_sd):
    comfy = to_comfy(demo_sd)
    assert len(comfy) == len(demo_sd) and all(k.startswith(COMFY_PREFIX) for k in comfy)
    back = from_comfy(comfy)
    assert back.keys() == demo_sd.keys()  # no key lost, none left over
    assert all(back[k] is demo_sd[k] for k in demo_sd)  # renamed, not copied


def test_qwenfast_single_file_loader_reads_the_converted_file(demo_sd, tmp_path):
    """The converted state dict is a ComfyUI-layout file for qwenfast's own loader too: it maps every key
    back to the diffusers name (independent of `from_comfy`)."""
    from qwenfast.loading.single_file import inspect_transformer

    path = tmp_path / "comfy.safetensors"
    save_file(to_comfy(demo_sd), str(path))
    src, _ = inspect_transformer(path, {"axes_dims_rope": [16, 24, 24]})
    assert src.names == {COMFY_PREFIX + k: k for k in demo_sd}


def test_scaled_fp8_quantises_every_block_linear_and_nothing_else(demo_sd, tmp_path):
    comfy = to_comfy(demo_sd)
    q = scaled_fp8(comfy)
    linears = [k for k, t in comfy.items() if peers_comfyui.is_block_linear(k, t)]
    assert linears and all(k.startswith(COMFY_PREFIX + "transformer_blocks.") for k in linears)
    assert set(q) == set(comfy) | {k[: -len("weight")] + "scale_weight" for k in linears} | {
        COMFY_PREFIX + "scaled_fp8"
    }
    for k in comfy:
        if k in linears:
            assert q[k].dtype == torch.float8_e4m3fn
            w = q[k].float() * q[k[: -len("weight")] + "scale_weight"]
            assert (w - comfy[k]).norm() / comfy[k].norm() < 0.05  # e4m3, per-tensor scale
        else:
            assert q[k] is comfy[k]
    # qwenfast's reader sees the same file as scaled fp8 and names the same layers
    from qwenfast.loading.fp8 import plan_quantization, read_header

    path = tmp_path / "fp8.safetensors"
    save_file(q, str(path))
    plan = plan_quantization(read_header(path))
    assert set(plan.scales) == set(linears), plan.kind


def test_without_a_work_tree_comfyui_is_listed_not_run(monkeypatch, tmp_path):
    monkeypatch.delenv(peers_comfyui.ENV, raising=False)
    rec = peers.run(["fwd:1024"], ["comfyui"], [], tmp_path)
    assert not rec["rows"]
    assert any(n["row"] == peers.COMFYUI and peers_comfyui.ENV in n["why"] for n in rec["not_run"])


# CI cannot install ComfyUI (it is not on PyPI) and may skip only GPU-only tests, so the check against
# ComfyUI itself is a script, not a collected test:
#   QWENFAST_COMFYUI=/path/to/ComfyUI PYTHONPATH=<its packages> python tests/test_peers_comfyui.py
def check_comfyui_forward_matches_diffusers_on_the_demo_model(tmp_path):
    """One smoke run (own processes): ComfyUI's model over the same weights gives diffusers eager's
    forward to float32 rounding; its fp8 scaled path runs (dequantised on the CPU) with e4m3's error."""
    rec = peers.run(["fwd:1024"], ["diffusers", "comfyui"], [], tmp_path, smoke=True, timeout_s=600)
    assert not [r for r in rec["rows"] if "error" in r], rec["rows"]
    assert rec["same_weights"]
    rows = {r["row"]: r for r in rec["rows"]}
    assert rows["ComfyUI native bf16"]["rel_err_vs_diffusers"] <= 1e-4, json.dumps(rows)
    assert rows["ComfyUI native bf16"]["comfy_ops"] == "disable_weight_init"
    assert 0 < rows["ComfyUI native fp8 scaled"]["rel_err_vs_diffusers"] < 0.2
    assert rows["ComfyUI native fp8 scaled"]["comfy_ops"] == "MixedPrecisionOps"


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    if not os.environ.get(peers_comfyui.ENV):
        raise SystemExit(f"set ${peers_comfyui.ENV} to a ComfyUI work tree")
    with tempfile.TemporaryDirectory() as d:
        check_comfyui_forward_matches_diffusers_on_the_demo_model(Path(d))
    print("ok: ComfyUI's forward matches diffusers eager on the demo model")
