"""`qwenfast export onnx` as a newcomer runs it: the documented bf16 text-encoder example exports, a
check that cannot run is refused up front with the reason, and a missing extra is one line saying how
to install it."""

from __future__ import annotations

import sys

import pytest

from qwenfast.cli import main

pytest.importorskip("onnx")


def test_text_encoder_exports_in_bf16(tmp_path, capsys):
    """The README's example: transformers' SDPA decomposition made a ComplexDouble constant in bf16 (the
    export died with "ScalarType ComplexDouble is an unexpected tensor scalar type" and wrote nothing)."""
    import onnx

    out = tmp_path / "teb.onnx"
    assert main(["export", "onnx", "--component", "text-encoder", "--dtype", "bf16", "-o", str(out)]) == 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    (last,) = model.graph.output
    assert last.name == "last_hidden_state" and last.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    complex_types = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
    assert not [t.name for t in model.graph.initializer if t.data_type in complex_types]
    err = capsys.readouterr().err
    assert "Traceback" not in err and "TracerWarning" not in err


def test_bf16_check_is_refused_before_any_work(tmp_path, capsys):
    """onnxruntime's CPU provider has no bf16 Conv / MatMul: the check could only fail, so it is refused
    before exporting, with what to do instead (it used to write the file, then print ORT's traceback)."""
    out = tmp_path / "vd.onnx"
    argv = ["export", "onnx", "--component", "vae-decoder", "--dtype", "bf16", "--check", "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --check runs the graph in onnxruntime's CPU provider, which has no bfloat16")
    assert "--dtype fp32" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_check_onnxruntime_cannot_run_is_one_error_line(tmp_path, capsys, monkeypatch):
    """Whatever else onnxruntime refuses is one `error:` line that says the file was written."""
    pytest.importorskip("onnxruntime")
    from qwenfast.export import onnx_runtime

    class Refuses:
        def __init__(self, path, *a, **k):
            raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed: some op\nmore detail")

    monkeypatch.setattr(onnx_runtime, "OnnxComponent", Refuses)
    out = tmp_path / "vd.onnx"
    argv = ["export", "onnx", "--component", "vae-decoder", "--height", "32", "--width", "32", "--check", "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert line == [f"error: {out} was written, but onnxruntime (CPU) could not run it: [ONNXRuntimeError] : 10 : "
                    "INVALID_GRAPH : Load model failed: some op"], err  # fmt: skip
    assert out.exists() and "Traceback" not in err


@pytest.mark.parametrize("missing, check", [("onnx", False), ("onnxruntime", True)])
def test_missing_export_extra_is_one_line_with_both_install_forms(missing, check, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed (find_spec answers None)
    argv = ["export", "onnx", "--component", "vae-decoder", "-o", str(tmp_path / "x.onnx"), *(["--check"] * check)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: qwenfast export onnx needs the export extra ({missing} is missing): "
                   "pip install 'qwenfast[export]' (or, from a checkout: pip install -e \".[export]\")\n")  # fmt: skip
    assert not (tmp_path / "x.onnx").exists()


def test_export_onnx_from_python_names_the_extra(monkeypatch):
    from qwenfast.export.onnx_export import export_onnx
    from qwenfast.validation import MissingExtra

    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(MissingExtra, match=r"pip install 'qwenfast\[export\]'"):
        export_onnx(None, "vae-decoder", "x.onnx")
