"""The exact attention backends agree with the fp32 reference on odd shapes, and "auto" runs what its
docstring says: FA3 first where it is installed and the GPU is a Hopper, else cuDNN (GPU-only). Where FA3
must run (gpu_engines.py: a Hopper with an FA3 package installed) it must load: a broken install fails
here instead of quietly running cuDNN. The must-run rule itself is checked on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenfast.runtime import attention as A

from .gpu_engines import MODULES, cuda_capability, must_run

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fa3_expected() -> bool:
    """FA3 serves "auto": it must, where gpu_engines.must_run says so (then it must have loaded)."""
    why = must_run("fa3", cuda_capability())
    loaded = A._fa3(allow_fwd=True) is not None
    if why:
        assert loaded, f"FA3 must load here ({why}) but qwenfast.runtime.attention did not import it"
    return loaded and A.fa3_runs(torch.device("cuda"))


@pytest.mark.parametrize("engine,capability,found,expect", [
    ("fa3", None, {"fa3_fwd_interface"}, None),  # no GPU
    ("fa3", (8, 9), {"fa3_fwd_interface", "flash_attn_interface"}, None),  # Ada: no FA3 kernels
    ("fa3", (10, 0), {"flash_attn_interface"}, None),  # Blackwell: FA3 is Hopper-only
    ("fa3", (9, 0), set(), None),  # Hopper without the package: skips say so
    ("fa3", (9, 0), {"fa3_fwd_interface"}, "sm_90 with fa3_fwd_interface installed"),
    ("fa3", (9, 0), {"flash_attn_interface"}, "sm_90 with flash_attn_interface installed"),
    ("cudnn", (9, 0), {"cudnn"}, "sm_90 with cudnn installed"),
    ("cudnn", (9, 0), {"fa3_fwd_interface"}, None),  # the other engine's package does not count
    ("cudnn", (8, 0), {"cudnn"}, None),
])  # fmt: skip
def test_which_gpu_and_package_combinations_must_run(engine, capability, found, expect):
    assert must_run(engine, capability, found.__contains__) == expect
    with pytest.raises(ValueError, match="unknown engine"):
        must_run("fa4", (9, 0), found.__contains__)
    assert set(MODULES) == {"fa3", "cudnn"}


def test_installed_finds_modules_without_importing_them():
    import sys

    from .gpu_engines import installed

    assert installed("json") and not installed("no_such_module_qwenfast") and not installed("no_such_pkg_qf.sub")
    sys.modules.pop("colorsys", None)
    assert installed("colorsys") and "colorsys" not in sys.modules


@gpu
@pytest.mark.parametrize("B,H,S,D", [(1, 3, 77, 64), (2, 5, 301, 128), (1, 24, 1031, 128)])
def test_backends_match_the_fp32_reference(B, H, S, D):
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).transpose(1, 2) for _ in range(3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    outs = {}
    for name in ("auto", "cudnn", "fa3", "math"):
        with A.use_attention(name):
            o = A.attention(qb, kb, vb).float()
        assert not o.isnan().any(), name
        err = float((o - want).norm() / want.norm())
        assert err < 1e-2, (name, err)
        outs[name] = o
    assert torch.equal(outs["auto"], outs["fa3"] if _fa3_expected() else outs["cudnn"])


@gpu
def test_auto_calls_fa3_on_hopper_when_installed(monkeypatch):
    if not _fa3_expected():  # (fails instead where FA3 must run)
        pytest.skip("FA3 not installed or not a Hopper GPU: auto runs cuDNN (checked above)")
    mod, calls = A._fa3(allow_fwd=True), []

    class Spy:
        def flash_attn_func(self, *a, **k):
            calls.append(a[0].shape)
            return mod.flash_attn_func(*a, **k)

    monkeypatch.setattr(A, "_fa3", lambda allow_fwd=False: Spy())
    q = torch.randn(1, 4, 33, 128, device="cuda", dtype=torch.bfloat16)
    with A.use_attention("auto"):
        A.attention(q, q, q)
        A.attention(q.float(), q.float(), q.float())  # fp32: not FA3's
    assert calls == [(1, 33, 4, 128)]


@gpu
def test_a_mask_never_goes_to_fa3():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 50, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool, device="cuda")
    mask[1, ..., 40:] = False
    with A.use_attention("auto"):
        o = A.attention(q, k, v, mask).float()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask).float()
    assert float((o - want).norm() / want.norm()) < 1e-2
