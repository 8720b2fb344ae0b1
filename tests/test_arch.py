"""The arch table (runtime/arch.py): under each QWENFAST_ARCH every dispatch site answers as the table
says, and nothing the table forbids is called (FA3 spied on through the attention seam)."""

import pytest
import torch
import torch.nn.functional as F

from qwenfast.kernels.fp8_linear import fp8_supported
from qwenfast.runtime import arch as A
from qwenfast.runtime import attention as attn
from qwenfast.runtime.attention_fp8 import _why_not_meta, engine_names

CUDA = torch.device("cuda", 0)  # a device object only: under QWENFAST_ARCH no CUDA call is made


@pytest.fixture(params=list(A.ARCHS))
def forced(request, monkeypatch):
    monkeypatch.setenv(A.ENV_VAR, request.param)
    return A.ARCHS[request.param]


def test_every_dispatch_site_reads_the_table(forced):
    assert A.arch(CUDA) is forced and A.arch("cpu") is forced  # forced rows answer for any device
    assert fp8_supported(CUDA) is forced.fp8_gemm
    assert attn.fa3_runs(CUDA) is forced.fa3
    why = _why_not_meta(torch.bfloat16, CUDA, 128, None)
    assert (why is None) is forced.fp8_attention, why
    if why is not None:
        assert forced.name in why  # the warning names the architecture
    assert ("fa3" in engine_names(CUDA)) is forced.fa3  # FA3's FP8 forward only where its kernels run


