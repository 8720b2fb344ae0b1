"""CUDA graphs for the transformer forward, and regional torch.compile.

Why graphs: a Qwen-Image forward launches ~2,000 kernels. At 1024² the GPU time hides the launch
cost, but at 512² or with 4-step LoRAs the CPU becomes the bottleneck. A graph replays the whole
forward with one launch. Graphs are captured per input signature (batch, image tokens, text length,
mask or not, image shapes) and kept in a small LRU; every capture shares one memory pool. If capture
fails (an op that cannot be captured, or no CUDA), the runner warns once and runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import OrderedDict, deque
from typing import Any

import torch

from .blocks import BlockRunner
from .contract import BlockModel, OwnsBlockRunner

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The side stream that every capture and its warm-ups run on: one per device for the process.

    Why one: `torch.cuda.Stream()` hands out PyTorch's pooled streams in turn (32 per device), and
    cuBLAS allocates a workspace (32 MiB on Hopper, counted as allocated memory) for each stream it
    runs on and keeps it. A new stream per capture grew a server's resting memory by that much for
    each of its first 32 captures (a serving soak's floor rose ~1 GiB over its first minutes)."""
    dev = torch.cuda.current_device()
    s = _CAPTURE_STREAMS.get(dev)
    if s is None:
        s = _CAPTURE_STREAMS[dev] = torch.cuda.Stream()
    return s


