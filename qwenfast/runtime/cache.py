"""Step caching: skip the middle transformer blocks on steps where their output barely changes.

Why: at 50 steps, neighbouring steps' middle blocks produce nearly the same residual (what they add
to the hidden states), so recomputing it every step is mostly wasted work; the published cached
engines (cache-dit's DBCache, TeaCache, TaylorSeer) run 2-3x faster on 50-step models at little
quality cost. Each step runs the first `first` blocks (Fn) and the last `last` blocks (Bn) always;
on a *cached* step the middle blocks are replaced by the residual they added at the last full step
(or, with `taylor=1`, that residual extrapolated linearly from the last two full steps). A static
policy may take `first=0` (the `fast` preset): a cached step then runs no block, its residual is the
whole stack's. The first blocks buy an adaptive policy its probe and a static one only the freshness
of one block of 60, while costing a cached step one block's time (with batched CFG, ~2.7 of its
~3.4 ms on an H200).

Policies (`CachePolicy.kind`):
- "static": which steps are full is fixed by (step, steps) alone: every `warmup_every`-th of the first
  `warmup` steps (all of them at 1), the last `tail` steps and every `every`-th step in between. Deterministic, so every batch row and every CFG
  branch makes the same decision, CUDA graphs capture one graph per variant ("full", "cached"), and
  its speed is measurable with random weights.
- "adaptive": DBCache-style. The first blocks' residual (their output minus their input, image
  stream) is compared with the one of the last full step; when its relative L1 change is below
  `threshold` (and at most `max_skips` cached steps in a row, outside warmup/tail) the middle is
  skipped. Decided per batch row (a row computes, or reuses its own cache, as it would alone), so
  it needs a host sync per step and runs without CUDA graphs.

State is kept per CFG branch ("cond", "uncond", or "both" for a batched CFG forward) and per shape,
and is reset at step 0 of every run (a full step, always), so nothing leaks between requests.

Memory (static policy): the residual buffers of every shape of a branch are views of one buffer (the
branch's arena), sized for the largest shape seen. Only one cached run per runner is under way at a time
(a request run between two steps of a cached batch bypasses the cache: `StepContext.cache`), and every
run restarts its state at step 0, so shapes need no buffers of their own; a server that sees many sizes,
batch sizes and prompt lengths kept one set per shape for good before (~0.1-0.3 GiB each: its allocated
memory grew by 2.4 GiB over an 8-minute mixed soak, H100). When a larger shape comes, the arena is
reallocated and `epoch` moves on: graphs captured against the old one are never replayed again. So an
arena is made `HEADROOM` times what the shape needs: a longer prompt (another text bucket) or a slightly
larger size does not reallocate it, and a server's warm-up that runs its largest shape first
(`qwenfast serve --warm-up`, server/warmup.py; the serve benchmark's `shapes_warm`) leaves every graph it
captures valid for the load.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
import torch.nn as nn

from ..options import CACHE_PRESETS, CachePolicy, resolve_policy
from .blocks import BlockCall, BlockRunner, StepContext

# the policy type, its named presets and the name -> policy rule are option values: options.py
__all__ = ["CachePolicy", "StepCacheRunner", "CACHE_PRESETS", "resolve_policy"]

# an arena is allocated this many times the residuals it must hold (module docstring): an H100 soak whose
# warm-up grew the arena as it went (33 of its 73 graphs dropped as stale) captured 27 graphs again during
# the load, each with an eager forward's working memory on top of the floor; a quarter more costs ~0.1 GB
# at 1328², batch 2 with CFG
HEADROOM = 1.25


class _State:
    """One branch x shape: the cached middle residual (img, txt), the last two full steps (Taylor)."""

    def __init__(self):
        self.res: tuple[torch.Tensor, torch.Tensor] | None = None  # residual of the middle blocks
        self.prev: tuple[torch.Tensor, torch.Tensor] | None = None  # the full step before (Taylor)
        self.probe: torch.Tensor | None = None  # adaptive: first blocks' residual at the last full step
        self.skips: torch.Tensor | None = None  # adaptive: cached steps in a row, per row (long)
        self.full_at: torch.Tensor | None = None  # adaptive + Taylor: step index of the last two full steps


class StepCacheRunner(BlockRunner):
    """The step cache as a block runner (see the module docstring)."""

    every_block_resident = False  # cached steps skip blocks: their inputs are not computed up front

    def __init__(self, policy: CachePolicy):
        self.policy = policy
        self.states: dict[tuple, _State] = {}
        self._arena: dict[str, torch.Tensor] = {}  # static: per branch, the buffer every shape's state views
        self.epoch = 0  # moves on when an arena is reallocated (part of every CUDA-graph key)
        # static + Taylor: the extrapolation factor of the coming step, a device scalar per branch that
        # `prepare` writes before each forward (outside any CUDA graph), so graphs stay valid
        self._factor: dict[str, torch.Tensor] = {}
        self._full_steps: dict[str, list[int]] = {}
        self._seen: dict[str, tuple] = {}
        self.stats = {"full": 0, "cached": 0}  # forwards per kind (adaptive: batch rows)

    def reset_stats(self) -> None:
        self.stats.update(full=0, cached=0)  # in place: callers may hold the dict

    # ------------------------------------------------------------------ decisions
    def variant(self, step: StepContext | None) -> Hashable:
        p = self.policy
        if step is None or not step.cache:
            return "plain"  # every block, nothing kept: not a full step's graph, which records residuals
        if p.kind == "adaptive":
            return "adaptive"
        if step.step == 0:
            return "first"  # a full step that also restarts the cache (its own graph)
        return "full" if p.static_full(step.step, step.steps) else "cached"

    @property
    def graph_safe(self) -> bool:
        return self.policy.kind == "static"

    def prepare(self, step: StepContext | None, device: torch.device) -> None:
        """Host-side bookkeeping before a forward (eager; before a CUDA-graph replay too): counts, and
        the static Taylor factor of a cached step. Idempotent per (branch, step)."""
        if step is None or not step.cache or self.policy.kind != "static":
            return
        mark = (step.branch, step.step, step.steps)
        if self._seen.get(step.branch) == mark:
            return
        self._seen[step.branch] = mark
        full = self._full_steps.setdefault(step.branch, [])
        if step.step == 0:
            full.clear()
        if self.policy.static_full(step.step, step.steps):
            full.append(step.step)
            self.stats["full"] += 1
            return
        self.stats["cached"] += 1
        f = self._factor.get(step.branch)
        if f is None or f.device != device:
            f = self._factor[step.branch] = torch.zeros((), dtype=torch.float32, device=device)
        gap = full[-1] - full[-2] if len(full) >= 2 else 0
        f.fill_((step.step - full[-1]) / gap if gap else 0.0)

    def snapshot(self) -> object:
        return {b: (a, a.clone()) for b, a in self._arena.items()}

    def restore(self, snap: object) -> None:
        for b, (was, saved) in snap.items():
            if self._arena.get(b) is was:  # (else reallocated by the warm-up: a first use, nothing to undo)
                was.copy_(saved)

    # ------------------------------------------------------------------ the block loop
    def run(
        self,
        blocks: Sequence[nn.Module],
        call: BlockCall,
        img: torch.Tensor,
        txt: torch.Tensor,
        step: StepContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.policy
        n = len(blocks)
        first, last = min(p.first, n), min(p.last, max(0, n - p.first))
        if step is None or not step.cache or first + last >= n:  # no step context / cache, or no middle
            return super().run(blocks, call, img, txt, step)
        if not (img.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.prepare(step, img.device)
        img0 = img
        for i in range(first):
            img, txt = call(i, blocks[i], img, txt)
        key = (step.branch, tuple(img.shape), tuple(txt.shape))
        if p.kind == "static":
            st = self.states.setdefault(key, _State())
            img, txt = self._static_middle(blocks, call, img, txt, step, st, first, n - last)
        else:
            if step.step == 0:
                self.states.pop(key, None)
            st = self.states.setdefault(key, _State())
            img, txt = self._adaptive_middle(blocks, call, img, txt, img - img0, step, st, first, n - last)
            if step.step == step.steps - 1:  # eager: the run's state goes with its last step
                self.states.pop(key, None)
        for i in range(n - last, n):
            img, txt = call(i, blocks[i], img, txt)
        return img, txt

    def _middle(self, blocks, call, img, txt, a, b):
        for i in range(a, b):
            img, txt = call(i, blocks[i], img, txt)
        return img, txt

    def _static_middle(self, blocks, call, img, txt, step, st: _State, a: int, b: int):
        v = self.variant(step)
        if v != "cached" or st.res is None:
            img2, txt2 = self._middle(blocks, call, img, txt, a, b)
            self._store(step.branch, st, (img2 - img, txt2 - txt), restart=v == "first")
            return img2, txt2
        ri, rt = st.res
        if self.policy.taylor:
            f = self._factor[step.branch]  # (s - s_k) / (s_k - s_k-1), written by prepare()
            ri = ri + (ri - st.prev[0]) * f.to(ri.dtype)
            rt = rt + (rt - st.prev[1]) * f.to(rt.dtype)
        return img + ri, txt + rt

    def _store(self, branch: str, st: _State, res: tuple[torch.Tensor, torch.Tensor], restart: bool) -> None:
        """Keep the residual in persistent buffers (fixed addresses: CUDA graphs read and write them
        in place; the first use of a shape, always an eager or warm-up run, points it into the arena)."""
        if st.res is None or st.res[0].shape != res[0].shape:
            views = self._views(branch, res, 2 if self.policy.taylor else 1)
            st.res = (views[0], views[1])
            st.prev = (views[2], views[3]) if self.policy.taylor else None
            for k in range(2):
                st.res[k].copy_(res[k])
                if st.prev is not None:
                    st.prev[k].copy_(res[k])
            return
        for k in range(2):
            if st.prev is not None:
                st.prev[k].copy_(res[k] if restart else st.res[k])
            st.res[k].copy_(res[k])

    def _views(self, branch: str, like: tuple[torch.Tensor, torch.Tensor], sets: int) -> list[torch.Tensor]:
        """`sets` x (img, txt) buffers shaped like `like`, views of the branch's arena (see the module
        docstring); a larger need reallocates it, drops the branch's other states (they view the old
        one) and moves `epoch` on."""
        img, txt = like
        n = sets * (img.numel() + txt.numel())
        a = self._arena.get(branch)
        if a is None or a.numel() < n or a.dtype != img.dtype or a.device != img.device:
            for key in [k for k in self.states if k[0] == branch]:
                st = self.states[key]
                st.res = st.prev = None
            if a is not None:  # graphs may have captured the old one (none can have read a first one)
                self.epoch += 1
            # zeros, not empty: the headroom is never read, but a snapshot (CUDA-graph warm-up) copies it whole
            a = self._arena[branch] = torch.zeros(math.ceil(n * HEADROOM), dtype=img.dtype, device=img.device)
        out, at = [], 0
        for _ in range(sets):
            for t in (img, txt):
                out.append(a[at : at + t.numel()].view(t.shape))
                at += t.numel()
        return out

    def _adaptive_middle(self, blocks, call, img, txt, probe, step, st: _State, a: int, b: int):
        """Per-row decision: rows whose first-blocks residual (`probe`) moved little since their last
        full step reuse their own cached middle residual."""
        p = self.policy
        B = img.shape[0]
        probe = probe.detach().float()
        edge = step.step < p.warmup or step.step >= step.steps - p.tail
        if st.res is None or st.probe is None or edge:
            skip = torch.zeros(B, dtype=torch.bool, device=img.device)
        else:
            d = (probe - st.probe).abs().flatten(1).mean(1) / st.probe.abs().flatten(1).mean(1).clamp_min(
                1e-12
            )
            skip = (d < p.threshold) & (st.skips < p.max_skips)
        skip_rows = skip.tolist()  # the host decides (one sync per step)
        if all(skip_rows):
            self.stats["cached"] += B
            ri, rt = self._predict(st, step)
            st.skips += 1
            return img + ri, txt + rt
        img2, txt2 = self._middle(blocks, call, img, txt, a, b)
        res = (img2 - img, txt2 - txt)
        if any(skip_rows):  # rows that would skip alone: their cached result, not the computed one
            ri, rt = self._predict(st, step)
            m = skip.view(B, 1, 1)
            img2 = torch.where(m, img + ri, img2)
            txt2 = torch.where(m, txt + rt, txt2)
        self.stats["cached"] += sum(skip_rows)
        self.stats["full"] += B - sum(skip_rows)
        full = ~skip
        fm = full.view(B, 1, 1)
        if st.res is None:
            st.res, st.probe = res, probe
            st.prev = res if p.taylor else None
            st.skips = torch.zeros(B, dtype=torch.long, device=img.device)
            st.full_at = torch.stack([torch.full((B,), float(step.step))] * 2).to(img.device)
        else:
            if p.taylor:
                st.prev = tuple(torch.where(fm, r, q) for r, q in zip(st.res, st.prev))
                st.full_at[0] = torch.where(full, st.full_at[1], st.full_at[0])
            st.res = tuple(torch.where(fm, r, q) for r, q in zip(res, st.res))
            st.probe = torch.where(fm, probe, st.probe)
            st.skips = torch.where(full, 0, st.skips + 1)
        if p.taylor:
            st.full_at[1] = torch.where(full, torch.full_like(st.full_at[1], step.step), st.full_at[1])
        return img2, txt2

    def _predict(self, st: _State, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.policy.taylor or st.prev is None:
            return st.res
        k, k1 = st.full_at[1], st.full_at[0]
        gap = k - k1
        f = torch.where(gap > 0, (step.step - k) / gap.clamp_min(1), torch.zeros_like(gap)).view(-1, 1, 1)
        return tuple(r + (r - q) * f.to(r.dtype) for r, q in zip(st.res, st.prev))
