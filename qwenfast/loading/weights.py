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
from typing import TypeVar

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


# bits per element of every dtype safetensors knows (sub-byte ones packed)
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
                    "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                    "I64": 64, "U64": 64, "F64": 64, "C64": 64}  # fmt: skip
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked without reading any tensor data.

    Checks that the 8-byte little-endian length and the JSON are sound, that every tensor's dtype,
    shape and `data_offsets` agree (end - begin = elements x dtype size, tensors tile the data with
    no gap or overlap) and that the file is exactly 8 + header + data bytes long, so a truncated,
    padded or overwritten file is caught. Raises CheckpointError naming the file.
    """
    path = Path(path)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: cannot read safetensors file ({why}); is it truncated or corrupt?")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise bad(f"header length {n} does not fit a {size}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("__metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {key!r}: expected dtype, shape and data_offsets, got {info!r:.120}")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SAFETENSORS_BITS:
            raise bad(f"tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise bad(f"tensor {key!r}: shape {shape!r} is not a list of sizes")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise bad(f"tensor {key!r}: data_offsets {offs!r} are not [begin, end]")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = (numel * SAFETENSORS_BITS[dtype] + 7) // 8
        if offs[1] - offs[0] != nbytes:
            raise bad(
                f"tensor {key!r}: {dtype} {shape} needs {nbytes} bytes, data_offsets {offs} hold "
                f"{offs[1] - offs[0]}"
            )
        spans.append((offs[0], offs[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise bad(f"tensor {key!r} starts at byte {begin} of the data, expected {end} (gap or overlap)")
        end = stop
    if size != 8 + n + end:
        raise bad(f"{size} bytes on disk, but its header describes 8 + {n} + {end} = {8 + n + end}")
    return header


def check_safetensors(path: Path) -> str | None:
    """None when `path` is a sound safetensors file (header and length, no tensor data read), else why not."""
    try:
        read_safetensors_header(path)
    except CheckpointError as e:
        return str(e)
    return None


def check_weight_files(folder: Path, stem: str) -> list[str]:
    """Problems of one component's safetensors files: shards its index lists but the folder lacks (via
    `weight_files`), and broken headers or file lengths (no tensor data read). Which keys a file holds is
    the loader's business: it lists missing and unexpected keys against the model."""
    try:
        files = weight_files(folder, stem)
    except CheckpointError as e:
        return [str(e)]
    return [why for f in files if (why := check_safetensors(f)) is not None]


def iter_safetensors(
    files: Iterable[Path], device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (key, tensor, file) one tensor at a time, read directly onto `device`."""
    dev = str(torch.device(device))
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=dev) as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key), f
        except SafetensorError as e:
            raise CheckpointError(
                f"{f}: cannot read safetensors file ({e}); is it truncated or corrupt?"
            ) from e


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


_M = TypeVar("_M", bound=nn.Module)
KEEP_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def load_streaming(
    model: _M,
    items: Iterable[tuple[str, torch.Tensor, Path]],
    *,
    dtype: torch.dtype,
    where: str,
    convert: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None] | None = None,
) -> _M:
    """Assign every tensor of `items` to `model` (built on meta), cast floating tensors to `dtype`.

    `convert` maps a checkpoint key/tensor to our layout: (name, tensor), a list of them, or None
    (deliberately dropped). FP8 tensors and `.weight_scale`s keep the model's dtype for them. Raises
    CheckpointError listing unexpected keys (with their file), shape mismatches and missing keys.
    """
    state = model.state_dict(keep_vars=True)
    expected = {k: v.shape for k, v in state.items()}
    # tensors the model keeps in a dtype of their own (FP8 weights and their fp32 scales) are cast to that
    keep = {k: v.dtype for k, v in state.items() if v.dtype in KEEP_DTYPES or k.endswith(".weight_scale")}
    seen, unexpected, bad_shape = set(), [], []
    for key, t, f in items:
        out = convert(key, t) if convert else (key, t)
        if out is None:
            continue
        for name, t in [out] if isinstance(out, tuple) else out:  # a convert step may emit several tensors
            if name not in expected:
                unexpected.append(f"{key} ({f.name})")
                continue
            if tuple(t.shape) != tuple(expected[name]):
                bad_shape.append(f"{key}: file {tuple(t.shape)} vs model {tuple(expected[name])} ({f.name})")
                continue
            if name in keep:
                t = t.to(keep[name])
            elif t.is_floating_point():
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
