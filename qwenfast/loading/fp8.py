"""What is inside a single safetensors file, and its tensors one at a time as plain floats (FP8 dequantised).

Why a separate reader: ComfyUI split files come in several storage formats that look alike from the
outside (`qwen_image_bf16`, `qwen_image_fp8_e4m3fn`, `..._fp8_scaled`, `..._fp8mixed`). Loading one
the wrong way does not crash, it silently gives a different image (an FP8 weight used without its
scale is off by a factor of ~100). So the format is decided from the header BEFORE any weight is
read, every key must be explained by a known format, and anything else is refused with the key
pattern found and the list of what is supported.

Formats (w = stored weight, s = its scale, both per `<layer>`, i.e. the weight key minus `.weight`):
- plain: floating tensors only -> `w.to(dtype)`;
- FP8 cast (`*_fp8_e4m3fn`): F8_E4M3 / F8_E5M2 tensors without scales -> `w.to(dtype)`;
- legacy scaled FP8: sentinel key `scaled_fp8`, `<layer>.scale_weight`, optional `.scale_input` -> `w * s`;
- ComfyUI mixed precision: `<layer>.weight_scale` (+ `.input_scale`) and either `<layer>.comfy_quant`
  (uint8 JSON `{"format": "float8_e4m3fn"}`) or the file metadata `_quantization_metadata`
  (`{"layers": {layer: {"format": ...}}}`) -> `w * s`.

Layers without a scale stay as stored (the "fp8mixed" files keep some layers in bf16). Input scales
only matter for FP8 matmuls, which qwenfast does not do: they are ignored. Dequantisation is
`(w.float() * s).to(dtype)`: one rounding to `dtype`. On CPU this is bitwise what ComfyUI computes
(`w.to(dtype) * s` with a 0-dim fp32 scale, which torch evaluates in fp32), and it is exact for fp32.

Memory: the header is parsed with `json` (no tensor is read), the scales (a few bytes each) and
`comfy_quant` markers are read up front, then each tensor is read with a plain file read (not mmap,
see `read_tensor`), moved to the target device, dequantised there and handed on; the stored tensor
is dropped before the next one is read.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .weights import CheckpointError

FLOAT = {"F64", "F32", "F16", "BF16"}
FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, **FP8,
                "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                "BOOL": torch.bool}  # fmt: skip
QUANT_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # comfy_quant "format" -> stored dtype
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
IGNORED_SUFFIXES = (".scale_input", ".input_scale")
MARKER_SUFFIX = ".comfy_quant"
SUPPORTED = (
    "supported: bf16/fp16/fp32 tensors; FP8 casts (F8_E4M3/F8_E5M2, no scales); legacy `scaled_fp8` + "
    "`<layer>.scale_weight`; `<layer>.weight_scale` with `<layer>.comfy_quant` or `_quantization_metadata` "
    f"formats {sorted(QUANT_FORMATS)}"
)
# Key endings of quantisation schemes we recognise but do not implement (named in the error).
_FOREIGN = {
    ".weight_scale_2": "NVFP4 (ComfyUI nvfp4)",
    ".absmax": "bitsandbytes 4-bit",
    ".quant_map": "bitsandbytes 4-bit",
    ".SCB": "bitsandbytes int8",
    ".qweight": "GPTQ/AWQ int4",
    ".qzeros": "GPTQ/AWQ int4",
    ".weight_s_rel": "int4 (w4a8)",
}
_MAX_HEADER = 256 * 2**20
STAGING_BYTES = 64 * 2**20


def key_patterns(keys: Iterable[str], n: int = 6) -> str:
    """The most common key shapes, indices replaced by N: "'transformer_blocks.N.attn.to_q.weight' (x60), ..."."""
    counts = Counter(re.sub(r"(?<=\.)\d+(?=\.|$)", "N", k) for k in keys)
    top = [f"'{p}'" + (f" (x{c})" if c > 1 else "") for p, c in counts.most_common(n)]
    more = f", ... {len(counts) - n} more patterns" if len(counts) > n else ""
    return ", ".join(top) + more


@dataclass
class Header:
    """The parsed safetensors header: key -> (dtype string, shape), plus the string metadata."""

    path: Path
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]
    offsets: dict[str, tuple[int, int]]  # byte range of each tensor, from `data_start`
    data_start: int


def read_header(path: str | Path, what: str = "checkpoint") -> Header:
    """Parse the header of a safetensors file without reading any tensor; refuse truncated files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{what} file {path} does not exist" + (" (it is a folder)" if path.is_dir() else "")
        )
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n <= 0 or n > min(_MAX_HEADER, size - 8):
            hint = (
                " (.gguf, .ckpt, .pt and .bin files are not supported)"
                if path.suffix != ".safetensors"
                else ""
            )
            raise CheckpointError(
                f"{path}: not a safetensors file, or truncated before the end of its header{hint}"
            )
        try:
            raw = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    meta = raw.pop("__metadata__", None) or {}
    dtypes, shapes, offsets, end = {}, {}, {}, 0
    for key, info in raw.items():
        try:
            dtypes[key], shapes[key] = info["dtype"], tuple(int(d) for d in info["shape"])
            offsets[key] = (int(info["data_offsets"][0]), int(info["data_offsets"][1]))
            end = max(end, offsets[key][1])
            item = torch.empty((), dtype=TORCH_DTYPES[dtypes[key]]).element_size()
            if offsets[key][1] - offsets[key][0] != math.prod(shapes[key]) * item:
                raise ValueError(f"{offsets[key]} is not the size of {dtypes[key]} {list(shapes[key])}")
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path}: malformed header entry for {key!r} ({e!r})") from e
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated: the header describes {8 + n + end} bytes but the file has {size}; "
            "download or copy it again"
        )
    if not dtypes:
        raise CheckpointError(f"{path}: the file holds no tensors")
    return Header(path, dtypes, shapes, {str(k): str(v) for k, v in meta.items()}, offsets, 8 + n)


