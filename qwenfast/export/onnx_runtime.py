"""Run an exported component with onnxruntime: torch tensors in, torch tensors out.

What the tests (and `qwenfast export onnx --check`) compare against the torch model. CPU by default;
`providers` picks others (CUDAExecutionProvider, TensorrtExecutionProvider) where installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
       "tensor(int32)": np.int32, "tensor(double)": np.float64}  # fmt: skip


class OnnxComponent:
    """`OnnxComponent("vae_decoder.onnx")(latents=z)` -> the graph's first output as a torch tensor.

    Inputs are cast to what the graph declares (bf16 graphs take float32 numpy input only where
    the provider has bf16 kernels; onnxruntime's CPU provider mostly does not).
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        try:
            import onnxruntime as ort  # the [export] extra
        except ImportError:
            from ..validation import MissingExtra

            raise MissingExtra("running an exported graph", "export", "onnxruntime") from None

        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, **feeds: torch.Tensor) -> torch.Tensor:
        missing = sorted(set(self.inputs) - set(feeds))
        unknown = sorted(set(feeds) - set(self.inputs))
        if missing or unknown:
            raise ValueError(f"graph inputs are {sorted(self.inputs)}; missing {missing}, unknown {unknown}")
        arrays = {}
        for name, t in feeds.items():
            want = _NP.get(self.inputs[name].type)
            if want is None:
                raise ValueError(
                    f"input {name!r} has type {self.inputs[name].type}, which this runner does not feed"
                )
            arrays[name] = (
                t.detach().cpu().float().numpy().astype(want)
                if want != np.int64 and want != np.int32
                else t.detach().cpu().numpy().astype(want)
            )
        out = self.session.run(self.outputs[:1], arrays)[0]
        return torch.from_numpy(np.asarray(out))
