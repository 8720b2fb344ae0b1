"""FP8 quantisation fused into the kernels that produce FP8 GEMM inputs (`kernels/fp8_rows.py`).

What must hold:
- each fused launcher (`layernorm_modulate_fp8`, `gated_residual_layernorm_modulate_fp8`,
  `gelu_tanh_fp8`) writes the bytes of the unfused path, `quantize_rows` of the bf16/fp32 output it
  used to write (the LayerNorm kernels bit for bit; the GELU within one e4m3 step on a tiny
  fraction, see `kernels/gelu.py`), is close to its torch `_ref`, pads to `gemm_rows` with zero
  rows of scale 1, and with `keep` also writes the plain output bit for bit;
- `FP8Linear` multiplies pre-quantised rows exactly like its own quantisation, LoRA included;
- a transformer with FP8 Linears gives the same output with the fusion on and off, and the fused
  path really hands `QuantizedRows` to the six Linears fed by these kernels.

Kernel cases run on CUDA, or on CPU in Triton's interpreter in a child process
(`test_interpreter_subprocess`), like tests/test_kernels.py. Outputs are poisoned (NaN bytes) before
the kernels write them; NaN never passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qwenfast.kernels as K
from qwenfast.kernels.adaln import layernorm_modulate, layernorm_modulate_fp8, layernorm_modulate_fp8_ref
from qwenfast.kernels.fp8_linear import FP8Linear, fp8_supported, quantize_activation, quantize_rows
from qwenfast.kernels.fp8_rows import (
    FP8,
    QuantizedRows,
    gemm_rows,
    quantize_rows_ref,
    quantize_rows_ref_padded,
    set_fp8_fusion,
)
from qwenfast.kernels.gated_residual import (
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_fp8,
    gated_residual_layernorm_modulate_fp8_ref,
)
from qwenfast.kernels.gelu import MAX_N, gelu_tanh_fp8, gelu_tanh_fp8_ref
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases, rel_err

CUDA = torch.cuda.is_available()
FP8_GPU = CUDA and fp8_supported(torch.device("cuda"))
TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNEL_DEVICES = kernel_devices(FP8_GPU and TRITON, "needs an FP8 GPU")


@pytest.fixture(autouse=True)
def _triton_backend():
    with K.use_backend("triton"):
        yield


def _dev(device: str) -> str:
    return "cpu" if device == "interp" else device


def _randn(*shape, dtype, device, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device=device, dtype=dtype)


def _poisoned(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) buffers full of NaN (0xFF is NaN in e4m3fn), for a launcher's `out`."""
    rows = gemm_rows(m)
    q = torch.full((rows, k), 0xFF, dtype=torch.uint8, device=device).view(FP8)
    return q, torch.full((rows, 1), float("nan"), device=device)


def _check_layout(r: QuantizedRows, shape, dtype):
    M, Kd = r.rows, shape[-1]
    assert r.shape == torch.Size(shape) and r.dtype == dtype and r.q.dtype == FP8
    assert r.q.shape == (gemm_rows(M), Kd) and r.scale.shape == (gemm_rows(M), 1)
    assert torch.isfinite(r.scale).all() and (r.scale > 0).all()
    codes = r.q.view(torch.uint8)
    assert not ((codes & 0x7F) == 0x7F).any(), "NaN code: a byte the kernel did not write"
    assert not codes[M:].any() and (r.scale[M:] == 1).all()  # the padding rows


def _assert_same_bytes(a: QuantizedRows, b: QuantizedRows):
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))


def _assert_within_one_step(a: QuantizedRows, b: QuantizedRows, frac: float, dtype: torch.dtype):
    """Codes equal but for <= frac of the elements, which sit on adjacent e4m3 values (same sign);
    rows whose scale moved (their amax element moved by an ulp of the activation dtype) must
    dequantise to within 2 e4m3 steps instead. In fp32 a last-bit difference of the amax element
    moves the scale of many rows (by ~1e-7 relative); in bf16/fp16 it is a rare one-ulp flip."""
    same = (a.scale == b.scale).flatten()
    assert same.float().mean() > (0.5 if dtype == torch.float32 else 0.9)
    if (~same).any():
        s = a.scale[~same] / b.scale[~same]
        assert ((s - 1).abs() < 2**-6).all(), s
        da, db = a.q[~same].float() * a.scale[~same], b.q[~same].float() * b.scale[~same]
        assert ((da - db).abs() <= 2 * 2**-3 * db.abs().clamp_min(2**-6 * b.scale[~same])).all()
    ca, cb = a.q[same].view(torch.uint8).int(), b.q[same].view(torch.uint8).int()
    diff = ca != cb
    assert diff.float().mean() <= frac, diff.float().mean()
    assert ((ca[diff] - cb[diff]).abs() == 1).all() and ((ca[diff] ^ cb[diff]) & 0x80 == 0).all()


