"""LoRA fuse/unfuse and sampling presets vs diffusers 0.42.1 (tiny random model, CPU fp32).

One random LoRA on every Linear of diffusers' transformer (to_q/k/v, add_q/k/v, to_out, to_add_out,
img_mod/txt_mod, both MLPs, img_in, txt_in, proj_out, norm_out.linear, the timestep MLP) is written
in each naming seen in the wild; qwenfast's pixels must equal diffusers' `load_lora_weights` +
`fuse_lora(lora_scale=s)` on the same file. This module builds its own pipelines, so the fused
weights never leak into other tests.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from qwenfast.loading.lora import LoraError  # noqa: E402
from qwenfast.loading.lora_manager import LoraManager  # noqa: E402
from qwenfast.pipeline import sampling as S  # noqa: E402

KW = dict(
    prompt="a red circle", height=32, width=48, num_inference_steps=2, true_cfg_scale=1.0, output_type="np"
)


def gen():
    return torch.Generator().manual_seed(7)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    """(diffusers pipeline, its original transformer weights, qwenfast pipeline, model folder)."""
    from qwenfast import QwenImagePipeline
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("lora") / "tiny"
    ref = build_tiny_pipeline(path, seed=0)
    qf = QwenImagePipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    qf.progress_bar = False
    return ref, copy.deepcopy(ref.transformer.state_dict()), qf, path


def make_lora(model, seed: int, only: str = "") -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """diffusers module name -> (down (r, in), up (out, r), alpha); img_in gets another rank."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and only in n:
            r = 2 if n == "img_in" else 4
            down = torch.randn(r, m.in_features, generator=g) / m.in_features**0.5
            out[n] = (down, torch.randn(m.out_features, r, generator=g) * 0.15, 3.0)
    return out


def write(lora, naming: str) -> dict[str, torch.Tensor]:
    """The same LoRA under one naming. Namings without alpha get alpha/rank folded into `up`."""
    sd = {}
    for n, (down, up, alpha) in lora.items():
        r = down.shape[0]
        flat = n.replace(".", "_")
        if naming in ("diffusers", "peft-default", "base-model"):
            pre, a, b = {"diffusers": ("transformer.", "lora_A.weight", "lora_B.weight"),
                         "peft-default": ("", "lora_A.default.weight", "lora_B.default.weight"),
                         "base-model": ("base_model.model.", "lora_A.weight", "lora_B.weight")}[naming]  # fmt: skip
            sd[f"{pre}{n}.{a}"], sd[f"{pre}{n}.{b}"] = down, up * (alpha / r)
            continue
        stem = {"kohya": f"lora_unet_{flat}", "lightning": n, "comfyui": f"diffusion_model.{n}",
                "comfyui-fused": f"diffusion_model.{n}", "lycoris": f"lycoris_{flat}"}[naming]  # fmt: skip
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down, up
        sd[f"{stem}.alpha"] = torch.tensor(alpha)
    if naming == "comfyui-fused":  # Q|K|V of each stream as ONE LoRA on the fused projection
        for blk in sorted({k.split(".attn.")[0] for k in sd if ".attn." in k}):
            for fused, parts in (("to_qkv", ("to_q", "to_k", "to_v")),
                                 ("add_qkv_proj", ("add_q_proj", "add_k_proj", "add_v_proj"))):  # fmt: skip
                stems = [f"{blk}.attn.{p}" for p in parts]
                downs = [sd.pop(f"{s}.lora_down.weight") for s in stems]
                ups = [sd.pop(f"{s}.lora_up.weight") for s in stems]
                for s in stems:
                    sd.pop(f"{s}.alpha")
                sd[f"{blk}.attn.{fused}.lora_down.weight"] = torch.cat(downs)  # (3r, in)
                sd[f"{blk}.attn.{fused}.lora_up.weight"] = torch.block_diag(*ups)  # (3 out, 3r)
                sd[f"{blk}.attn.{fused}.alpha"] = torch.tensor(3.0 * 3)  # alpha/rank stays 3/4
    return sd


