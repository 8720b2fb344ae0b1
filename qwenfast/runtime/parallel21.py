"""Several GPUs for one Qwen-Image-2.1 image: CFG-parallel and Ulysses sequence parallel over a
sequence whose prefix (text and condition-image tokens) precedes the target image's tokens.

2.1's attention is block-causal: the prefix tokens attend only to prefix keys (causally for text,
bidirectionally inside each condition image), the target tokens attend to everything; with the KV
cache the prefix's keys/values are stored on step 0 and later steps run the target tokens alone.
So the layout here (runtime/parallel.py has Qwen-Image's):

- the prefix is whole on every rank (computed redundantly: it never needs another rank's tokens,
  and under the KV cache only step 0 computes it), and so is every rank's KV cache of it;
- the target tokens are split over the G ranks of a sequence group in contiguous chunks (uneven
  sizes allowed: 195 tokens over 2 ranks is 98 + 97); each rank's KV cache holds its own chunk's
  target keys/values after the prefix;
- attention calls whose keys are all prefix keys (the prefix's own runs) run locally; the target's
  call (its queries: this rank's chunk; its keys: the prefix + this chunk) exchanges the chunk's
  q, k, v for all target tokens of H/G heads (one all-to-all), attends over the prefix + every
  target key of those heads, and exchanges the output back (a second all-to-all). Chunks are padded
  to the longest for the all-to-all and the padding dropped before the attention: no mask is added,
  the result is the one-device attention.

CFG-parallel (cfg=2) is `ParallelForward`'s: the denoise core runs true CFG as one batched forward,
each cfg rank computes one branch (a 2.1 forward per branch: their layouts differ) and one
all-gather per step gives both ranks both predictions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .attention import wrap_attention
from .blocks import StepContext
from .parallel import ParallelForward, ParallelGroups, _all_gather, split_sizes

__all__ = ["PrefixParallelForward", "PrefixUlyssesAttention"]


class PrefixUlyssesAttention:
    """The attention wrapper of one 2.1 forward on a sequence-parallel rank (see the module docstring).

    prefix: tokens before the target (the same on every rank); sizes: the target chunk of each rank.
    `stats["exchanges"]` counts the target calls that went through the all-to-all.
    """

    def __init__(self, groups: ParallelGroups, sizes: list[int], prefix: int, stats: dict | None = None):
        self.g, self.sizes, self.prefix = groups, sizes, prefix
        self.stats = stats if stats is not None else {}

    def __call__(
        self, inner: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        P, G, r = self.prefix, self.g.sp_size, self.g.sp_rank
        if k.shape[2] <= P:  # a prefix run: its keys are prefix keys, whole on this rank
            return inner(q, k, v, mask)
        n, N = self.sizes[r], sum(self.sizes)
        B, H, _, D = q.shape
        if q.shape[2] != n or k.shape[2] != P + n:
            raise ValueError(
                f"sequence-parallel attention expects this rank's {n} target queries against {P} prefix "
                f"+ {n} target keys, got {q.shape[2]} queries and {k.shape[2]} keys"
            )
        if H % G:
            raise ValueError(f"ulysses={G} needs a head count divisible by {G}; this model has {H} heads")
        h = H // G
        qt, kt, vt = self._to_heads(
            [q, k[:, :, P:], v[:, :, P:]]
        )  # (B, h, N, D) each: all target tokens, my heads
        mine = slice(r * h, (r + 1) * h)
        kf = torch.cat([k[:, mine, :P], kt], dim=2)  # (B, h, P + N, D)
        vf = torch.cat([v[:, mine, :P], vt], dim=2)
        if mask is not None:  # (B, 1, 1, P + n): padded text keys are in the prefix; target keys are real
            mask = torch.cat([mask[..., :P], mask.new_ones(B, 1, 1, N)], dim=-1)
        o = inner(qt, kf, vf, mask)  # (B, h, N, D)
        self.stats["exchanges"] = self.stats.get("exchanges", 0) + 1
        return self._to_tokens(o, H)

    def _to_heads(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """[(B, H, n_mine, D)] -> [(B, H/G, N, D)]: my head group, every rank's target tokens in order."""
        G, sizes = self.g.sp_size, self.sizes
        B, H, n, D = xs[0].shape
        h, m = H // G, max(sizes)
        send = xs[0].new_zeros(G, len(xs), B, h, m, D)
        for i, x in enumerate(xs):  # head group j of my tokens -> rank j
            send[:, i, :, :, :n] = x.reshape(B, G, h, n, D).transpose(0, 1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.g.sp_group)
        return [torch.cat([recv[j, i, :, :, : sizes[j]] for j in range(G)], dim=2) for i in range(len(xs))]

    def _to_tokens(self, o: torch.Tensor, H: int) -> torch.Tensor:
        """(B, H/G, N, D) -> (B, H, n_mine, D): each rank gets its tokens' part of my heads' output."""
        G, sizes = self.g.sp_size, self.sizes
        B, h, _, D = o.shape
        m, n = max(sizes), sizes[self.g.sp_rank]
        send = o.new_zeros(G, B, h, m, D)
        s = 0
        for j, nj in enumerate(sizes):
            send[j, :, :, :nj] = o[:, :, s : s + nj]
            s += nj
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.g.sp_group)
        return recv[:, :, :, :n].permute(1, 0, 2, 3, 4).reshape(B, H, n, D)  # heads: rank j's group j


class PrefixParallelForward(ParallelForward):
    """`ParallelForward` (its cfg split) for a forward `fn(x, emb, mask, t, img_shapes, step, shard=)`
    whose sequence is a prefix + the target: x (B, N + M, C) is the target's N tokens (img_shapes[0])
    then M condition tokens; `prefix_len(emb, img_shapes, step)` is the prefix length of that call's
    joint sequence. Each rank runs the whole prefix and its chunk of the target; the output (B, N, C)
    is gathered. `stats`: sharded forwards and target attention exchanges this rank ran in Python (a
    replayed CUDA graph runs none: there they count the capture)."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        groups: ParallelGroups,
        prefix_len: Callable[[torch.Tensor, list, StepContext], int],
    ):
        super().__init__(fn, groups)
        self.prefix_len = prefix_len
        self.stats = {"sharded_forwards": 0, "exchanges": 0}

    def _sequence(self, x, emb, mask, t, img_shapes, step) -> torch.Tensor:
        g = self.g
        G = g.sp_size
        if G == 1:
            return self.fn(x, emb, mask, t, img_shapes, step)
        N = math.prod(img_shapes[0])
        if N < G:
            raise ValueError(f"ulysses={G} needs at least {G} target tokens, this image has {N}")
        sizes = split_sizes(N, G)
        start = sum(sizes[: g.sp_rank])
        n = sizes[g.sp_rank]
        mine = torch.cat(
            [x[:, start : start + n], x[:, N:]], dim=1
        )  # my target chunk + every condition token
        attn = PrefixUlyssesAttention(g, sizes, self.prefix_len(emb, img_shapes, step), self.stats)
        with wrap_attention(attn):
            out = self.fn(mine, emb, mask, t, img_shapes, step, shard=(start, start + n))  # (B, n, C)
        self.stats["sharded_forwards"] += 1
        m = max(sizes)
        if n < m:
            out = torch.cat([out, out.new_zeros(out.shape[0], m - n, out.shape[2])], dim=1)
        parts = _all_gather(out, g.sp_group, G)
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes)], dim=1)