def _assert_matches_plain(got: QuantizedRows, plain: torch.Tensor, device: str, keep: bool):
    """A fused producer vs the plain kernel's output `plain` quantised by the separate pass.

    Under the interpreter (one arithmetic for both): the same bytes, and `got.x` equal to `plain`. On
    the GPU the two kernels are separate compilations, and the compiler may contract a multiply-add
    into an FMA in one and not the other: measured on H200 (a diagnostic of both kernels on 77 x 3072 rows)
    the fp32 outputs differ in the last bits in ~10% of the elements (so ~10% of the rows' scales, by
    <= 2e-7 relative), fp16/bf16 outputs in ~1e-5 of them by an ulp of an intermediate (up to 4 ulp
    of a result that cancels). So there: the dequantised rows as `_assert_near_ref`, and `got.x` within
    4 ulps of the row's largest value (fp16/bf16: at <= 1e-4 of the elements)."""
    if device != "cuda":
        _assert_same_bytes(got, quantize_activation(plain))
        assert not keep or torch.equal(got.x, plain)
        return
    _assert_near_ref(got, quantize_activation(plain), frac=1e-3)
    if keep:
        d = (got.x.float() - plain.float()).abs()
        amax = plain.float().abs().amax(dim=-1, keepdim=True)
        assert (d <= 4 * torch.finfo(plain.dtype).eps * amax).all()
        assert plain.dtype == torch.float32 or (d > 0).float().mean() < 1e-4


def _assert_near_ref(a: QuantizedRows, b: QuantizedRows, frac: float = 0.02):
    """Rows quantised from a reference output that may differ by an ulp of an intermediate: codes equal
    but for <= frac of the elements; each dequantised value within one e4m3 step (2^-3 relative) of
    the reference's, plus 2^-6 of its row's amax for the elements `+ shift` cancels towards 0."""
    da, db = a.q.float() * a.scale, b.q.float() * b.scale
    assert torch.isfinite(da).all()
    assert (a.q.view(torch.uint8) != b.q.view(torch.uint8)).float().mean() <= frac
    amax = db.abs().amax(dim=1, keepdim=True)
    assert ((da - db).abs() <= 2**-3 * db.abs() + 2**-6 * amax).all()


def _assert_close_to_ref(r: QuantizedRows, want: torch.Tensor):
    """Dequantised rows vs the reference output: e4m3 keeps 3 mantissa bits (rel. error ~2-3%)."""
    got = (r.q[: r.rows].float() * r.scale[: r.rows]).view(r.shape)
    assert torch.isfinite(got).all()
    assert rel_err(want.float(), got) < 0.04


def _mod_inputs(B, D, split, dtype, device, seed):
    rows = B if split is None else 2 * B
    return _randn(rows, 3 * D, dtype=dtype, device=device, seed=seed).chunk(3, dim=-1)  # strided chunks


SHAPES = [(1, 77, 3072), (2, 37, 200)]  # 77 rows -> padded to 80; 2 x 37 = 74 -> 80; 200: not a power of 2


