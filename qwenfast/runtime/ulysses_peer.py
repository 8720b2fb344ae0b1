"""Ulysses over peer memory: the all-to-alls of `parallel.UlyssesAttention` done as direct writes
into the other ranks' buffers, already in the layout attention reads.

Why: the collective exchange measured 28 ms of overhead per 1024² forward on 2 H200s (88.4 ms vs
the 61 ms a perfect split of 122.5 ms would give). NCCL's all-to-alls were ~11.5 ms of it (192 µs
per layer for 52 MB, while the 26 MB that actually cross NVLink need ~85 µs); the rest was the
copies around them: packing a padded send buffer, `torch.cat` of text and received chunks, the
permute of the output, and an all-gather for the text heads.

Here, per attention call, on rank r of G (h = H/G heads per rank, tokens: text Lt replicated, image
split in contiguous chunks n_j starting at s_j; S = Lt + sum n_j):
1. Q, K, V go into place: my text rows of my heads into my IN buffer (3, B, S, h, D), and for every
   rank j my image rows of j's heads into j's IN at tokens Lt + s_r; barrier. Blocks that go through
   `attention.joint_attention` (Qwen-Image's fused path) get this from the QK-norm + RoPE kernel
   itself, one launch over every head group, each program writing straight into its rank's memory;
   a plain `attention()` call gets it from one `kernels/head_scatter` launch over its Q, K, V.
2. attention on IN (my h heads, every token): the same attention kernel as one GPU, no mask added.
3. one kernel writes the output back: for every rank j, the text rows and j's image rows of my
   heads into j's OUT buffer (B, Lt + n_j, H, D) at heads r*h; barrier.
   (Measured and dropped: attention by query chunk with each chunk's rows written on a side stream
   while the next chunk attends: 74.6 vs 70.9 ms per 1024² forward on 2 H200s; the writes take SMs
   from the attention and the chunks' calls are less efficient than one.)
4. OUT is returned as (B, H, Lt + n_r, D) over (B, Lt + n_r, H, D) memory, the layout the out
   projections read: as is to `joint_attention` (its caller consumes it before the next call), as a
   copy to a plain `attention()` call (whose caller may hold several results, e.g. 2.1's blocks).

Why one IN and one OUT buffer are enough (no double buffering): rank r writes IN for call i+1 only
after the barrier of step 3 of call i, which every rank passes only after its own attention of
call i (stream order); it writes OUT for call i+1 after the barrier of step 1 of call i+1, which
every rank reaches only after it has read call i's OUT (step 4's copy, or the `joint_attention`
caller's out projections, which run before its next call).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..kernels.head_scatter import entry, head_scatter
from ..kernels.qk_norm_rope import group_row, qk_norm_rope, qk_norm_rope_groups
from .peer_memory import PeerBuffer, peer_memory_available

__all__ = ["PeerUlyssesAttention", "exchange_choice", "EXCHANGES"]

EXCHANGES = ("auto", "peer", "collective")


def exchange_choice(device: torch.device, want: str | None = None) -> str:
    """`want`, else `QWENFAST_ULYSSES_EXCHANGE`: "peer", "collective", or "auto" (peer on CUDA where
    every GPU reaches the others over P2P; collective on CPU, where the gloo tests force each in turn)."""
    want = (want or os.environ.get("QWENFAST_ULYSSES_EXCHANGE", "auto")).strip().lower()
    if want not in EXCHANGES:
        raise ValueError(f"QWENFAST_ULYSSES_EXCHANGE must be one of {EXCHANGES}, got {want!r}")
    if want == "auto":
        return "peer" if device.type == "cuda" and peer_memory_available(device) else "collective"
    if want == "peer" and not peer_memory_available(device):
        raise RuntimeError(f"QWENFAST_ULYSSES_EXCHANGE=peer, but {device} cannot reach its peers' memory")
    return want


class _Plan:
    """The buffers and copy tables of one call shape, kept for the life of the process (captured CUDA
    graphs write into them): at 1024², B = 1, 2 ranks, IN is 39 MB and OUT 13 MB per rank, so a
    server that sees many sizes holds that much per size."""

    def __init__(
        self,
        group,
        rank: int,
        G: int,
        B: int,
        H: int,
        D: int,
        Lt: int,
        sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ):
        h, S, m = H // G, Lt + sum(sizes), max(sizes)
        starts = [sum(sizes[:j]) for j in range(G)]
        self.IN = PeerBuffer(group, 3 * B * S * h * D, dtype, device)
        self.OUT = PeerBuffer(group, B * (Lt + m) * H * D, dtype, device)
        ins = [self.IN.view(j, (3, B, S, h, D)) for j in range(G)]
        outs = [self.OUT.view(j, (1, B, Lt + sizes[j], H, D)) for j in range(G)]
        n, s = sizes[rank], starts[rank]
        self.in_rows = [entry(ins[rank], src_t0=0, src_h0=rank * h, dst_t0=0, count=Lt)]  # my text, my heads
        self.in_rows += [entry(ins[j], src_t0=Lt, src_h0=j * h, dst_t0=Lt + s, count=n) for j in range(G)]
        self.in_dsts = [ins[rank]] + ins
        self.out_rows, self.out_dsts = [], []
        for j in range(G):  # the text rows and j's image rows of my heads -> j, at heads rank*h
            self.out_rows += [
                entry(outs[j], src_t0=0, src_h0=0, dst_t0=0, count=Lt, dst_h0=rank * h),
                entry(outs[j], src_t0=Lt + starts[j], src_h0=0, dst_t0=Lt, count=sizes[j], dst_h0=rank * h),
            ]
            self.out_dsts += [outs[j], outs[j]]
        self.in_table = torch.tensor(self.in_rows, dtype=torch.int64, device=device)
        self.out_table = torch.tensor(self.out_rows, dtype=torch.int64, device=device)
        self.qkv = [
            tuple(x[c].transpose(1, 2) for c in range(3)) for x in ins
        ]  # rank j's q, k, v (B, h, S, D)
        self.q, self.k, self.v = self.qkv[rank]
        # `joint`: the image rows' head groups, rank j's into rank j's IN, in one QK-norm + RoPE launch
        self.img_groups = [(*self.qkv[j], j * h) for j in range(G)]
        self.img_table = torch.tensor(
            [group_row(*grp) for grp in self.img_groups], dtype=torch.int64, device=device
        )
        self.mine = outs[rank][0]  # (B, Lt + n, H, D)
        self.h, self.start, self.in_max, self.out_max = h, s, max(Lt, n), max(Lt, m)


class PeerUlyssesAttention:
    """The `wrap_attention` wrapper of one forward (same contract as `parallel.UlyssesAttention`):
    q, k, v (B, H, Lt + n_mine, D) -> the same shape, attention over every rank's tokens."""

    def __init__(self, groups, sizes: list[int], txt_len: int, plans: dict):
        self.g, self.sizes, self.txt_len, self.plans = groups, sizes, txt_len, plans

    def _plan(self, B: int, H: int, D: int, dtype: torch.dtype, device: torch.device) -> _Plan:
        G = self.g.sp_size
        if H % G:
            raise ValueError(f"ulysses={G} needs a head count divisible by {G}; this model has {H} heads")
        key = (B, H, D, self.txt_len, tuple(self.sizes), dtype, str(device))
        if key not in self.plans:
            g = self.g
            self.plans[key] = _Plan(
                g.sp_group, g.sp_rank, G, B, H, D, self.txt_len, self.sizes, dtype, device
            )
        return self.plans[key]

    def __call__(
        self, inner: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        B, H, _, D = q.shape
        p = self._plan(B, H, D, q.dtype, q.device)
        src = [x.transpose(1, 2) for x in (q, k, v)]  # (B, T, H, D) views
        if len({x.stride() for x in src}) > 1:
            src = [x.contiguous() for x in src]
        head_scatter(src, p.in_table, p.in_rows, p.in_dsts, p.h, p.in_max)
        return self._attend(p, inner, mask, B)

    def joint(
        self, streams: list, H: int, D: int, mask: torch.Tensor | None, inner: Callable
    ) -> torch.Tensor:
        """`attention.joint_attention` for [text; image]: the QK-norm + RoPE kernel writes my text rows
        of my heads into my IN, and my image rows of head group j straight into rank j's IN (no
        local Q/K/V buffer, no separate copy)."""
        if len(streams) != 2 or streams[0][0].shape[1] != self.txt_len:
            raise ValueError("the peer Ulysses exchange takes [text; this rank's image tokens] streams")
        (qkv_t, *norm_t), (qkv_i, *norm_i) = streams
        B, r = qkv_t.shape[0], self.g.sp_rank
        p = self._plan(B, H, D, qkv_t.dtype, qkv_t.device)
        qk_norm_rope(qkv_t, *norm_t, *p.qkv[r], offset=0, head0=r * p.h)
        qk_norm_rope_groups(qkv_i, *norm_i, p.img_table, p.img_groups, offset=self.txt_len + p.start)
        return self._attend(p, inner, mask, B, keep=False)

    def _attend(
        self, p: _Plan, inner: Callable, mask: torch.Tensor | None, B: int, keep: bool = True
    ) -> torch.Tensor:
        """Steps 1 (barrier) to 4 of the module docstring, once IN holds this rank's rows. keep=False
        (`joint_attention`, whose caller consumes the result before its next call): OUT itself is
        returned, no copy - the other ranks write OUT again only after this rank's next barrier."""
        p.IN.barrier()
        Lt = self.txt_len
        if mask is not None:  # (B, 1, 1, Lt + n_mine): the text part is replicated, image keys are real
            mask = torch.cat([mask[..., :Lt], mask.new_ones(B, 1, 1, sum(self.sizes))], dim=-1)
        o = inner(p.q, p.k, p.v, mask)  # (B, h, S, D)
        head_scatter([o.transpose(1, 2)], p.out_table, p.out_rows, p.out_dsts, p.h, p.out_max)
        p.OUT.barrier()
        out = p.mine.clone() if keep else p.mine
        return out.transpose(1, 2)  # (B, H, Lt + n, D) over (B, Lt + n, H, D)