def read_tensor(
    f: io.BufferedReader,  # open(path, "rb")
    header: Header,
    key: str,
    device: torch.device | str = "cpu",
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stored tensor, read with plain file reads (not mmap), on `device`.

    Not mmap (what safetensors' `safe_open` does): a mapped file counts in the process's resident
    memory as it is read, up to the whole file (19 GiB for a full-size FP8 transformer). Without
    `staging` the bytes go to a fresh host buffer (on CPU it becomes the tensor). With `staging` (a
    pinned uint8 buffer, reused) they go through it chunk by chunk into a tensor allocated on the
    device: fast host-to-device copies, and host memory bounded by the buffer, not by the tensor.
    """
    start, end = header.offsets[key]
    n = end - start
    f.seek(header.data_start + start)
    if staging is None:
        out = torch.empty(n, dtype=torch.uint8)
        got = f.readinto(out.numpy())
    else:
        out, got = torch.empty(n, dtype=torch.uint8, device=device), 0
        while got < n:
            m = f.readinto(staging[: min(len(staging), n - got)].numpy())
            if not m:
                break
            out[got : got + m].copy_(staging[:m])  # synchronous: the buffer is free again afterwards
            got += m
    if got != n:
        raise CheckpointError(f"{header.path}: the file ended inside {key}; is it truncated?")
    return out.view(TORCH_DTYPES[header.dtypes[key]]).reshape(header.shapes[key]).to(device)


def stores_fp8(path: str | Path) -> bool:
    """Whether a safetensors file holds e4m3 tensors (a folder, or a file of another format: False)."""
    path = Path(path)
    if not path.is_file() or path.suffix != ".safetensors":
        return False
    return any(d == "F8_E4M3" for d in read_header(path).dtypes.values())


@dataclass
class QuantPlan:
    """How each stored tensor becomes a plain one. `kind` names the format for messages and logs."""

    kind: str
    scales: dict[str, str] = field(default_factory=dict)  # weight key -> scale key
    aux: set[str] = field(default_factory=set)  # keys that are not model tensors (scales, markers, sentinel)
    formats: dict[str, str] = field(default_factory=dict)  # layer -> declared format


def _read_markers(header: Header, keys: list[str]) -> dict[str, dict]:
    """The `<layer>.comfy_quant` uint8 JSON tensors (a few dozen bytes each), decoded."""
    out = {}
    with open(header.path, "rb") as f:
        for k in keys:
            raw = bytes(read_tensor(f, header, k).to(torch.uint8).tolist())
            try:
                conf = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{header.path}: {k} is not JSON ({e})") from e
            if not isinstance(conf, dict):
                raise CheckpointError(f"{header.path}: {k} holds {conf!r}, expected a JSON object")
            out[k[: -len(MARKER_SUFFIX)]] = conf
    return out


def _metadata_layers(header: Header) -> dict[str, dict]:
    raw = header.metadata.get("_quantization_metadata")
    if raw is None:
        return {}
    try:
        layers = json.loads(raw)["layers"]
        if not isinstance(layers, dict):
            raise TypeError("'layers' is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{header.path}: metadata _quantization_metadata is not valid ({e})") from e
    return {k: (v if isinstance(v, dict) else {"format": v}) for k, v in layers.items()}


def plan_quantization(header: Header) -> QuantPlan:
    """Decide the storage format of every tensor from the header (and the tiny marker tensors)."""
    path, dtypes = header.path, header.dtypes
    keys = list(dtypes)
    for suffix, scheme in _FOREIGN.items():
        hits = [k for k in keys if k.endswith(suffix)]
        if hits:
            raise CheckpointError(
                f"{path}: quantised as {scheme} (keys like {key_patterns(hits, 2)}), which qwenfast cannot load; "
                f"{SUPPORTED}"
            )
    sentinel = [k for k in keys if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
    markers = [k for k in keys if k.endswith(MARKER_SUFFIX)]
    formats = _metadata_layers(header)
    formats.update(_read_markers(header, markers))
    aux = set(sentinel) | set(markers) | {k for k in keys if k.endswith(IGNORED_SUFFIXES)}

    plan = QuantPlan(kind="plain", aux=aux)
    for layer, conf in formats.items():
        fmt = conf.get("format")
        if fmt not in QUANT_FORMATS:
            where = "comfy_quant marker" if layer + MARKER_SUFFIX in dtypes else "_quantization_metadata"
            raise CheckpointError(
                f"{path}: layer {layer} is quantised as {fmt!r} ({where}), which qwenfast cannot load; {SUPPORTED}"
            )
        weight = _find_weight(layer, dtypes)
        if weight is None:
            raise CheckpointError(
                f"{path}: quantisation info names layer {layer!r} but the file has no {layer}.weight"
            )
        if dtypes[weight] != QUANT_FORMATS[fmt]:
            raise CheckpointError(f"{path}: {weight} is {dtypes[weight]} but its format says {fmt}")
        plan.formats[weight[: -len(".weight")]] = fmt

    for k in keys:
        if k.endswith(SCALE_SUFFIXES):
            layer = k.rsplit(".", 1)[0]
            weight = layer + ".weight"
            if weight not in dtypes:
                raise CheckpointError(f"{path}: scale {k} has no weight {weight} beside it")
            if dtypes[weight] not in FP8:
                raise CheckpointError(
                    f"{path}: scale {k} belongs to {weight}, stored as {dtypes[weight]}, not FP8"
                )
            if weight in plan.scales:
                raise CheckpointError(f"{path}: {weight} has two scales ({plan.scales[weight]}, {k})")
            _check_scale(path, k, header.shapes[k], header.shapes[weight])
            plan.scales[weight] = k
            aux.add(k)

    bad = [
        f"{k} ({dtypes[k]})" for k in keys if k not in aux and dtypes[k] not in FLOAT and dtypes[k] not in FP8
    ]
    if bad:
        raise CheckpointError(
            f"{path}: tensors stored as integers without a known quantisation format: {key_patterns(bad, 4)}; "
            f"{SUPPORTED}"
        )
    n_fp8 = sum(dtypes[k] in FP8 for k in keys if k not in aux)
    how = [
        name
        for name, present in (
            ("legacy scaled_fp8", sentinel),
            ("comfy_quant", markers),
            ("_quantization_metadata", "_quantization_metadata" in header.metadata),
            ("weight_scale", any(k.endswith(".weight_scale") for k in plan.scales.values())),
        )
        if present
    ]
    if how or plan.scales:
        scaled = f"{len(plan.scales)} scaled / {n_fp8} fp8 tensors"
        plan.kind = f"fp8 scaled ({', '.join(how or ['scale_weight'])}; {scaled})"
    elif n_fp8:
        plan.kind = f"fp8 cast ({n_fp8} fp8 tensors)"
    return plan


def _find_weight(layer: str, dtypes: dict[str, str]) -> str | None:
    """`_quantization_metadata` names layers with the file's prefix; some tools write them bare."""
    if layer + ".weight" in dtypes:
        return layer + ".weight"
    hits = [k for k in dtypes if k.endswith("." + layer + ".weight")]
    return hits[0] if len(hits) == 1 else None


def _check_scale(path: Path, key: str, shape: tuple[int, ...], wshape: tuple[int, ...]) -> None:
    n = 1
    for d in shape:
        n *= d
    if n == 1 or (len(wshape) and n == wshape[0]):  # per tensor, or per output row
        return
    raise CheckpointError(
        f"{path}: scale {key} has shape {shape} for a weight of shape {wshape}; only per-tensor and per-row "
        f"scales are supported (block-wise scales are not); {SUPPORTED}"
    )


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(w * scale) in fp32, rounded once to `dtype`. `scale` is a scalar or one value per output row."""
    s = scale.to(device=w.device, dtype=torch.float32)
    if s.numel() == 1:
        s = s.reshape(())
    else:
        s = s.reshape(-1, *([1] * (w.ndim - 1)))  # (out, 1, ...)
    out = w.to(torch.float32)
    out.mul_(s)
    return out.to(dtype)


def iter_plain_tensors(
    header: Header,
    plan: QuantPlan,
    device: torch.device | str,
    dtype: torch.dtype,
    keep: Callable[[str], bool] | None = None,
    raw: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (file key, tensor in `dtype` on `device`, path), one tensor at a time, in key order.

    Scales, markers and input scales are consumed here; `keep(key)` False skips a tensor without
    reading it (the other components of an all-in-one checkpoint). `raw(key)` True: an FP8-stored
    tensor comes as it is stored, a `loading.fp8_weights.QuantizedWeight` with its scale (FP8 loading).
    """
    from .fp8_weights import QuantizedWeight

    staging = None
    if torch.device(device).type == "cuda":  # pinned, at most 64 MiB (the host allocator rounds up to 2^k)
        size = min(STAGING_BYTES, max(e - b for b, e in header.offsets.values()))
        staging = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
    with open(header.path, "rb") as f:
        scales = {
            w: read_tensor(f, header, s, device) for w, s in plan.scales.items() if keep is None or keep(w)
        }
        for key in sorted(header.offsets):  # name order keeps each block's Q/K/V pieces together
            if key in plan.aux or (keep is not None and not keep(key)):
                continue
            t = read_tensor(f, header, key, device, staging)
            if raw is not None and t.dtype in FP8.values() and raw(key):
                t = QuantizedWeight(t, scales.get(key))
            elif key in scales:
                t = dequantize(t, scales[key], dtype)
            elif t.is_floating_point():
                t = t.to(dtype)
            yield key, t, header.path
            del t
