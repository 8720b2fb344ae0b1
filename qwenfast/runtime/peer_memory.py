"""Peer memory: one buffer per rank of a process group, every rank able to read and write every
other rank's buffer directly, plus a barrier - what a Ulysses exchange needs to move rows into
place without a collective (runtime/ulysses_peer.py).

- CUDA: PyTorch's symmetric memory (`torch.distributed._symmetric_memory`: the buffers are mapped
  into every process over NVLink/P2P; `get_buffer(rank)` is a tensor on this device that aliases
  rank's buffer; `barrier()` is a kernel on the current stream, so it is ordered with the copies
  around it and can be captured in a CUDA graph). Multicast is never used (we set
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless the caller chose otherwise).
- CPU (the gloo test processes): one shared-memory file per rank under /dev/shm, mapped by every
  rank; the barrier is the group's `dist.barrier()` (the copies before it are synchronous).

A buffer is never freed while the process lives (a captured CUDA graph may still write into it).
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings

import torch
import torch.distributed as dist

__all__ = ["PeerBuffer", "peer_memory_available"]


def peer_memory_available(device: torch.device) -> bool:
    """CPU: always (shared files). CUDA: symmetric memory imports and this GPU reaches the others."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except Exception:
        return False
    n = torch.cuda.device_count()
    me = device.index if device.index is not None else torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(me, j) for j in range(n) if j != me)


class PeerBuffer:
    """`numel` elements of `dtype` on every rank of `group` (a collective: every rank constructs it
    with the same numel, in the same order)."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device):
        self.group, self.numel, self.dtype, self.device = group, numel, dtype, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if device.type == "cuda":
            self._init_cuda()
        else:
            self._init_cpu()

    def _init_cuda(self):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm

        with warnings.catch_warnings():  # needed before torch 2.9, a deprecated no-op after
            warnings.simplefilter("ignore")
            if hasattr(symm, "enable_symm_mem_for_group"):
                symm.enable_symm_mem_for_group(self.group.group_name)
        self.local = symm.empty(self.numel, dtype=self.dtype, device=self.device)
        self._handle = symm.rendezvous(self.local, self.group.group_name)
        self._peers = [
            self.local if j == self.rank else self._handle.get_buffer(j, (self.numel,), self.dtype)
            for j in range(self.size)
        ]

    def _init_cpu(self):
        tag = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(self.group, 0), group=self.group)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths = [os.path.join(root, f"qwenfast-peer-{tag[0]}-{j}") for j in range(self.size)]
        nbytes = self.numel * torch.empty((), dtype=self.dtype).element_size()
        with open(paths[self.rank], "wb") as f:
            f.truncate(nbytes)
        dist.barrier(group=self.group)
        self._peers = [torch.from_file(p, shared=True, size=self.numel, dtype=self.dtype) for p in paths]
        dist.barrier(group=self.group)  # everyone mapped every file: the names can go
        os.unlink(paths[self.rank])
        self.local = self._peers[self.rank]

    def view(self, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank `rank`'s buffer (its first prod(shape) elements) as a contiguous tensor of `shape`."""
        n = 1
        for s in shape:
            n *= s
        if n > self.numel:
            raise ValueError(f"view of {n} elements on a peer buffer of {self.numel}")
        return self._peers[rank][:n].view(shape)

    def barrier(self) -> None:
        """Every rank's writes before it (in stream order) are visible to every rank after it."""
        if self.device.type == "cuda":
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=self.group)
