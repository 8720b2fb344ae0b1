"""CUDA graphs for the transformer forward, and regional torch.compile.

Why graphs: a Qwen-Image forward launches ~2,000 kernels. At 1024² the GPU time hides the launch
cost, but at 512² or with 4-step LoRAs the CPU becomes the bottleneck. A graph replays the whole
forward with one launch. Graphs are captured per input signature (batch, image tokens, text length,
mask or not, image shapes) and kept in a small LRU; every capture shares one memory pool. If capture
fails (an op that cannot be captured, or no CUDA), the runner warns once and runs eagerly.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch


class CudaGraphRunner:
    """Call like the transformer; replays a captured graph when the inputs are on CUDA."""

    def __init__(self, model: torch.nn.Module, max_graphs: int = 4, warmup: int = 2):
        self.model = model
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.enabled = True
        self._pool = None

    def _key(self, x, txt, mask, t, img_shapes, extra):
        return (tuple(x.shape), tuple(txt.shape), mask is None, tuple(map(tuple, img_shapes)), x.dtype,
                str(x.device), extra is None)  # fmt: skip

    def __call__(self, x, txt, mask, t, img_shapes, additional_t_cond=None):
        if not (self.enabled and x.is_cuda):
            return self.model(x, txt, mask, t, img_shapes, additional_t_cond)
        key = self._key(x, txt, mask, t, img_shapes, additional_t_cond)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(x, txt, mask, t, img_shapes, additional_t_cond)
            except torch.OutOfMemoryError:  # not a capture problem: let the OOM back-off split the batch
                torch.cuda.synchronize()
                raise
            except Exception as e:  # any capture failure: fall back to eager, keep serving
                warnings.warn(f"CUDA graph capture failed, running eagerly from now on: {e}", stacklevel=2)
                self.enabled = False
                torch.cuda.synchronize()
                return self.model(x, txt, mask, t, img_shapes, additional_t_cond)
            self.graphs[key] = entry
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, (x, txt, mask, t, additional_t_cond)):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        return static_out.clone()  # the static buffer is overwritten by the next replay

    def _capture(self, x, txt, mask, t, img_shapes, extra):
        static_in = tuple(None if a is None else a.clone() for a in (x, txt, mask, t, extra))
        sx, stxt, smask, st, sextra = static_in
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(self.warmup):  # warm-up outside the graph: lazy inits, autotuning, caches
                self.model(sx, stxt, smask, st, img_shapes, sextra)
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(sx, stxt, smask, st, img_shapes, sextra)
        return graph, static_in, out

    def clear(self):
        self.graphs.clear()


def compile_blocks(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """Regional compilation: compile each transformer block in place (one compile, reused by all 60
    identical blocks), which is how diffusers' `compile_repeated_blocks` works and far faster to
    compile than the whole model."""
    kwargs.setdefault("fullgraph", True)
    kwargs.setdefault("dynamic", False)
    for block in model.transformer_blocks:
        block.compile(**kwargs)
    return model