def ref_images(pipes, loras, fuse: bool = True, **kw):
    """diffusers' pixels with [(state_dict, strength), ...] loaded, then its weights restored."""
    ref, orig, _, _ = pipes
    try:
        for i, (sd, _) in enumerate(loras):
            ref.load_lora_weights(dict(sd), adapter_name=f"l{i}")
        if fuse:
            assert len(loras) == 1
            ref.fuse_lora(lora_scale=loras[0][1])
        else:
            ref.set_adapters([f"l{i}" for i in range(len(loras))], [s for _, s in loras])
        return ref(**{**KW, **kw}, generator=gen()).images
    finally:
        ref.unload_lora_weights()
        ref.transformer.load_state_dict(orig)


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, snap) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------ namings
NAMINGS = [
    "diffusers",
    "peft-default",
    "base-model",
    "kohya",
    "lightning",
    "comfyui",
    "comfyui-fused",
    "lycoris",
]
DIFFUSERS_READS = {
    "diffusers",
    "peft-default",
    "kohya",
    "lightning",
    "comfyui",
}  # the others: compare to "diffusers"


@pytest.fixture(scope="module")
def lora_a(pipes):
    return make_lora(pipes[0].transformer, seed=1)


@pytest.fixture(scope="module")
def references(pipes, lora_a):
    cache = {}

    def get(naming, strength):
        key = (naming if naming in DIFFUSERS_READS else "diffusers", strength)
        if key not in cache:
            cache[key] = ref_images(pipes, [(write(lora_a, key[0]), strength)])
        return cache[key]

    return get


@pytest.mark.parametrize("strength", [1.0, 0.5])
@pytest.mark.parametrize("naming", NAMINGS)
def test_naming_matches_diffusers(pipes, lora_a, references, naming, strength):
    _, _, qf, _ = pipes
    snap = snapshot(qf.transformer)
    base = qf(**KW, generator=gen()).images
    name = qf.load_lora(write(lora_a, naming), strength=strength)
    try:
        assert qf.loras == {name: strength}
        ours = qf(**KW, generator=gen()).images
    finally:
        qf.unload_lora()
    theirs = references(naming, strength)
    assert np.abs(theirs - base).max() > 0.05  # the LoRA really changes the picture
    assert np.abs(ours - theirs).max() <= 1e-3
    assert same(qf.transformer, snap) and qf.loras == {}


