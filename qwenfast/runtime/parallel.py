"""Several GPUs for one image: CFG-parallel and Ulysses sequence parallel (torch.distributed).

Layout: world = cfg x ulysses ranks, rank = cfg_rank * ulysses + sp_rank.
- CFG-parallel (cfg=2): the denoise core runs true CFG as one batched forward of [cond; uncond];
  cfg rank 0 computes the cond half, rank 1 the uncond half, and one all-gather per step gives both
  ranks both predictions, so they step the same latents.
- Ulysses (ulysses=G): the image tokens (noise and reference latents) are split over the G ranks of
  a sequence group in contiguous chunks (uneven sizes allowed: 6889 tokens over 2 ranks is 3445 +
  3444); the text tokens are replicated (a few hundred tokens: cheaper to recompute than to move).
  Around the unchanged attention kernel (the `wrap_attention` seam) an all-to-all turns (all heads,
  my tokens) into (H/G heads, all tokens) and back; the text part needs no exchange on the way in and
  one all-gather of heads on the way out. Chunks are padded to the largest for the all-to-all (equal
  sizes: NCCL and gloo both take them) and the padding is dropped before the attention, so no mask
  is added and the result is exactly the one-device attention.
  Two transports do that exchange (`QWENFAST_ULYSSES_EXCHANGE`): "peer" (the default on CUDA: direct
  writes into the other GPUs' buffers, runtime/ulysses_peer.py) and "collective" (NCCL / gloo
  all-to-alls, below; the default on CPU). Both give the same numbers bit for bit.

Every rank holds the whole model, draws the same noise from the same seed, encodes the prompt and
decodes the image itself (rank 0 keeps it). Token-independent work that is large is split instead of
repeated: the blocks' modulation GEMVs (`split_over_ranks`). CPU processes over gloo run the same code (tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..options import ParallelConfig  # the layout is an option value
from .attention import RowTrim, wrap_attention
from .blocks import StepContext
from .ulysses_peer import PeerUlyssesAttention, exchange_choice

__all__ = [
    "ParallelConfig",
    "ParallelGroups",
    "ParallelForward",
    "split_sizes",
    "split_over_ranks",
    "UlyssesAttention",
]


def split_sizes(n: int, parts: int) -> list[int]:
    """Contiguous chunk sizes of n tokens over `parts` ranks: the first n % parts get one more."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class ParallelGroups:
    """This process's place in the layout, and its two process groups (from torch.distributed)."""

    def __init__(self, config: ParallelConfig, exchange: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError(
                f"parallel {config} needs torch.distributed: start it with `qwenfast generate "
                f"--parallel {config}` (one process per GPU) or under torchrun"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != config.world:
            raise RuntimeError(f"parallel {config} needs {config.world} processes, this run has {world}")
        self.config, self.rank, self.world = config, rank, world
        G = config.ulysses
        self.cfg_rank, self.sp_rank = divmod(rank, G)
        self.sp_size = G
        # every process creates every group, in the same order (torch.distributed's rule)
        self.sp_group = self.cfg_group = None
        for c in range(config.cfg):
            ranks = [c * G + i for i in range(G)]
            g = dist.new_group(ranks)
            if rank in ranks:
                self.sp_group = g
        for i in range(G):
            ranks = [c * G + i for c in range(config.cfg)]
            g = dist.new_group(ranks)
            if rank in ranks:
                self.cfg_group = g
        self.plans: dict = {}  # the peer exchange's buffers per call shape (runtime/ulysses_peer.py)
        self._want, self._exchange = exchange, {}  # exchange: see `exchange()`; None = the environment's

    def exchange(self, device: torch.device) -> str:
        """The Ulysses exchange on `device` ("peer" | "collective"), chosen once per device (the
        choice reads the environment and asks the driver about P2P: not per forward)."""
        key = str(device)
        if key not in self._exchange:
            self._exchange[key] = exchange_choice(device, self._want)
        return self._exchange[key]


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class UlyssesAttention:
    """The attention wrapper of one forward: q, k, v (B, H, Lt + n_mine, D) -> the same, attention
    computed over every rank's tokens (see the module docstring).

    Pipelined over `chunks` sub-groups of this rank's heads: every chunk's q/k/v all-to-all is issued
    at once (asynchronously, on the communicator's stream), then chunk c's attention runs while chunk
    c+1's exchange is still in flight, and chunk c's output all-to-all runs while chunk c+1 attends.
    chunks = 1 is the plain exchange -> attention -> exchange, and the default: on nvidia-h200-x2 the
    forward at 1024² took 88.4 ms with 1 chunk, 90.6 with 2, 93.0 with 4 (1328²: 162.3 / 162.6 /
    173.2), so the exchanges are not waiting on attention (`QWENFAST_ULYSSES_CHUNKS` sets it).
    """

    def __init__(self, groups: ParallelGroups, sizes: list[int], txt_len: int, chunks: int | None = None):
        self.g, self.sizes, self.txt_len = groups, sizes, txt_len
        self.chunks = chunks if chunks is not None else int(os.environ.get("QWENFAST_ULYSSES_CHUNKS", "1"))

    def __call__(
        self, inner: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        G, r, Lt = self.g.sp_size, self.g.sp_rank, self.txt_len
        B, H, _, D = q.shape
        if H % G:
            raise ValueError(f"ulysses={G} needs a head count divisible by {G}; this model has {H} heads")
        h = H // G
        c = max(1, min(self.chunks, h))
        while h % c:
            c -= 1
        hc = h // c
        if mask is not None:  # (B, 1, 1, Lt + n_mine): the text part is replicated, image keys are real
            ones = mask.new_ones(B, 1, 1, sum(self.sizes))
            mask = torch.cat([mask[..., :Lt], ones], dim=-1)
        img = [x[:, :, Lt:] for x in (q, k, v)]
        inbound = [self._send_seq(img, ci, c, hc) for ci in range(c)]  # all exchanges in flight at once
        o_txt, outbound = [], []
        for ci, (work, recv) in enumerate(inbound):
            work.wait()
            mine = slice(r * h + ci * hc, r * h + (ci + 1) * hc)
            full = [
                torch.cat(
                    [
                        x[:, mine, :Lt],
                        torch.cat([recv[j, i, :, :, : self.sizes[j]] for j in range(G)], dim=2),
                    ],
                    dim=2,
                )
                for i, x in enumerate((q, k, v))
            ]
            o = inner(*full, mask)  # (B, hc, Lt + N, D)
            o_txt.append(o[:, :, :Lt])
            outbound.append(self._return_seq(o[:, :, Lt:], hc))
        o_txt = torch.cat(_all_gather(torch.cat(o_txt, dim=1), self.g.sp_group, G), dim=1)  # (B, H, Lt, D)
        n = self.sizes[r]
        got = []
        for work, recv in outbound:
            work.wait()
            got.append(recv[:, :, :, :n])  # (G, B, hc, n_mine, D): chunk ci of head group j, from rank j
        o_img = torch.stack(got, dim=1).permute(2, 0, 1, 3, 4, 5).reshape(B, H, n, D)  # heads: j, ci, hc
        return torch.cat([o_txt, o_img], dim=2)

    def _send_seq(self, xs: list[torch.Tensor], ci: int, c: int, hc: int):
        """[(B, H, n_mine, D)] * k -> async all-to-all; received (G, k, B, hc, m, D): head chunk ci of my
        head group, from every rank's tokens (padded to the longest rank's count m)."""
        G, sizes = self.g.sp_size, self.sizes
        B, H, n, D = xs[0].shape
        m, k = max(sizes), len(xs)
        send = xs[0].new_zeros(G, k, B, hc, m, D) if n < m else xs[0].new_empty(G, k, B, hc, m, D)
        for i, x in enumerate(xs):  # chunk j (head chunk ci of group j, my tokens) -> rank j
            send[:, i, :, :, :n] = x.reshape(B, G, c, hc, n, D)[:, :, ci].transpose(0, 1)
        recv = torch.empty_like(send)
        return dist.all_to_all_single(recv, send, group=self.g.sp_group, async_op=True), recv

    def _return_seq(self, o: torch.Tensor, hc: int):
        """(B, hc, N, D) -> async all-to-all sending rank j its tokens' part; received (G, B, hc, m, D)."""
        sizes = self.sizes
        B, _, N, D = o.shape
        m = max(sizes)
        send = (
            o.new_zeros(len(sizes), B, hc, m, D) if min(sizes) < m else o.new_empty(len(sizes), B, hc, m, D)
        )
        s = 0
        for j, n in enumerate(sizes):
            send[j, :, :, :n] = o[:, :, s : s + n]
            s += n
        recv = torch.empty_like(send)
        return dist.all_to_all_single(recv, send, group=self.g.sp_group, async_op=True), recv


_sharing: list[ParallelGroups] = []  # the sequence group of the forward running now (see `split_over_ranks`)


def split_over_ranks(n: int, fn: Callable[[int], torch.Tensor]) -> list[torch.Tensor] | None:
    """[fn(0), ..., fn(n-1)] (tensors of one shape), each computed by one rank of the sequence group
    of the forward running now (item i on rank i % G) and gathered to every rank; None outside such a
    forward (the caller computes them itself).

    Why: work that does not depend on the tokens is replicated on every Ulysses rank. The blocks'
    modulation GEMVs (2 x 60 x 3072 x 18432 weights, 13.6 GB read per forward, ~3.8 ms on an H200)
    are the largest such part: split, each rank reads half, and one all-gather of 60 x (3B, 18432)
    values (4.4 MB at B = 1) replaces the other half. The values are those of each block's own call."""
    if not _sharing:
        return None
    g = _sharing[-1]
    G, r = g.sp_size, g.sp_rank
    mine = [fn(i) for i in range(r, n, G)] or [fn(0)]  # (a rank past n: a placeholder nobody reads)
    per = -(-n // G)
    stack = torch.stack(mine + [torch.zeros_like(mine[0])] * (per - len(mine)))  # (per, ...)
    parts = _all_gather(stack, g.sp_group, G)
    return [parts[i % G][i // G] for i in range(n)]


class ParallelForward:
    """Wraps the denoise core's forward `fn(x, emb, mask, t, img_shapes, step, shard=)` for a layout."""

    def __init__(self, fn: Callable[..., torch.Tensor], groups: ParallelGroups):
        self.fn, self.g = fn, groups
        self._trim = RowTrim()  # each cfg rank's rows of the batched text, trimmed once per mask

    def __call__(
        self,
        x: torch.Tensor,
        emb: torch.Tensor,
        mask: torch.Tensor | None,
        t: torch.Tensor,
        img_shapes: list,
        step: StepContext | None = None,
    ) -> torch.Tensor:
        g = self.g
        if g.config.cfg == 2:
            if step is None or step.branch != "both":
                raise RuntimeError(
                    "cfg=2 runs the cond and uncond passes of one batched CFG forward; this call "
                    "has no CFG (use ulysses alone, or true_cfg_scale > 1 with a negative prompt)"
                )
            half = x.shape[0] // 2
            rows = slice(0, half) if g.cfg_rank == 0 else slice(half, None)
            e, m = self._trim(emb, mask, rows)
            branch = "cond" if g.cfg_rank == 0 else "uncond"
            step = StepContext(step.step, step.steps, step.sigma, branch)
            out = self._sequence(x[rows], e, m, t[rows], img_shapes, step)
            return torch.cat(_all_gather(out, g.cfg_group, 2), dim=0)
        return self._sequence(x, emb, mask, t, img_shapes, step)

    def _sequence(self, x, emb, mask, t, img_shapes, step) -> torch.Tensor:
        g = self.g
        G = g.sp_size
        if G == 1:
            return self.fn(x, emb, mask, t, img_shapes, step)
        N = x.shape[1]
        sizes = split_sizes(N, G)
        start = sum(sizes[: g.sp_rank])
        n = sizes[g.sp_rank]
        if g.exchange(x.device) == "peer":
            wrapper = PeerUlyssesAttention(g, sizes, emb.shape[1], g.plans)
        else:
            wrapper = UlyssesAttention(g, sizes, emb.shape[1])
        _sharing.append(g)
        try:
            with wrap_attention(wrapper):
                out = self.fn(
                    x[:, start : start + n], emb, mask, t, img_shapes, step, shard=(start, start + n)
                )
        finally:
            _sharing.remove(g)
        m = max(sizes)
        if n < m:
            out = torch.cat([out, out.new_zeros(out.shape[0], m - n, out.shape[2])], dim=1)
        parts = _all_gather(out, g.sp_group, G)
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes)], dim=1)