class _GraphCache:
    """Captured graphs per input signature in a small LRU, one shared memory pool, eager fallback.

    `_run(key, fn, inputs)` replays the graph captured for `key` (capturing `fn(*inputs)` the first
    time, after `warmup` eager runs on a side stream), with `inputs` copied into its static buffers
    (None entries stay None). An OOM during capture is re-raised for the OOM back-off; any other
    capture failure warns once and turns graphs off for good (eager from then on).
    """

    what = "CUDA graph"

    def __init__(self, max_graphs: int = 4, warmup: int = 2):
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.enabled = True
        self._pool = None
        self.captures = 0  # stats: graphs captured and replays run so far, graphs dropped as stale
        self.replays = 0
        self.stale = 0
        # the last captures: (time.monotonic(), what, allocated GiB before, after): which shapes a
        # server's load still captured, and what each added to its resting memory
        self.log: deque = deque(maxlen=64)

    def run(self, key: tuple, fn, *inputs: torch.Tensor | None) -> torch.Tensor:
        """`fn(*inputs)`, replayed from the graph captured for `key` (captured on first use); eager
        when graphs are off (a failed capture) or the inputs are not on CUDA. Everything else `fn`
        reads (weights, a KV cache) must stay at the same addresses while `key` is in use: the
        caller keeps such buffers static and calls `clear()` before it drops them."""
        if not (self.enabled and any(a is not None and a.is_cuda for a in inputs)):
            return fn(*inputs)
        return self._run(key, fn, inputs)

    def _run(self, key: tuple, fn, inputs: tuple) -> torch.Tensor:
        entry = self.graphs.get(key)
        if entry is None:
            t, before = time.monotonic(), torch.cuda.memory_allocated()
            try:
                entry = self._capture(fn, inputs)
            except torch.OutOfMemoryError:  # not a capture problem: let the OOM back-off split the batch
                torch.cuda.synchronize()
                raise
            except Exception as e:  # noqa: BLE001 - any capture failure: fall back to eager, keep serving
                warnings.warn(f"{self.what} capture failed, running eagerly from now on: {e}", stacklevel=3)
                self.enabled = False
                torch.cuda.synchronize()
                return fn(*inputs)
            self.graphs[key] = entry
            self.captures += 1
            self.log.append((t, self._describe(key), before / 2**30, torch.cuda.memory_allocated() / 2**30))
            self.resize(self.max_graphs)
        else:
            self.graphs.move_to_end(key)
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        self.replays += 1
        self._replayed()
        return static_out.clone()  # the static buffer is overwritten by the next replay

    def _describe(self, key: tuple) -> str:
        """A short name of a graph's key for the capture log: its input shapes."""
        return " ".join(str(k) for k in key if isinstance(k, tuple) and all(isinstance(d, int) for d in k))

    def _capture(self, fn, inputs: tuple):
        static_in = tuple(None if a is None else a.clone() for a in inputs)
        s = capture_stream()
        s.wait_stream(torch.cuda.current_stream())
        state = self._save_state()
        with torch.cuda.stream(s):
            for _ in range(self.warmup):  # warm-up outside the graph: lazy inits, autotuning, caches
                fn(*static_in)
        torch.cuda.current_stream().wait_stream(s)
        self._restore_state(state)  # the warm-ups ran this step already; its one real run is the replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_handle(), stream=s):
            out = fn(*static_in)
        return graph, static_in, out

    def _pool_handle(self):
        """The memory pool this cache's captures share (made on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def resize(self, max_graphs: int) -> None:
        """Keep at most `max_graphs` graphs from now on; the least recently used go first."""
        self.max_graphs = max_graphs
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)

    def clear(self) -> None:
        """Drop every graph and the memory pool they shared (a pool whose graphs are all gone cannot
        take new captures: PyTorch's allocator asserts on it)."""
        self.graphs.clear()
        self._pool = None

    def _save_state(self) -> object:
        """State that `fn` changes as it runs (none here; a step cache's buffers for the transformer)."""
        return None

    def _restore_state(self, state: object) -> None:
        pass

    def _replayed(self) -> None:
        """Host-side bookkeeping after a replay (a block streamer counts the copies the graph made)."""


class CudaGraphRunner(_GraphCache):
    """Call like the transformer; replays a captured graph when the inputs are on CUDA.

    `model`: a `runtime.contract.DenoisableTransformer`, whose block runner decides whether a forward
    may be captured and which variant it is; any other module called like one runs as one variant.
    `model.graph_tag` (optional, hashable) is part of every key too: state outside the inputs that
    changes what a forward computes (per-row LoRAs: how many adapters a row of this forward combines,
    0 when none uses one, `loading/lora_rows.py`)."""

    def __init__(self, model: torch.nn.Module, max_graphs: int = 8, warmup: int = 2):
        """`max_graphs`: a step cache uses up to 3 variants per CFG branch (first, full, cached)."""
        super().__init__(max_graphs, warmup)
        self.model = model
        self._epochs: dict = {}  # block runner -> the epoch of its buffers that its graphs were last keyed on

    def _describe(self, key: tuple) -> str:
        """x and text shapes, the model's graph tag and the step variant (the key's layout below)."""
        variant = key[-1]
        return f"x{key[0]} txt{key[1]} tag {key[-3]}" + ("" if variant is None else f" {variant[1]}")

    def _runner(self) -> BlockRunner | None:
        """The model's block runner now (configure may have swapped it since the last call)."""
        return self.model.block_runner if isinstance(self.model, OwnsBlockRunner) else None

    def _save_state(self) -> object:
        runner = self._runner()
        return None if runner is None else (runner, runner.snapshot())

    def drop_stale(self, runner: BlockRunner) -> int:
        """Drop the graphs captured against `runner`'s buffers before it reallocated them (its `epoch`
        moved on): their keys can never match again, and until the LRU reached them they held their
        static inputs and outputs (and the pool's blocks those pin). Returns how many went."""
        if self._epochs.get(runner, runner.epoch) == runner.epoch:
            self._epochs[runner] = runner.epoch
            return 0
        self._epochs[runner] = runner.epoch
        stale = [k for k in self.graphs if k[-1] is not None and k[-1][0] is runner and k[-2] != runner.epoch]
        for k in stale:
            del self.graphs[k]
        self.stale += len(stale)
        if not self.graphs:
            self.clear()  # (no graph left in the pool: the next capture needs a new one)
        return len(stale)

    def _restore_state(self, state: object) -> None:
        if state is not None:
            runner, snap = state
            runner.restore(snap)

    def _replayed(self) -> None:
        runner = self._runner()
        if runner is not None:
            runner.replayed()

    def __call__(
        self,
        x,
        txt,
        mask,
        t,
        img_shapes,
        additional_t_cond=None,
        step=None,
        shard=None,
        block_residuals=None,
        modulations=None,
    ):
        """`block_residuals` (ControlNet) and `modulations` (the modulation table's rows) are graph
        inputs like x: copied into the graph's static buffers on every replay, and their presence and
        shapes are part of the key (a graph captured without them is never replayed for them)."""
        runner = self._runner()
        res = None if block_residuals is None else tuple(block_residuals)
        mkw = {} if modulations is None else {"modulations": modulations}
        if not (self.enabled and x.is_cuda) or (
            runner is not None and not runner.can_graph(modulations is not None)
        ):
            return self.model(
                x,
                txt,
                mask,
                t,
                img_shapes,
                additional_t_cond,
                step=step,
                shard=shard,
                block_residuals=res,
                **mkw,
            )
        # one graph per block runner and variant: a runner whose steps compute different things (a step
        # cache's full and cached steps) gets a graph for each, and the runner itself is in the key (its
        # buffers are what the graph reads; the key keeps it alive), so switching step-cache presets
        # keeps every runner's graphs valid
        variant = (runner, runner.variant(step)) if runner is not None else None
        if runner is not None:
            runner.prepare(step, x.device)  # host-side step state: a replay runs no Python
            self.drop_stale(runner)
        key = (
            tuple(x.shape),
            tuple(txt.shape),
            mask is None,
            tuple(map(tuple, img_shapes)),
            x.dtype,
            str(x.device),
            additional_t_cond is None,
            shard,
            None if res is None else tuple((tuple(r.shape), r.dtype) for r in res),
            None if modulations is None else tuple(modulations.shape),
            getattr(self.model, "graph_tag", None),
            None if runner is None else runner.epoch,  # (reallocated buffers: older graphs go unused)
            variant,  # (last: tests and tools read it there)
        )

        def fn(
            x: torch.Tensor,
            txt: torch.Tensor,
            mask: torch.Tensor | None,
            t: torch.Tensor,
            extra: torch.Tensor | None,
            mods: torch.Tensor | None,
            *res: torch.Tensor,
        ) -> torch.Tensor:
            # a sequence-parallel shard's collectives (attention seam) are captured with the rest
            return self.model(
                x,
                txt,
                mask,
                t,
                img_shapes,
                extra,
                step=step,
                shard=shard,
                block_residuals=res or None,
                **({} if mods is None else {"modulations": mods}),
            )

        return self._run(key, fn, (x, txt, mask, t, additional_t_cond, modulations, *(res or ())))


class DecodeGraphs(_GraphCache):
    """CUDA graphs for one image's VAE decode (a server's `decode_per_image`), one per latent shape.

    Why: an eager decode allocates its working set (the decoder's full-resolution activations: 1.5 to
    3 GB at 1024² to 1328²) and frees it again, image after image; under a server's load those were the
    peaks of allocated memory. A replay allocates nothing but its output (its working memory is the
    pool's, taken once at capture), and skips the launch gaps. The pool is the transformer graphs'
    (`pool_of`): a decode never runs inside a forward (an interleaved batch decodes between two steps of
    the batch it paused), so the two never need their working memory at once. `vae` must offer
    `decode_untiled(z)`; a graph reads the weights where they were at capture: if any moved, every
    graph is dropped and recaptured."""

    what = "VAE decode CUDA graph"

    def __init__(
        self, vae: torch.nn.Module, pool_of: _GraphCache | None = None, max_graphs: int = 4, warmup: int = 1
    ):
        super().__init__(max_graphs, warmup)
        self.vae, self.pool_of = vae, pool_of
        self._where = None

    def _weights_at(self) -> tuple:
        return tuple(p.data_ptr() for p in self.vae.parameters())

    def _pool_handle(self):
        return self.pool_of._pool_handle() if self.pool_of is not None else super()._pool_handle()

    def clear(self) -> None:
        super().clear()
        if self.pool_of is not None and not self.pool_of.graphs:
            self.pool_of._pool = None  # (the shared pool held only these graphs: it goes with them)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """`vae.decode_untiled(z)` (1, z, h, w) -> (1, 3, 8h, 8w), replayed once captured."""
        where, captures = self._weights_at(), self.captures
        if where != self._where:
            self.clear()
        out = self._run(
            (tuple(z.shape), z.dtype, str(z.device), self.vae.fast), self.vae.decode_untiled, (z,)
        )
        # a capture's warm-up may lay the weights out anew (channels-last, once): read them again then only
        self._where = self._weights_at() if self.captures != captures else where
        return out


@contextlib.contextmanager
def final_norm_input(language_model: torch.nn.Module):
    """Inside: the language model's final norm returns its input, so its last hidden state is the last
    layer's output before that norm (what Qwen-Image-2.1's pipeline conditions on)."""
    hook = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        hook.remove()


class TextEncoderGraphs(_GraphCache):
    """CUDA graphs for the text-only prompt encode (Qwen2.5-VL's language model).

    Why: the 7B encoder reads 15 GB of weights (~3 ms on an H200) but launches ~700 small kernels
    from Python, ~20 ms eagerly: with 4-step LoRAs that is 5% of a whole 1024² image. Static shapes
    come from right-padding the token ids to a multiple of `bucket` tokens and dropping the padding
    mask: attention is causal, so a pad token (always after the real ones) never reaches a real one,
    and the real tokens' states are those of the masked call (the padded rows are cut off). One graph
    per (batch, bucket); capture failures fall back to eager once, with a warning.
    """

    what = "text encoder CUDA graph"

    def __init__(
        self,
        language_model: torch.nn.Module,
        pad_id: int,
        bucket: int = 64,
        max_graphs: int = 8,
        warmup: int = 2,
        pre_norm: bool = False,
    ):
        super().__init__(max_graphs, warmup)
        self.lm = language_model
        self.pad_id = pad_id
        self.bucket = bucket
        self.pre_norm = (
            pre_norm  # the last layer's output before the final norm (Qwen-Image-2.1's conditioning)
        )
        self._where = None

    def padded(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) right-padded ids + mask (on ids' device or the host) -> (B, T_bucket) ids with pad
        tokens after the real ones."""
        B, T = ids.shape
        Tb = -(-T // self.bucket) * self.bucket
        out = torch.full((B, Tb), self.pad_id, dtype=ids.dtype, device=ids.device)
        out[:, :T] = torch.where(mask.to(ids.device).bool(), ids, self.pad_id)
        return out

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.pre_norm:
            return self.lm(input_ids=ids, use_cache=False).last_hidden_state
        with final_norm_input(self.lm):
            return self.lm(input_ids=ids, use_cache=False).last_hidden_state

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states (B, T, D) of right-padded `ids` (B, T); rows past each mask are garbage.
        A host `mask` (the tokenizer's) keeps the call free of device syncs: the right-padding check
        then reads it where it is."""
        if bool((mask[:, :-1] < mask[:, 1:]).any()):
            raise ValueError("TextEncoderGraphs needs right-padded ids (real tokens first)")
        T = ids.shape[1]
        x = self.padded(ids, mask)
        if not (self.enabled and x.is_cuda):
            return self.eager(x)[:, :T]
        # a graph reads the weights where they were at capture: if any moved (offload, .to(), a new
        # load), every graph is stale
        where = tuple(t.data_ptr() for t in self.lm.parameters())
        if where != self._where:
            self.graphs.clear()
            self._where = where
        return self._run((tuple(x.shape), str(x.device)), self.eager, (x,))[:, :T]


def compile_blocks(model: BlockModel, **kwargs: Any) -> BlockModel:  # kwargs: torch.compile's
    """Regional compilation: compile each transformer block in place (one compile, reused by all 60
    identical blocks), which is how diffusers' `compile_repeated_blocks` works and far faster to
    compile than the whole model."""
    kwargs.setdefault("fullgraph", True)
    kwargs.setdefault("dynamic", False)
    for block in model.blocks:
        block.compile(**kwargs)
    return model
