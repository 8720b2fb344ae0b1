"""Offload modes for GPUs smaller than the model: `none | model | blocks`.

- `model`: the text encoder (16.6 GB for Qwen2.5-VL-7B in bf16) lives in pinned host memory. Its 28
  decoder layers (80% of it) stream through a ring of 2 layer buffers while prompts are encoded, the
  same way the transformer's blocks do in `blocks`; the rest (embeddings, LM head, vision tower) is
  copied in for the encode (`ModelOffloader.on_device`). So the GPU never holds more than ~4 GB of
  the encoder next to the transformer (a whole copy would put the peak back at both models).
  Optionally the VAE likewise. The weights never change, so "moving back" is dropping the GPU copy:
  no D2H traffic.
- `blocks`: `model`, plus the transformer blocks (340 M parameters, 680 MB each in bf16) stream from
  pinned host memory. A ring of `ring` (default 2) flat GPU buffers holds the blocks in use: while
  block i computes on the current stream, block i+1 is copied into the next ring slot on a side
  CUDA stream. CUDA events order it: the compute stream waits for "block i copied" before block i
  runs, and the copy stream waits for "block i-1 finished" before it overwrites that slot. The last
  block prefetches block 0 for the next step. Everything outside the blocks (embeddings, norm_out,
  proj_out: ~0.2% of the weights) stays on the GPU. Streaming is PCIe-bound (a forward moves all
  41 GB of weights); it trades speed for fitting: 1024² in 5.7 GiB on an H200.

CUDA graphs (`fence`, `capture`, `replayed`): a forward may be captured with its block copies in it
(memcpy nodes from the pinned host buffers into the ring slots, ordered by the same events), so that a
streamed forward replays with one launch instead of ~2,000 from Python. The ring slots keep their
addresses, so the graph is valid for as long as the streamer lives. A captured forward starts from
empty shared slots (`fence`: the eager ring's state is unknown to a replay) and does not prefetch
block 0 for the next forward; a block alone in its slot is copied once, outside the graph, and kept.

Parameters are re-pointed (`p.data = view`) at host or ring views; a block's tensors point at the
host copy between uses. On CPU the same code runs with plain copies and no streams/events (tests).
LoRA changes and FP8 must happen before offloading (the fused weights are what is copied).

Nothing here replaces a method or touches a pipeline: the transformer's blocks are streamed by a
block runner (`runtime.blocks.StreamingBlockRunner`) that calls `before(i)` / `after(i)`; the text
encoder's decoder layers (a transformers model, whose loop we do not own) through forward hooks;
the pipeline decides which parts to offload (`pipeline/placement.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["ModelOffloader", "BlockStreamer", "offload_module", "spread"]  # the modes: options.OFFLOAD

ALIGN = 256  # bytes: every tensor view in a flat buffer starts aligned (vectorised kernels need 16)


def _tensors(module: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """Every (owner module, name, is_parameter) of `module`, tied tensors once."""
    seen, out = set(), []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((m, name, True))
        for name, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append((m, name, False))
    return out


def _get(owner: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    return owner._parameters[name] if is_param else owner._buffers[name]


def _point(owner: nn.Module, name: str, is_param: bool, t: torch.Tensor) -> None:
    """Make the parameter / buffer use storage `t` (same shape and dtype), keeping the Parameter object."""
    if is_param:
        owner._parameters[name].data = t
    else:
        owner._buffers[name] = t


def _pin(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return t.pin_memory() if pin else t


class ModelOffloader:
    """A module whose weights stay in (pinned) host memory except inside `with offloader.on_device():`."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str,
        pin: bool | None = None,
        skip: nn.Module | None = None,
    ):
        """`skip`: a submodule whose tensors are handled elsewhere (a `BlockStreamer`'s blocks)."""
        self.module = module
        self.device = torch.device(device)
        pin = self.device.type == "cuda" if pin is None else pin
        self.entries = []  # (owner, name, is_param, host tensor, qualified name)
        skipped = {id(_get(*t)) for t in _tensors(skip)} if skip is not None else set()
        path = {id(m): n for n, m in module.named_modules()}
        for owner, name, is_param in _tensors(module):
            if id(_get(owner, name, is_param)) in skipped:
                continue
            host = _pin(_get(owner, name, is_param).detach().to("cpu"), pin)
            _point(owner, name, is_param, host)
            self.entries.append(
                (owner, name, is_param, host, f"{path.get(id(owner), '')}.{name}".lstrip("."))
            )
        self.depth = 0
        self.bytes_in = 0  # host -> device bytes copied so far (stats: `qwenfast bench tiers`)

    @contextmanager
    def on_device(self, leave: tuple[str, ...] = ()) -> Iterator[nn.Module]:
        """Weights on the device for the duration (re-entrant); the device copies are dropped after.
        `leave`: name prefixes of tensors this use does not need (a text-only encode leaves the LM head
        and the vision tower, 2.4 GB of Qwen2.5-VL-7B, on the host); taken from the outermost use."""
        if self.depth == 0:
            for owner, name, is_param, host, qual in self.entries:
                if not qual.startswith(leave) or not leave:
                    _point(owner, name, is_param, host.to(self.device, non_blocking=True))
                    self.bytes_in += host.numel() * host.element_size()
        self.depth += 1
        try:
            yield self.module
        finally:
            self.depth -= 1
            if self.depth == 0:
                for owner, name, is_param, host, _ in self.entries:
                    _point(owner, name, is_param, host)