def test_what_the_table_says_per_architecture():
    t = A.ARCHS
    assert [n for n, a in t.items() if a.fa3] == ["sm_90"]  # FA3's kernels are built for Hopper only
    assert [n for n, a in t.items() if not a.fp8_gemm] == ["sm_80", "sm_86"]  # FP8 tensor cores from Ada
    assert all(a.int8_gemm and a.cuda_graphs and a.triton for a in t.values())
    # GeForce Ampere / Ada / Blackwell: INT8 at full rate, bf16 (fp32 accumulation) at a quarter or half
    assert {n: a.fastest_gemm for n, a in t.items()} == {
        "sm_80": "int8", "sm_86": "int8", "sm_89": "int8", "sm_90": "fp8", "sm_100": "fp8", "sm_120": "int8",
    }  # fmt: skip
    assert t["sm_86"].rates["int8"] / t["sm_86"].rates["bf16"] > 7


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: walks the CUDA branch of the attention dispatch on a CPU."""

    @property
    def is_cuda(self):
        return True


class Spy:
    def __init__(self):
        self.calls = 0

    def flash_attn_func(self, q, k, v):  # (B, S, H, D)
        self.calls += 1
        q, k, v = (torch.Tensor(t).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


@pytest.mark.parametrize("choice", ["auto", "fa3"])
def test_fa3_is_called_only_where_the_table_allows_it(forced, monkeypatch, choice):
    spy = Spy()
    monkeypatch.setattr(attn, "_fa3", lambda allow_fwd=False: spy)
    monkeypatch.setattr(attn, "_sdpa_backends", lambda c, m: [torch.nn.attention.SDPBackend.MATH])
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 3, 37, 64, generator=g).to(torch.bfloat16).as_subclass(FakeCuda) for _ in range(3)
    )
    with attn.use_attention(choice):
        out = attn._attention(q, k, v, None)
    assert spy.calls == (1 if forced.fa3 else 0)
    want = F.scaled_dot_product_attention(*(torch.Tensor(t).float() for t in (q, k, v)))
    assert torch.allclose(torch.Tensor(out).float(), want, atol=2e-2, rtol=2e-2)


def test_capability_to_row_and_bad_names(monkeypatch):
    assert A.of_capability(8, 7).name == "sm_86"  # Orin: the Ampere row below it
    assert A.of_capability(9, 0).name == "sm_90" and A.of_capability(10, 3).name == "sm_100"
    assert A.of_capability(12, 1).name == "sm_120" and A.of_capability(7, 5) is A.NONE
    monkeypatch.setenv(A.ENV_VAR, "90")
    assert A.arch().name == "sm_90"
    monkeypatch.setenv(A.ENV_VAR, "sm_75")
    with pytest.raises(ValueError, match="sm_80, sm_86"):
        A.arch()
    monkeypatch.delenv(A.ENV_VAR)
    if not torch.cuda.is_available():
        assert A.arch(CUDA) is A.NONE and not fp8_supported(CUDA)
    assert A.arch("cpu") is A.NONE


def test_doctor_prints_the_row(monkeypatch, capsys):
    from qwenfast.cli import main

    monkeypatch.setenv(A.ENV_VAR, "sm_86")
    main(["doctor"])
    out = capsys.readouterr().out
    assert "sm_86, Ampere (GeForce / workstation) (as QWENFAST_ARCH says): GEMMs bf16;" in out
    assert "->sm_86" in out and "fastest GEMM precision on the spec sheet: int8" in out


@pytest.mark.parametrize("lora", [False, True])
def test_fp8_weights_run_weight_only_where_fp8_gemms_do_not(monkeypatch, lora):
    """An FP8 layer on a CUDA card without FP8 GEMMs (sm_80 / sm_86) keeps its e4m3 weights and runs a GEMM
    in the activations' dtype on the dequantised weight; the activation is not quantised (not the FP8
    path's numbers). On sm_89+ the same tensor takes another path (here: the reference, it is no real
    CUDA tensor)."""
    from qwenfast.kernels.fp8_linear import FP8Linear, fp8_linear_ref

    torch.manual_seed(1)
    lin = torch.nn.Linear(48, 40)
    q = FP8Linear.from_linear(lin)
    if lora:
        q.lora = (torch.randn(4, 48) * 0.1, torch.randn(40, 4) * 0.1)
    x = torch.randn(2, 5, 48).as_subclass(FakeCuda)
    w = q.weight_fp8.float() * q.weight_scale
    want = F.linear(torch.Tensor(x), w, lin.bias)
    if lora:
        want = want + (torch.Tensor(x) @ q.lora[0].t()) @ q.lora[1].t()
    for name in ("sm_80", "sm_86"):
        monkeypatch.setenv(A.ENV_VAR, name)
        got = torch.Tensor(q(x))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(A.ENV_VAR, "sm_90")
    other = torch.Tensor(q(x))
    if not lora:
        torch.testing.assert_close(other, fp8_linear_ref(torch.Tensor(x), q.weight_fp8, q.weight_scale, q.bias,
                                                          torch.float32))  # fmt: skip
    assert (other - want).abs().max() > 1e-4  # the activation's quantisation: a different computation


def test_gpu_estimates_follow_the_stated_model():
    """docs/gpus.md's estimated rows: compute at spec rates (attention in bf16) or PCIe for what does not
    fit, whichever is larger; 8-bit block Linears fit a 24 GB card, bf16 ones do not."""
    from qwenfast.benchmarks.report_gpus import ACTIVATIONS_GB, PCIE_GBS, _weights_gb, estimate
    from qwenfast.config import TransformerConfig

    cfg = TransformerConfig()
    L = 4096 + 128
    attn = cfg.num_layers * 4 * L * L * cfg.inner_dim
    gemm = cfg.flops_per_forward(4096, 128) - attn
    r = A.ARCHS["sm_86"].rates
    e = estimate("RTX 3090", r, "int8")
    assert abs(e["compute_ms"] - 1e3 * (gemm / (r["int8"] * 1e12) + attn / (r["bf16"] * 1e12))) < 1e-6
    assert e["over_gb"] == 0 and e["ms"] == e["compute_ms"]
    b = estimate("RTX 3090", r, "bf16")
    assert b["over_gb"] == _weights_gb("bf16") + ACTIVATIONS_GB - 24 > 0
    assert b["stream_ms"] == b["over_gb"] / PCIE_GBS * 1e3 and b["ms"] == max(b["compute_ms"], b["stream_ms"])
    assert 0.45 < _weights_gb("int8") / _weights_gb("bf16") < 0.6  # block Linears: most of the weights


def test_forward_split_takes_the_newest_default_profile_and_states_each_floor():
    """docs/gpus.md's forward split: the newest default 1024² profile of a Hopper card (not an A/B row with
    another GELU form or an attention switch), each part's kernel time beside its FLOPs at the sm_90
    spec rate, the memory-bound kernels summed, and the back-to-back and spaced forwards."""
    from qwenfast.benchmarks.records import Rec
    from qwenfast.benchmarks.report import tables
    from qwenfast.benchmarks.report_gpus import _split_flops, forward_split

    def rec(line, date, **kw):
        return Rec("profile_forward.jsonl", line, {
            "bench": "profile_forward", "size": 1024, "gelu": "sigmoid", "gpu": "NVIDIA H200", "date": date,
            "commit": "abcdef0", "wall_ms": 81.0, "spaced_ms": 74.9, "kernels": 1293, "gap_ms": 1.75,
            "sm_clock_mhz_in_loop": {"min": 1425, "median": 1980, "max": 1980, "n": 300},
            "by_category_ms": {"gemm": 43.6, "attention": 18.2, "norm": 5.9, "gelu": 4.3, "qk_norm_rope": 2.6,
                               "quant": 1.0, "other": 0.1}, **kw})  # fmt: skip

    assert "No record yet" in forward_split([])
    recs = [rec(1, "2026-11-27", wall_ms=90.0), rec(2, "2026-11-28"), rec(3, "2026-11-29", gelu="tanhf"),
            rec(4, "2026-11-29", env={"QWENFAST_ATTENTION": "fp8"}), rec(5, "2026-11-29", spaced_ms=None)]  # fmt: skip
    out = forward_split(recs)
    assert tables()["forward-split"] is forward_split
    gemm, attn = _split_flops()
    rates = A.ARCHS["sm_90"].rates
    assert f"| 43.6 ms | {gemm / rates['fp8'] / 1e9:.1f} ms |" in out
    assert f"| 18.2 ms | {attn / rates['bf16'] / 1e9:.1f} ms |" in out
    assert "| 13.9 ms |" in out  # norm + gelu + qk_norm_rope + quant + other
    assert "| forwards back to back | 81.0 ms |" in out and "| 74.9 ms |" in out
    assert "1425-1980 MHz" in out and "line 2)" in out and "90.0 ms" not in out
    powered = forward_split(recs + [rec(6, "2026-11-30", power_w_in_loop={"median": 690.0, "max": 704.0},
                                        power_capped_share=1.0, sm_clock_mhz_in_loop={"min": 1395, "median": 1560,
                                                                                        "max": 1980, "n": 164})])  # fmt: skip
    assert "SM clock median 1560 MHz (max 1980), power median 690 W" in powered and "in 100% of" in powered


@pytest.mark.parametrize("driver", ["new", "old", "broken"])
def test_profile_forward_samples_clock_power_and_cap_from_any_driver(driver, monkeypatch):
    """bench/profile_forward.py's sampler on a fake nvidia-smi (no GPU needed): a driver with the power-cap
    field gives its share of samples; an older one, which refuses that field, is asked again without it (no
    share); a failing nvidia-smi gives no samples and does not hang the timed call."""
    import importlib.util
    import subprocess
    import threading
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "profile_forward.py"
    spec = importlib.util.spec_from_file_location("profile_forward_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = iter(["1560, 691.0, Active", "1605, 650.5, Not Active", "1500, 699.9, Active", "1560, 680.0, Active"])
    asked, enough = [], threading.Event()

    def fake_run(cmd, **kw):
        fields = cmd[1].split("=", 1)[1]
        asked.append(fields)
        if driver == "broken" or (driver == "old" and fields.count(",") == 2):
            if driver == "broken":
                enough.set()  # (the sampler gives up after this call: the timed call may end)
            return subprocess.CompletedProcess(cmd, 6, "", "Field is not a valid field to query.")
        row = next(rows, None)
        if row is None:
            enough.set()
            row = "1560, 680.0, Active"
        if fields.count(",") == 1:
            row = row.rsplit(",", 1)[0]
        return subprocess.CompletedProcess(cmd, 0, row + "\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    r, clk, watts, cap = mod._with_clocks(lambda: "ran" if enough.wait(60) else "no samples")
    assert r == "ran"
    if driver == "broken":
        # (the first refusal reads as an older driver's; the plain query failing too ends the sampling)
        assert clk["n"] == 0 and cap is None and asked == [
            "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap",
            "clocks.sm,power.draw",
        ]
        return
    assert clk["n"] >= 4 and clk["min"] == 1500 and clk["max"] == 1605 and watts["max"] == 699.9
    if driver == "old":
        assert cap is None and asked[0].count(",") == 2 and all(f == "clocks.sm,power.draw" for f in asked[1:])
    else:
        assert 0.5 < cap < 1 and all(f.count(",") == 2 for f in asked)