# ---------------------------------------------------------------------------------------------
# The e4m3 cast and the separate quantisation pass


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_quantize_rows_kernel_is_bitwise_torch(device):
    """Every e4m3 value, the values between them (ties included), tiny negatives (-0) and a zero row."""
    dev = _dev(device)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[torch.isfinite(codes)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: round to even
    row = torch.cat([grid, mids, torch.randn(1000) * 100, -torch.rand(100) * 1e-6, torch.randn(1000) * 1e-3])
    row = row.clamp(-448, 448)
    x = torch.stack([row, row.flip(0) * 0.37, torch.zeros_like(row)]).to(dev)  # row 0: amax 448, scale 1
    q, s = quantize_rows(x, rows=16)
    qr, sr = quantize_rows_ref(x)
    assert torch.equal(s[:3], sr) and not q[3:].view(torch.uint8).any() and (s[3:] == 1).all()
    c, cr = q[:3].view(torch.uint8).int(), qr.view(torch.uint8).int()
    assert torch.equal(c[[0, 2]], cr[[0, 2]])  # scale 1 (amax 448) and the zero row: the cast alone
    # row 1 divides by a scale: Triton's fp32 `/` on the GPU is the approximate division (torch's is
    # IEEE), which moves a value sitting on a tie by one step: 2.5% of this tie-heavy row on H200
    # (same diagnostic; `tl.div_rn` would make it bitwise, at an unmeasured cost in the hot
    # producer kernels). Exact under the interpreter.
    d = (c[1] - cr[1]).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < (0.05 if device == "cuda" else 1e-9)


# ---------------------------------------------------------------------------------------------
# Fused producers vs the unfused pair and vs their torch references


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,D", SHAPES)
@pytest.mark.parametrize("split", [None, 20])
def test_layernorm_modulate_fp8(device, dtype, B, L, D, split):
    dev = _dev(device)
    x = _randn(B, L + 3, D, dtype=dtype, device=dev, seed=1, scale=2.0)[:, 3:]  # strided batch dim
    shift, scale, _ = _mod_inputs(B, D, split, dtype, dev, seed=2)
    for keep in (False, True):
        got = layernorm_modulate_fp8(x, shift, scale, split=split, keep=keep, out=_poisoned(B * L, D, dev))
        _check_layout(got, (B, L, D), dtype)
        y = layernorm_modulate(x, shift, scale, split=split)  # the kernel's own plain output
        assert (got.x is not None) == keep
        _assert_matches_plain(got, y, device, keep)  # the unfused pair (byte for byte under the interpreter)
        _assert_close_to_ref(got, layernorm_modulate_fp8_ref(x, shift, scale, split=split, keep=True).x)
        # the torch reference quantises the reference output: codes may differ where that output differs
        # from the kernel's by an ulp of an intermediate (see kernels/adaln.py)
        _assert_near_ref(got, layernorm_modulate_fp8_ref(x, shift, scale, split=split))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,D", SHAPES)
@pytest.mark.parametrize("split", [None, 20])
def test_gated_residual_layernorm_modulate_fp8(device, dtype, B, L, D, split):
    dev = _dev(device)
    x = _randn(B, L, D, dtype=dtype, device=dev, seed=3, scale=2.0)
    y = _randn(B, L, D, dtype=dtype, device=dev, seed=4)
    _, _, gate = _mod_inputs(B, D, split, dtype, dev, seed=5)
    shift, scale, _ = _mod_inputs(B, D, split, dtype, dev, seed=6)
    x_plain, h_plain = gated_residual_layernorm_modulate(x, y, gate, shift, scale, split=split)
    x_ref, h_ref = gated_residual_layernorm_modulate_fp8_ref(x, y, gate, shift, scale, split=split, keep=True)
    for keep in (False, True):
        out_x = x.clone()  # in place on the residual stream, as the model may run it
        x_new, got = gated_residual_layernorm_modulate_fp8(x, y, gate, shift, scale, split=split, out_x=out_x,
                                                           keep=keep, out=_poisoned(B * L, D, dev))  # fmt: skip
        assert x_new.data_ptr() == out_x.data_ptr() and torch.equal(x_new, x_plain)
        _check_layout(got, (B, L, D), dtype)
        assert (got.x is not None) == keep
        _assert_matches_plain(got, h_plain, device, keep)
        _assert_close_to_ref(got, h_ref.x)
        _assert_near_ref(got, h_ref)
    assert rel_err(x_ref.float(), x_plain.float()) < 1e-2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
# the GELU's form: fp32 has one (tanhf, whatever the switch says), half types both
@pytest.mark.parametrize(
    "dtype, sigmoid", [(d, True) for d in DTYPES] + [(d, False) for d in DTYPES if d != torch.float32]
)
@pytest.mark.parametrize("shape", [(1, 77, 600), (2, 9, 12288)])  # 12288: the MLP width of Qwen-Image
@pytest.mark.parametrize("chunk", [256, 2048])
def test_gelu_tanh_fp8(device, dtype, sigmoid, shape, chunk, monkeypatch):
    """Chunks smaller than the row (a partial last chunk at 600 columns), rows whose amax is GELU(max h)
    and rows where it is not (all-negative, all-zero, and small positive maxima: the kernel's
    second amax pass), h left as it was; both GELU forms (tanhf, and exp2 + division for half types)."""
    from qwenfast.kernels import gelu as gelu_mod

    monkeypatch.setitem(gelu_mod.CONFIG, "chunk", chunk)
    monkeypatch.setitem(gelu_mod.CONFIG, "sigmoid", sigmoid)
    dev = _dev(device)
    h = _randn(*shape, dtype=dtype, device=dev, seed=7, scale=3.0)
    h[0, 0] = 0  # an all-zero GELU row
    h[0, 1] = -h[0, 1].abs()  # an all-negative row: amax from the GELU's dip (|gelu| <= 0.17)
    h[0, 2] = -h[0, 2].abs()
    h[0, 2, 5] = 0.2  # max h = 0.2: GELU(0.2) = 0.116 < the dip's 0.17 at -0.75 -> the second amax pass
    h[0, 3] = h[0, 3].clamp(max=0.3)  # max 0.3 (GELU 0.185): the first pass's amax
    M, N = h.numel() // shape[-1], shape[-1]
    plain = F.gelu(h, approximate="tanh")
    for keep in (False, True):
        h_in = h.clone()
        got = gelu_tanh_fp8(h_in, keep=keep, out=_poisoned(M, N, dev))
        assert torch.equal(h_in, h)  # h is left as it was
        _check_layout(got, shape, dtype)
        assert (got.x is not None) == keep
        if keep:  # torch's GELU up to a last-bit difference of the fp32 tanh (one ulp of the dtype)
            # (atol: 1 + tanh cancels for inner << 0, where any fp32 tanh is off by its ulp near -1)
            d = (got.x.double() - plain.double()).abs()
            atol = 1e-6 * plain.double().abs().max()
            assert torch.isfinite(got.x).all() and (d <= plain.double().abs() * 2.0**-7 + atol).all()
            if sigmoid and dtype != torch.float32:
                # x / (1 + exp2(..)) has no cancellation: the float64 GELU rounded to the dtype, but for
                # rare one-ulp flips (torch's own formula loses bits to 1 + tanh for x < ~-2, so it
                # differs from both in more elements there)
                exact = F.gelu(h.double(), approximate="tanh").to(dtype).double()
                assert ((got.x.double() - exact).abs() > atol).float().mean() < 0.01
            else:  # libdevice's tanh is CUDA's tanhf (as torch's); the interpreter's exp-based tanh is not
                assert (d > 0).float().mean() < (0.01 if device == "cuda" else 0.5)
        _assert_within_one_step(got, quantize_activation(plain), 2e-3, dtype)
        _assert_close_to_ref(got, plain)
        _assert_within_one_step(got, gelu_tanh_fp8_ref(h), 2e-3, dtype)


def test_fused_launchers_fall_back_to_the_unfused_pair():
    """Rows longer than the GELU kernel holds, or (on CPU without the interpreter) any input: the
    launchers return exactly the two separate passes."""
    dev = "cuda" if FP8_GPU and not INTERP else "cpu"
    h = _randn(3, MAX_N + 16, dtype=torch.bfloat16, device=dev, seed=8)
    _assert_same_bytes(gelu_tanh_fp8(h), quantize_activation(F.gelu(h, approximate="tanh")))
    x = _randn(2, 5, 48, dtype=torch.float32, device="cpu", seed=9)
    shift, scale, gate = _mod_inputs(2, 48, None, torch.float32, "cpu", seed=10)
    with K.use_backend("torch"):
        got = layernorm_modulate_fp8(x, shift, scale, keep=True)
        _assert_same_bytes(got, layernorm_modulate_fp8_ref(x, shift, scale))
        assert torch.equal(got.x, layernorm_modulate(x, shift, scale))
        xn, got = gated_residual_layernorm_modulate_fp8(x, x, gate, shift, scale)
        _assert_same_bytes(got, gated_residual_layernorm_modulate_fp8_ref(x, x, gate, shift, scale)[1])
    with pytest.raises(ValueError, match="out must be"):
        layernorm_modulate_fp8(x, shift, scale, out=_poisoned(100, 48, "cpu"))  # 112 rows, not 64


# ---------------------------------------------------------------------------------------------
# FP8Linear on pre-quantised rows


@pytest.mark.parametrize("lora", [False, True])
def test_fp8_linear_on_quantized_rows_is_its_own_quantisation(lora):
    from qwenfast.loading.lora_fp8 import set_side_lora

    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(96, 48))
    if lora:
        set_side_lora(layer, [(None, torch.randn(48, 4) * 0.1, torch.randn(4, 96) * 0.1, 0.7)], pieces=1)
    x = torch.randn(2, 37, 96)
    want = layer(x)
    assert torch.equal(layer(quantize_rows_ref_padded(x, keep=lora)), want)
    if lora:
        with pytest.raises(RuntimeError, match="keep=True"):
            layer(quantize_rows_ref_padded(x, keep=False))


