"""Exports of qwenfast models for other runtimes: `onnx_export` (ONNX graphs per component) and
`onnx_runtime` (running them with onnxruntime, which the tests and `--check` use)."""