class BlockStreamer:
    """Streams `blocks` (an nn.ModuleList) through a ring of device buffers; see the module docstring."""

    def __init__(
        self,
        blocks: nn.ModuleList,
        device: torch.device | str,
        ring: int = 2,
        pin: bool | None = None,
        hooks: bool = True,
        resident: Collection[int] = (),
        on_host: Collection[nn.Module] = (),
    ):
        """`hooks`: bring each block in through forward hooks on the block modules (for models whose
        loop we do not own, e.g. the text encoder's decoder layers); False when a block runner
        (`runtime.blocks.StreamingBlockRunner`) calls `before(i)` / `after(i)` itself.
        `resident`: indices of blocks that stay on the device (a memory budget's worth, chosen by
        `resident_blocks`); only the others stream, and each one's copy overlaps the compute of
        the resident blocks before it.
        `on_host`: parts of the blocks (the modulation Linears, which the modulation table serves)
        that neither stream nor stay resident: they live in (pinned) host memory and `bring(...)`
        puts them on the device for a moment when something needs them."""
        if ring < 2:
            raise ValueError("the block ring needs at least 2 slots (one computing, one loading)")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda if pin is None else pin
        self.blocks = list(blocks)
        self.resident = frozenset(i for i in resident if 0 <= i < len(self.blocks))
        for i in sorted(self.resident):
            self.blocks[i].to(self.device)
        held = [t for m in on_host for t in _tensors(m)]
        for owner, name, is_param in held:  # to host memory (once: tied tensors are listed once per module)
            t = _get(owner, name, is_param)
            if not (t.device.type == "cpu" and (t.is_pinned() or not pin)):
                _point(owner, name, is_param, _pin(t.detach().to("cpu"), pin))
        self.held = {id(_get(*t)) for t in held}
        self.order = [i for i in range(len(self.blocks)) if i not in self.resident]  # the streamed blocks
        self.pos = {b: k for k, b in enumerate(self.order)}  # block -> its place in the stream
        self.ring = min(ring, len(self.order))
        self.layout = []  # per block: [(owner, name, is_param, offset, nbytes, dtype, shape)]
        self.host = []  # per block: flat uint8 (pinned) buffer
        self.host_views = []  # per block: the tensors' views into `host`
        for b, block in enumerate(self.blocks):
            if b in self.resident:
                self.layout.append([])
                self.host.append(torch.empty(0, dtype=torch.uint8))
                self.host_views.append([])
                continue
            items, off = [], 0
            for owner, name, is_param in _tensors(block):
                t = _get(owner, name, is_param)
                if id(t) in self.held:
                    continue
                n = t.numel() * t.element_size()
                items.append((owner, name, is_param, off, n, t.dtype, tuple(t.shape)))
                off += -(-n // ALIGN) * ALIGN
            flat = _pin(torch.empty(off, dtype=torch.uint8), pin)
            views = []
            for owner, name, is_param, o, n, dt, shape in items:
                v = flat[o : o + n].view(dt).view(shape)
                v.copy_(_get(owner, name, is_param).detach())
                _point(owner, name, is_param, v)
                views.append(v)
            self.layout.append(items)
            self.host.append(flat)
            self.host_views.append(views)
        slot_bytes = max((h.numel() for h in self.host), default=0)
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.ring)
        ]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: list = [None] * len(self.blocks)  # event: block i is in its slot
        self.freed: list = [None] * self.ring  # event: the last block computed from this slot is done
        self.in_slot: list = [None] * self.ring  # which block each slot holds
        self.copies = 0  # host->device block copies issued (tests, stats)
        self.bytes_in = 0  # host->device bytes copied (blocks and `bring`s; stats)
        self.active: int | None = None  # the block computing now
        self.cyclic = True  # the last streamed block prefetches the first for the next forward
        self._handles = []
        if hooks:  # PyTorch's own seam; always_call: the block is released even when it raises
            for i, block in enumerate(self.blocks):
                self._handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self.before(i)))
                self._handles.append(
                    block.register_forward_hook(lambda m, a, o, i=i: self.after(i), always_call=True)
                )

    def _next_streamed(self, i: int) -> int | None:
        """The first streamed block after block i (cyclic: the last one prefetches for the next step,
        unless a forward is being captured: a graph holds one forward's copies, no more)."""
        if not self.order:
            return None
        return next((b for b in self.order if b > i), self.order[0] if self.cyclic else None)

    def _shared(self, slot: int) -> bool:
        """Whether several streamed blocks take turns in `slot` (a slot of one keeps its block)."""
        return len(range(slot, len(self.order), self.ring)) > 1

    def fence(self) -> None:
        """Before a forward that is captured or replayed as a CUDA graph, and after a replay: copies in
        flight finish first (the current stream waits for the copy stream), and the shared slots count
        as empty, to be overwritten once the current stream's work before this point is done. Inside a
        capture it is the graph's fork instead: the copy stream joins the capture here (an event of
        work outside the capture cannot be waited on inside it)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            capturing = torch.cuda.is_current_stream_capturing()
            if not capturing:
                cur.wait_stream(self.stream)
            ev = torch.cuda.Event()
            ev.record(cur)
            if capturing:
                self.stream.wait_event(ev)
            self.freed = [ev] * len(self.freed)
        self.ready = [None] * len(self.blocks)  # (fenced: whatever the slots hold is there)
        self.in_slot = [b if not self._shared(k) else None for k, b in enumerate(self.in_slot)]

    def graph_bytes(self) -> int:
        """Bytes one captured forward copies: every block of a shared slot, once."""
        return sum(self.host[b].numel() for k, b in enumerate(self.order) if self._shared(k % self.ring))

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Around a forward being captured in a CUDA graph (`fence` first, outside the capture): the
        copy stream forked at the start and joined at the end, no prefetch for the next forward, and
        nothing counted (a capture copies nothing: `replayed` counts each replay)."""
        counts = (self.copies, self.bytes_in)
        self.fence()
        self.cyclic = False
        try:
            yield
        finally:
            self.cyclic = True
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)  # the join
            self.copies, self.bytes_in = counts

    def replayed(self) -> None:
        """After a captured forward replayed: count its copies; the eager ring state is fenced again."""
        self.copies += sum(1 for k in range(len(self.order)) if self._shared(k % self.ring))
        self.bytes_in += self.graph_bytes()
        self.fence()

    def prefetch(self, i: int) -> None:
        """Start copying block i into its ring slot (side stream on CUDA), unless it is there already."""
        if i in self.resident:
            return
        slot = self.pos[i] % self.ring
        busy = (
            self.active is not None
            and self.active not in self.resident
            and self.pos[self.active] % self.ring == slot
        )
        if self.in_slot[slot] == i or busy:
            return  # there already, or the slot is computing (odd block counts): before(i) loads it later
        dst = self.slots[slot][: self.host[i].numel()]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if self.freed[slot] is not None:
                    self.stream.wait_event(self.freed[slot])  # don't overwrite a block still computing
                dst.copy_(self.host[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self.ready[i] = ev
        else:
            dst.copy_(self.host[i])
        self.in_slot[slot] = i
        self.copies += 1
        self.bytes_in += self.host[i].numel()

    def before(self, i: int) -> None:
        if i in self.resident:  # on the device already; meanwhile the next streamed block comes in
            nxt = self._next_streamed(i)
            if nxt is not None:
                self.prefetch(nxt)
            return
        slot = self.pos[i] % self.ring
        self.prefetch(i)  # no-op when prefetched earlier
        if self.cuda and self.ready[i] is not None:  # (None: copied before a fence)
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])
        base = self.slots[slot]
        for owner, name, is_param, o, n, dt, shape in self.layout[i]:
            _point(owner, name, is_param, base[o : o + n].view(dt).view(shape))
        self.active = i
        nxt = self._next_streamed(i)
        if nxt is not None:
            self.prefetch(nxt)  # overlaps block i's compute (and the resident ones after it)

    def after(self, i: int) -> None:
        if i in self.resident:
            return
        self.active = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.freed[self.pos[i] % self.ring] = ev
        for (owner, name, is_param, *_), v in zip(self.layout[i], self.host_views[i]):
            _point(owner, name, is_param, v)

    def set_resident(self, indices: Collection[int]) -> None:
        """Change which blocks stay on the device (a re-planned budget: the text encoder's layers get
        what the transformer left). Every block keeps its host copy, so a block may go back to
        streaming; blocks made resident at construction have none and must stay resident."""
        want = frozenset(i for i in indices if 0 <= i < len(self.blocks))
        stuck = sorted(i for i in self.resident - want if not self.layout[i])
        if stuck:
            raise ValueError(
                f"blocks {stuck} were resident from the start (no host copy): they cannot stream"
            )
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy in flight into a slot whose owner changes
        for i in sorted(want - self.resident):
            for (owner, name, is_param, *_), v in zip(self.layout[i], self.host_views[i]):
                _point(owner, name, is_param, v.to(self.device))
        for i in sorted(self.resident - want):
            for (owner, name, is_param, *_), v in zip(self.layout[i], self.host_views[i]):
                _point(owner, name, is_param, v)
        self.resident = want
        self.order = [i for i in range(len(self.blocks)) if i not in want]
        self.pos = {b: k for k, b in enumerate(self.order)}
        self.ready = [None] * len(self.blocks)
        self.freed = [None] * len(self.slots)
        self.in_slot = [None] * len(self.slots)
        self.ring = min(len(self.slots), len(self.order))

    @contextmanager
    def bring(self, *modules: nn.Module) -> Iterator[None]:
        """`modules`' tensors that are not on the device are copied in for the duration (from pinned
        memory, asynchronously on the compute stream) and dropped after: the `on_host` parts."""
        moved = []
        for m in modules:
            for owner, name, is_param in _tensors(m):
                t = _get(owner, name, is_param)
                if t.device.type != self.device.type:  # one GPU per process: the type says where
                    moved.append(
                        (owner, name, is_param, t.data if is_param else t)
                    )  # (not the Parameter itself)
                    _point(owner, name, is_param, t.to(self.device, non_blocking=True))
                    self.bytes_in += t.numel() * t.element_size()
        try:
            yield
        finally:
            for owner, name, is_param, t in moved:
                _point(owner, name, is_param, t)

    def device_bytes(self) -> int:
        """The ring's buffers plus the resident blocks."""
        res = sum(
            t.numel() * t.element_size()
            for i in self.resident
            for t in (*self.blocks[i].parameters(), *self.blocks[i].buffers())
            if id(t) not in self.held
        )
        return sum(s.numel() for s in self.slots) + res


def spread(n: int, k: int) -> list[int]:
    """k of n block indices, evenly spaced (the streamed ones: each copy overlaps the resident blocks
    between two streamed ones, instead of all copies queueing at one end of the stack)."""
    if k <= 0:
        return []
    k = min(k, n)
    return sorted({min(n - 1, int((j + 0.5) * n / k)) for j in range(k)})


def offload_module(
    module: nn.Module, device: torch.device | str, layers: nn.ModuleList | None = None, ring: int = 2
) -> tuple[ModelOffloader, BlockStreamer | None]:
    """Move `module` to pinned host memory: `layers` (if given) stream through a ring while it runs
    (hooks on each layer), the rest is copied in by the returned offloader's `on_device()`."""
    streamer = (
        BlockStreamer(layers, device, ring=ring, hooks=True) if layers is not None and len(layers) else None
    )
    return ModelOffloader(module, device, skip=layers if streamer is not None else None), streamer
