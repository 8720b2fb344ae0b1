"""The arch table (runtime/arch.py): under each QWENFAST_ARCH every dispatch site answers as the table
says, and nothing the table forbids is called (FA3 spied on through the attention seam)."""

import pytest
import torch
import torch.nn.functional as F

from qwenfast.kernels.fp8_linear import fp8_supported
from qwenfast.runtime import arch as A
from qwenfast.runtime import attention as attn
from qwenfast.runtime.attention_fp8 import _why_not_meta

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
    q, k, v = (torch.randn(1, 3, 37, 64, generator=g).to(torch.bfloat16).as_subclass(FakeCuda) for _ in range(3))
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