# ---------------------------------------------------------------------------------------------
# The whole transformer: fusion on vs off


def _tiny_fp8_model(zero_cond_t: bool, device: str, quantize: bool = True):
    """Two blocks, FP8 block Linears (float ones with `quantize=False`); bf16 on CUDA (rowwise-scaled
    `_scaled_mm` writes bf16), fp32 on CPU."""
    from qwenfast.config import TransformerConfig
    from qwenfast.kernels.fp8_linear import quantize_model
    from qwenfast.models.transformer import QwenImageTransformer

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, num_attention_heads=2, attention_head_dim=32, joint_attention_dim=48,
                            axes_dims_rope=(8, 12, 12), zero_cond_t=zero_cond_t)  # fmt: skip
    model = QwenImageTransformer(cfg).eval().to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    with torch.no_grad():
        for m in model.modules():  # stronger residual branches than the default init: the MLP matters
            if isinstance(m, torch.nn.Linear) and m.out_features == 6 * cfg.inner_dim:
                m.weight.mul_(4)
        assert not quantize or quantize_model(model) == 16
    return model


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_transformer_fused_fp8_matches_unfused(device, zero_cond_t):
    from qwenfast.loading.lora_fp8 import set_side_lora

    dev = _dev(device)
    model = _tiny_fp8_model(zero_cond_t, dev)
    shapes = [(1, 4, 6), (1, 2, 3)] if zero_cond_t else [(1, 4, 6)]
    n_img = sum(f * h * w for f, h, w in shapes)
    g = torch.Generator().manual_seed(1)
    dt = model.dtype
    x, txt = torch.randn(1, n_img, 64, generator=g).to(dev, dt), torch.randn(1, 5, 48, generator=g).to(dev, dt)
    t = torch.tensor([0.6], device=dev)
    seen: dict[str, type] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, type(args[0])))
             for n, m in model.named_modules() if isinstance(m, FP8Linear)]  # fmt: skip
    # an unmerged LoRA on one fused consumer of each kind: the producers must keep the plain input
    b0 = model.transformer_blocks[0]
    for lin in (b0.attn.to_qkv, b0.img_mlp.net[0].proj, b0.img_mlp.net[2]):
        N, Kd = lin.out_features, lin.in_features
        set_side_lora(lin, [(None, torch.randn(N, 4, generator=g).to(dev), torch.randn(4, Kd, generator=g).to(dev),
                             0.3)], pieces=1)  # fmt: skip
    outs = {}
    try:
        with torch.no_grad():
            for on, gelu, fed in ((False, False, 0), (True, False, 8), (True, True, 12)):  # (on, gelu): 12
                set_fp8_fusion(on, gelu=gelu)
                seen.clear()
                outs[on, gelu] = model(x, txt, None, t, shapes)
                rows = sorted(n.split(".", 2)[2] for n, tp in seen.items() if tp is QuantizedRows)
                assert len(seen) == 16 and len(rows) == fed, rows
                if (on, gelu) == (True, False):  # QWENFAST_FP8_FUSE=norm: the LayerNorm producers (same bytes but rare codes)
                    assert rel_err(outs[False, False], outs[True, False]) < (1e-4 if dt == torch.float32 else 5e-3)
    finally:
        set_fp8_fusion(True, gelu=True)  # the default
        for h in hooks:
            h.remove()
    assert rows == sorted(2 * ["attn.to_qkv", "attn.add_qkv_proj", "img_mlp.net.0.proj", "img_mlp.net.2",
                               "txt_mlp.net.0.proj", "txt_mlp.net.2"])  # fmt: skip
    assert torch.isfinite(outs[True, True]).all()
    # equal but for the GELU's rare one-step codes (kernels/gelu.py)
    assert rel_err(outs[False, False], outs[True, True]) < (2e-3 if dt == torch.float32 else 5e-3)
    b0.attn.to_qkv.lora = None  # the LoRA itself moves the output far more than the fusion does
    with torch.no_grad():
        assert rel_err(outs[True, True], model(x, txt, None, t, shapes)) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERP, reason="needs an FP8 GPU")
def test_fused_fp8_under_cuda_graph():
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    model = _tiny_fp8_model(False, "cuda")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 96, 64, generator=g).to("cuda", torch.bfloat16)
    txt = torch.randn(1, 7, 48, generator=g).to("cuda", torch.bfloat16)
    t, shapes = torch.tensor([0.6], device="cuda"), [(1, 8, 12)]
    graphs = CudaGraphRunner(model)
    with torch.no_grad():
        eager = model(x, txt, None, t, shapes)
        for _ in range(4):  # warm-up, capture, replays
            out = graphs(x, txt, None, t, shapes)
    assert torch.equal(out, eager)


# ---------------------------------------------------------------------------------------------
# The kernel cases once more, in Triton's CPU interpreter (a child process with TRITON_INTERPRET=1)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERP, reason="already running under the interpreter")
def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)
