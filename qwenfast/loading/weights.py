"""Streaming weights from safetensors into a model built on the meta device.

Why: a 40 GB transformer must never exist twice. The model is built on `meta` (no storage), each
tensor is read from the file straight onto the target device (`safe_open(device=...)`), cast to the
target dtype and assigned as the parameter; at any moment at most one tensor (or one Q/K/V group
being fused) is held beside the model. Every failure names the file and the keys involved.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open


from ..errors import CheckpointError  # noqa: F401 - re-exported


def weight_files(folder: Path, stem: str) -> list[Path]:
    """The safetensors files of one component: `<stem>.safetensors` or the shards its index lists."""
    folder = Path(folder)
    index = folder / f"{stem}.safetensors.index.json"
    single = folder / f"{stem}.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {missing}")
        return files
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else "folder does not exist"
    raise CheckpointError(
        f"no weights in {folder}: expected {single.name} or {index.name} (found: {found}). "
        "Only safetensors checkpoints are supported; convert .bin/.pt files first."
    )


def iter_safetensors(files: Iterable[Path], device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (key, tensor, file) one tensor at a time, read directly onto `device`."""
    dev = str(torch.device(device))
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=dev) as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key), f
        except SafetensorError as e:
            raise CheckpointError(f"{f}: cannot read safetensors file ({e}); is it truncated or corrupt?") from e


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load_streaming(
    model: nn.Module,
    items: Iterable[tuple[str, torch.Tensor, Path]],
    *,
    dtype: torch.dtype,
    where: str,
    convert: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None] | None = None,
) -> nn.Module:
    """Assign every tensor of `items` to `model` (built on meta), cast floating tensors to `dtype`.

    `convert` maps a checkpoint key/tensor to our layout (None = deliberately dropped). Raises
    CheckpointError listing unexpected keys (with their file), shape mismatches and missing keys.
    """
    expected = {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}
    seen, unexpected, bad_shape = set(), [], []
    for key, t, f in items:
        out = convert(key, t) if convert else (key, t)
        if out is None:
            continue
        name, t = out
        if name not in expected:
            unexpected.append(f"{key} ({f.name})")
            continue
        if tuple(t.shape) != tuple(expected[name]):
            bad_shape.append(f"{key}: file {tuple(t.shape)} vs model {tuple(expected[name])} ({f.name})")
            continue
        if t.is_floating_point():
            t = t.to(dtype)
        _set_tensor(model, name, t)
        seen.add(name)
    if hasattr(convert, "check_done"):
        convert.check_done(where)
    missing = sorted(set(expected) - seen)
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_short(unexpected)}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} shape mismatches: {_short(bad_shape)}")
    if missing:
        problems.append(f"{len(missing)} missing keys: {_short(missing)}")
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not match the model config; " + "; ".join(problems))
    return model.eval().requires_grad_(False)


def _short(items: list[str], n: int = 8) -> str:
    more = f" ... and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


class QKVFuser:
    """Collects separate Q/K/V tensors and emits the fused tensor once all three have arrived.

    Used as the `convert` step of `load_streaming` for the transformer; pieces of one block arrive
    close together in real checkpoints, so at most a few tensors wait here.
    """

    def __init__(self, fuse_key: Callable[[str], tuple[str, int] | None]):
        self.fuse_key = fuse_key
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, key: str, t: torch.Tensor):
        hit = self.fuse_key(key)
        if hit is None:
            return key, t
        fused, slot = hit
        group = self.pending.setdefault(fused, {})
        group[slot] = t
        if len(group) < 3:
            return None
        del self.pending[fused]
        return fused, torch.cat([group[0], group[1], group[2]], dim=0)

    def check_done(self, where: str) -> None:
        if self.pending:
            raise CheckpointError(
                f"{where}: incomplete Q/K/V groups (one of to_q/to_k/to_v missing) for {sorted(self.pending)}"
            )