def test_safetensors_file_with_bias_and_peft_metadata(pipes, lora_a, references, tmp_path):
    """`lora_B.bias` (PEFT lora_bias) and diffusers' `lora_adapter_metadata` (lora_alpha, patterns)."""
    _, _, qf, _ = pipes
    sd = write(lora_a, "diffusers")
    g = torch.Generator().manual_seed(5)
    for k in [k for k in sd if k.endswith("lora_B.weight") and ("img_mlp" in k or "to_add_out" in k)]:
        sd[k.replace(".weight", ".bias")] = torch.randn(sd[k].shape[0], generator=g) * 0.2
    meta = {"r": 4, "lora_alpha": 6, "rank_pattern": {"img_in": 2}, "alpha_pattern": {"img_in": 5},
            "target_modules": sorted({k[len("transformer."):].split(".lora_")[0] for k in sd}), "lora_bias": True}  # fmt: skip
    f = tmp_path / "meta.safetensors"
    save_file(
        sd,
        f,
        metadata={"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in meta.items()})},
    )
    ref = pipes[0]  # diffusers reads the metadata only from a file, so load the file itself
    try:
        ref.load_lora_weights(str(f), adapter_name="m")
        ref.fuse_lora(lora_scale=0.5)
        theirs = ref(**KW, generator=gen()).images
    finally:
        ref.unload_lora_weights()
        ref.transformer.load_state_dict(pipes[1])
    plain = references("diffusers", 0.5)
    qf.load_lora(f, 0.5)
    try:
        ours = qf(**KW, generator=gen()).images
    finally:
        qf.unload_lora()
    assert np.abs(theirs - plain).max() > 0.01  # bias and metadata scales did something
    assert np.abs(ours - theirs).max() <= 1e-3


def test_stacked_loras_match_diffusers(pipes, lora_a, tmp_path):
    _, _, qf, _ = pipes
    lora_b = make_lora(pipes[0].transformer, seed=2, only="transformer_blocks.1")
    a, b = write(lora_a, "diffusers"), write(lora_b, "kohya")
    theirs = ref_images(pipes, [(a, 1.0), (b, 0.5)], fuse=False)
    snap = snapshot(qf.transformer)
    qf.load_lora(a, 1.0, name="a")
    qf.load_lora(b, 0.5, name="b")
    try:
        assert qf.loras == {"a": 1.0, "b": 0.5}
        ours = qf(**KW, generator=gen()).images
    finally:
        qf.unload_lora()
    assert np.abs(ours - theirs).max() <= 1e-3
    assert same(qf.transformer, snap)


# ------------------------------------------------------------------------------------------ unfuse
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unload_restores_bitwise_and_reapplies_the_rest(pipes, lora_a, dtype):
    model = copy.deepcopy(pipes[2].transformer).to(dtype)
    lora_b = make_lora(pipes[0].transformer, seed=2, only="transformer_blocks.0.attn")
    a, b = write(lora_a, "comfyui-fused"), write(lora_b, "diffusers")
    m = LoraManager(model)
    snap = snapshot(model)
    m.load(b, 0.5, name="b")
    only_b = snapshot(model)
    assert not same(model, snap)
    for _ in range(2):  # cycles do not drift
        m.load(a, 1.0, name="a")
        m.load(b, -0.25, name="b2")
        m.unload("a")
        m.unload("b2")
        assert same(model, only_b) and list(m.loras) == ["b"]
    m.load(a, 0.7, name="a")
    m.unload("b")  # restore + re-apply a: same bits as a alone
    only_a = snapshot(model)
    m.unload()
    assert same(model, snap) and m.originals_bytes == 0
    m.keep_originals = True  # copies survive the unload and serve the next load
    m.load(a, 0.7)
    assert same(model, only_a)
    m.unload()
    assert same(model, snap) and m.originals_bytes > 0
    m.load(a, 0.7)
    assert same(model, only_a)
    m.unload()
    m.release_originals()
    assert same(model, snap) and m.originals_bytes == 0


def test_set_loras_changes_only_what_differs(pipes, lora_a, tmp_path):
    model = copy.deepcopy(pipes[2].transformer)
    pa, pb = tmp_path / "style_a.safetensors", tmp_path / "style_b.safetensors"
    save_file(write(lora_a, "lightning"), pa)
    save_file(write(make_lora(pipes[0].transformer, seed=2, only="transformer_blocks.1"), "kohya"), pb)
    m = LoraManager(model)
    applied = []
    real = m._apply
    m._apply = lambda e, only=None: applied.append((e.name, only is None)) or real(e, only)
    snap = snapshot(model)

    m.set([(pa, 1.0)])
    assert m.loras == {"style_a": 1.0} and applied == [("style_a", True)]
    applied.clear()
    m.set([(str(pa), 1.0), (pb, 0.5)])
    assert m.loras == {"style_a": 1.0, "style_b": 0.5} and applied == [("style_b", True)]
    applied.clear()
    m.set([(pa, 1.0), (pb, 0.5)])
    assert applied == []
    with pytest.raises(LoraError, match="does not exist"):  # a bad item changes nothing
        m.set([(pa, 1.0), (tmp_path / "missing.safetensors", 1.0)])
    assert m.loras == {"style_a": 1.0, "style_b": 0.5} and applied == []
    m.set([(pb, 0.5)])  # a removed: its weights restored, b re-applied only where they overlap
    assert m.loras == {"style_b": 0.5} and applied == [("style_b", False)]
    only_b = snapshot(model)
    m.unload()
    m.load(pb, 0.5)
    assert same(model, only_b)
    applied.clear()
    m.set([(pb, 0.25)])  # strength change: only b
    assert m.loras == {"style_b": 0.25} and [n for n, _ in applied] == ["style_b"]
    m.set([])
    assert same(model, snap) and m.loras == {}


# ------------------------------------------------------------------------------------------ errors
def test_errors_leave_the_model_untouched(pipes, lora_a, tmp_path):
    _, _, qf, _ = pipes
    good = write(lora_a, "diffusers")
    qf.load_lora(good, 0.5, name="keep")
    snap = snapshot(qf.transformer)
    try:
        flux = {
            f"transformer.double_blocks.{i}.img_attn.qkv.lora_A.weight": torch.zeros(4, 64) for i in range(7)
        }
        with pytest.raises(LoraError, match=r"does not have.*double_blocks.0.img_attn.qkv.*7 in all"):
            qf.load_lora({**good, **flux})
        wrong = dict(good)
        wrong["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"] = torch.zeros(128, 4)
        with pytest.raises(LoraError, match=r"shape.*attn.to_q: up \(128, 4\)"):
            qf.load_lora(wrong)
        half = {k: v for k, v in good.items() if "txt_in.lora_B" not in k}
        with pytest.raises(LoraError, match="incomplete.*txt_in"):
            qf.load_lora(half)
        with pytest.raises(LoraError, match=r"\.diff.*not supported"):
            qf.load_lora({**good, "diffusion_model.img_in.diff": torch.zeros(64, 64)})
        with pytest.raises(LoraError, match="not LoRA factors.*img_in.weight"):
            qf.load_lora({**good, "img_in.weight": torch.zeros(64, 64)})
        torch.save(good, tmp_path / "pickled.safetensors")
        with pytest.raises(LoraError, match="not a valid safetensors file"):
            qf.load_lora(tmp_path / "pickled.safetensors")
        (tmp_path / "text.safetensors").write_text("hello")
        with pytest.raises(LoraError, match="not a valid safetensors file"):
            qf.load_lora(tmp_path / "text.safetensors")
        with pytest.raises(LoraError, match="does not exist"):
            qf.load_lora(tmp_path / "nope.safetensors")
        with pytest.raises(LoraError, match="already loaded"):
            qf.load_lora(good, name="keep")
        with pytest.raises(LoraError, match="finite"):
            qf.load_lora(good, strength=float("nan"))
        with pytest.raises(LoraError, match="no LoRA named 'x'"):
            qf.unload_lora("x")
        assert same(qf.transformer, snap) and qf.loras == {"keep": 0.5}
    finally:
        qf.unload_lora()


# ------------------------------------------------------------------------------------------ presets
def test_presets_sigmas_and_pixels_match_diffusers(pipes, lora_a):
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref, _, qf, _ = pipes
    saved = (dict(qf.defaults), dict(qf.scheduler_overrides))
    try:
        qf.apply_preset("lightning-4")
        assert qf.defaults["num_inference_steps"] == 4 and qf.defaults["true_cfg_scale"] == 1.0
        for seq in (16, 4096, 8192):
            sig = S.get_sigmas(qf.scheduler_config_for(), 4, seq)
            assert torch.allclose(sig, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-6)
        qf.apply_preset("lightning-8")
        assert len(S.get_sigmas(qf.scheduler_config_for(), qf.defaults["num_inference_steps"], 64)) == 9
        qf.apply_preset("turbo-4")
        kw = {k: v for k, v in KW.items() if k not in ("num_inference_steps", "true_cfg_scale")}
        sd = write(lora_a, "lightning")
        qf.load_lora(sd)
        try:
            ours = qf(**kw, negative_prompt=" ", generator=gen()).images  # cfg 1: negative ignored
            explicit = qf(**kw, generator=gen(), scheduler_overrides=dict(base_shift=0.5, max_shift=0.9,
                                                                           shift_terminal=0.02)).images  # fmt: skip
        finally:
            qf.unload_lora()
        orig_sched = ref.scheduler
        ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            orig_sched.config, base_shift=math.log(3), max_shift=math.log(3), shift_terminal=None
        )
        try:
            theirs = ref_images(pipes, [(sd, 1.0)], **kw, num_inference_steps=4, true_cfg_scale=1.0)
        finally:
            ref.scheduler = orig_sched
        assert np.abs(ours - theirs).max() <= 1e-3
        plain = references_like(pipes, sd, kw)
        assert np.abs(explicit - plain).max() <= 1e-3 and np.abs(explicit - ours).max() > 1e-3
        with pytest.raises(ValueError, match="unknown preset 'fast'.*lightning-4"):
            qf.apply_preset("fast")
    finally:
        qf.defaults, qf.scheduler_overrides = saved


