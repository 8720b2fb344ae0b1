"""`qwenfast export onnx`: each component of a tiny random Qwen-Image exported, run in onnxruntime (CPU),
and compared with the torch model (fp32: 1e-4) at two image sizes (text: two lengths), plus the
external-data layout for big models and the CLI command.

The graph wrappers are also checked against what the pipeline itself computes (the VAE's fast path,
the text encoder's hidden states, the fused transformer), so the ONNX graph is the pipeline's math.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from qwenfast.export.onnx_export import OPSET, build_graph, export_onnx  # noqa: E402
from qwenfast.export.onnx_runtime import OnnxComponent  # noqa: E402

TOL = 1e-4
SIZES = ((64, 48), (32, 80))  # (height, width) in pixels


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "NaN/inf"
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.mark.parametrize("component", ["vae-decoder", "vae-encoder"])
def test_vae_dynamic_sizes(qf_t2i, onnx_dir, component):
    """One graph, two image sizes and two batch sizes (dynamic axes)."""
    pipe = qf_t2i
    rec = export_onnx(pipe, component, onnx_dir / f"{component}.onnx", height=SIZES[0][0], width=SIZES[0][1])
    assert rec.opset == OPSET and rec.data_bytes == 0 and rec.onnx_bytes > 0
    ort = OnnxComponent(rec.path, threads=1)
    outs = []
    for (hgt, wid), batch in zip(SIZES, (1, 2)):
        g = torch.Generator().manual_seed(hgt)
        if component == "vae-decoder":
            x = torch.randn(batch, 16, hgt // 8, wid // 8, generator=g)
            want = pipe.vae.decode(x)  # the pipeline's own (fast) path
            got = ort(latents=x)
            assert got.shape == (batch, 3, hgt, wid)
        else:
            x = torch.rand(batch, 3, hgt, wid, generator=g) * 2 - 1
            want = pipe.vae.encode(x)[0]
            got = ort(images=x)
            assert got.shape == (batch, 16, hgt // 8, wid // 8)
        module, *_ = build_graph(pipe, component, height=hgt, width=wid)
        with torch.no_grad():
            assert rel(module(x), want) <= TOL  # the graph's module is the pipeline's math
        assert rel(got, want) <= TOL, f"{component} {hgt}x{wid}: onnxruntime vs torch"
        outs.append(got)
    x2 = torch.randn_like(x) if component == "vae-decoder" else torch.rand_like(x) * 2 - 1
    moved = ort(**{ort.session.get_inputs()[0].name: x2})
    assert rel(moved, outs[-1]) >= 10 * TOL, "the graph must depend on its input"


@pytest.mark.parametrize("size", SIZES)
def test_transformer_buckets(qf_t2i, onnx_dir, size):
    """Fixed buckets (image grid and text length are baked into RoPE); batch dynamic; padded text masked."""
    pipe = qf_t2i
    hgt, wid = size
    L = 12
    rec = export_onnx(pipe, "transformer", onnx_dir / f"transformer_{hgt}x{wid}.onnx", height=hgt, width=wid, text_len=L)
    ort = OnnxComponent(rec.path, threads=1)
    cfg = pipe.transformer.cfg
    n = (hgt // 16) * (wid // 16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, n, cfg.in_channels, generator=g)
    emb = torch.randn(2, L, cfg.joint_attention_dim, generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, 7:] = 0  # the second prompt is shorter: padded to the bucket
    t = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        want = pipe.transformer(x, emb, mask, t, [(1, hgt // 16, wid // 16)])  # fused path, as sampling runs it
    got = ort(hidden_states=x, encoder_hidden_states=emb, encoder_hidden_states_mask=mask, timestep=t)
    assert got.shape == want.shape and rel(got, want) <= TOL
    with torch.no_grad():  # padding is masked out: row 1 equals its unpadded forward
        alone = pipe.transformer(x[1:], emb[1:, :7], None, t[1:], [(1, hgt // 16, wid // 16)])
    assert rel(got[1:], alone) <= TOL
    moved = ort(hidden_states=x, encoder_hidden_states=emb.flip(1), encoder_hidden_states_mask=mask, timestep=t)
    assert rel(moved[:1], got[:1]) >= 10 * TOL, "the prompt must move the output"


def test_text_encoder_dynamic_length(qf_t2i, onnx_dir):
    """Dynamic batch and token count; the graph's state (template prefix dropped) = the pipeline's embeddings."""
    from qwenfast.models.text_encoder import T2I_DROP, T2I_TEMPLATE

    pipe = qf_t2i
    rec = export_onnx(pipe, "text-encoder", onnx_dir / "text-encoder.onnx")
    ort = OnnxComponent(rec.path, threads=1)
    for prompt in ("a red fox", "a small blue circle at the top left of a white background, photograph"):
        tok = pipe.text_encoder.tokenizer([T2I_TEMPLATE.format(prompt)], return_tensors="pt")
        got = ort(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
        emb, _ = pipe.text_encoder.encode([prompt])  # (1, L, D), prefix dropped
        assert got.shape[1] == tok.input_ids.shape[1] and rel(got[:, T2I_DROP:], emb) <= TOL
    texts = [T2I_TEMPLATE.format(p) for p in ("a red fox", "a small blue circle at the top left, photograph")]
    tok = pipe.text_encoder.tokenizer(texts, return_tensors="pt", padding=True)  # a padded batch of two
    assert not bool(tok.attention_mask.all())
    got = ort(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
    module, *_ = build_graph(pipe, "text-encoder")
    with torch.no_grad():
        want = module(tok.input_ids, tok.attention_mask)
    real = tok.attention_mask.bool()
    assert rel(got[real], want[real]) <= TOL


def test_external_data_and_cli(qf_t2i, tiny_t2i, onnx_dir, capsys):
    """Weights in FILE.onnx.data (what models above 1 GiB get; protobuf stops at 2 GB), through the CLI."""
    import onnx

    from qwenfast.cli import main

    out = onnx_dir / "cli" / "decoder.onnx"
    rec = export_onnx(qf_t2i, "vae-decoder", out, height=32, width=32, external=True)
    data = out.with_name("decoder.onnx.data")
    assert data.is_file() and rec.data_bytes == data.stat().st_size > rec.onnx_bytes
    m = onnx.load(str(out), load_external_data=False)
    assert any(init.data_location == onnx.TensorProto.EXTERNAL for init in m.graph.initializer)
    assert m.opset_import[0].version == OPSET
    z = torch.randn(1, 16, 4, 6)
    assert rel(OnnxComponent(out, threads=1)(latents=z), qf_t2i.vae.decode(z)) <= TOL
    rc = main(["export", "onnx", "--component", "vae-encoder", "-o", str(onnx_dir / "cli" / "enc.onnx"),
               "--model", str(tiny_t2i[1]), "--height", "32", "--width", "48", "--check"])  # fmt: skip
    assert rc == 0
    rec = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert rec["component"] == "vae-encoder" and rec["max_abs_diff_vs_torch"] <= 1e-4
    assert main(["export", "onnx", "--component", "vae-decoder", "-o", str(onnx_dir / "x.onnx"), "--height", "20"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