def references_like(pipes, sd, kw):
    """diffusers with the checkpoint's own scheduler, 4 steps, cfg 1 (what an explicit override restores)."""
    return ref_images(pipes, [(sd, 1.0)], **kw, num_inference_steps=4, true_cfg_scale=1.0)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_lora_and_preset(pipes, lora_a, tmp_path):
    from PIL import Image

    from qwenfast.cli import main

    _, _, qf, path = pipes
    lp = tmp_path / "turbo.safetensors"
    save_file(write(lora_a, "comfyui"), lp)
    out = tmp_path / "x.png"
    args = ["generate", "a red circle", "--model", str(path), "--device", "cpu", "--size", "48x32", "--seed", "7",
            "--quiet", "--lora", f"{lp}:0.5", "--preset", "lightning-4", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    info = Image.open(out).text
    assert json.loads(info["loras"]) == [{"name": "turbo", "path": str(lp), "strength": 0.5}]
    assert (info["preset"], info["steps"], info["cfg"]) == ("lightning-4", "4", "1.0")
    qf.apply_preset("lightning-4")
    qf.load_lora(lp, 0.5)
    try:
        expect = qf("a red circle", height=32, width=48, generator=gen()).images[0]
    finally:
        qf.unload_lora()
        qf.apply_preset("default")
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expect))
    assert main([*args, "--steps", "3", "--cfg", "2"]) == 0  # explicit flags beat the preset
    assert (Image.open(out).text["steps"], Image.open(out).text["cfg"]) == ("3", "2.0")
    assert main(["generate", "x", "--model", str(path), "--device", "cpu", "--size", "32x32", "--quiet",
                 "--lora", str(tmp_path / "missing.safetensors"), "-o", str(out)]) == 2  # fmt: skip


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_see_fused_weights(pipes, lora_a):
    """Captured graphs read weights by address: fusing in place must show up in replays, and unload
    must restore the exact bf16 bits (originals kept in pinned host memory)."""
    from qwenfast import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(pipes[3], device="cuda", dtype=torch.bfloat16)
    pipe.progress_bar = False
    snap = snapshot(pipe.transformer)
    base = pipe(**KW, generator=gen()).images  # captures the graph
    assert pipe._graphs.graphs
    pipe.load_lora(write(lora_a, "comfyui"), 0.5)
    assert all(t.is_pinned() for t in pipe.lora_manager._orig.values())
    graphed = pipe(**KW, generator=gen()).images
    pipe.configure(cuda_graphs=False)
    eager = pipe(**KW, generator=gen()).images
    pipe.configure(cuda_graphs=True)
    pipe.unload_lora()
    assert same(pipe.transformer, snap)
    again = pipe(**KW, generator=gen()).images
    assert (
        np.abs(graphed - base).max() > 0.05 and np.array_equal(graphed, eager) and np.array_equal(again, base)
    )
