"""The 8-bit attention backend ("fp8", off by default: lossy): Q, K, V in e4m3 on Hopper's FP8 tensor cores.

Why: at 1024² cuDNN's bf16 attention takes ~20 ms of a ~90 ms FP8 forward (0.34 ms per layer at 4224
tokens, 648 TFLOP/s); FP8 tensor cores run the two attention GEMMs at up to twice that rate. Two
libraries ship such a kernel, and this module drives either (chosen by `QWENFAST_FP8_ATTENTION` =
auto | cudnn | fa3, read once; auto takes the first that works, in `ENGINE_ORDER`):

- "cudnn": cuDNN's FP8 SDPA (the `sdpa_fp8` node) through the `nvidia-cudnn-frontend` Python package
  (1.32, on torch's own cuDNN). One graph per shape is built once and cached; it runs on torch's
  current stream with a torch-allocated workspace, so CUDA graphs capture it. Scalars only: one
  descale per tensor for Q, K, V; the softmax probabilities P go to e4m3 at scale 256 (descale 1/256).
- "fa3": FlashAttention-3's FP8 forward (`fa3_fwd_interface`, the `fa3-fwd` wheel, or
  `flash_attn_interface`); it takes (batch, head) descales, so Q, K, V get one scale per head.

- "int8": INT8 Q·Kᵀ after K smoothing, with per-block scales, and FP8 P·V (`kernels.attn_int8`, a Triton
  kernel; SageAttention 2's recipe). It takes the bf16 Q, K, V and quantises them itself; it keeps the
  demo's quality gate (see that module) but is slower than bf16 attention on an H100, so not in `auto`;
  `QWENFAST_FP8_ATTENTION=int8` chooses it (on CPU too: the reference then emulates it).
- "sage": the same recipe from SageAttention 2's own CUDA kernel for Hopper
  (`sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90`: warp-specialised wgmma, INT8 Q·Kᵀ with K smoothed,
  FP8 P·V with fp32 + fp32 accumulation), where the `sageattention` package is installed (no wheel on
  PyPI: bench/build_sageattention.py builds it on the GPU machine). bf16 Q, K, V in; on CPU the int8
  engine's reference stands in (the same recipe; Sage's scales are finer).

Each returns bf16 (or the inputs' half type). Quantisation: `kernels.attn_quant.quantize_qkv`
(amax on the GPU, no host sync). Where neither can run the backend says so once (a warning) and
runs cuDNN's bf16 SDPA: no library, a GPU without FP8 tensor cores, a head dim the kernel lacks, or
a padding mask (most calls have none: `trim_padding` drops the padding a batch shares; only a batch
of prompts of different lengths, or batched CFG with a padded negative prompt, keeps one).

On CPU the backend runs `fp8_attention_ref`: the same quantisation, dequantised, then exact SDPA in
fp32, so tests see the quantisation error (not the e4m3 rounding of P, which only the kernels do).

The joint attention of a block (`joint_attention`, from the streams' fused QKV projections) takes a
shorter road, `fp8_joint_attention`: the QK-norm + RoPE kernel writes Q and K in e4m3 itself, at a
descale fixed by the norm gains (`kernels.qk_norm_rope.qk_descale`: a bound, no amax pass), and only
V (written in bf16 by that kernel) goes through `quantize_heads`. Measured on an H200 (bench/results/attention.jsonl,
1024², FP8 forward): quantising Q, K and V after the fact cost 5.2 ms of the 19.1 ms attention.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels.attn_quant import FP8, dequantize, descale_rows, quantize_heads, quantize_qkv, quantize_qkv_ref
from .arch import arch

ENGINES = ("auto", "cudnn", "fa3", "int8", "sage")
ENGINE_ORDER = ("cudnn", "fa3")  # auto: the first that loads and takes the shape
ENV_VAR = "QWENFAST_FP8_ATTENTION"
P_SCALE = 256.0  # cuDNN: softmax probabilities (<= 1) times 256 in e4m3 (2^-9..448): ~2^-17 resolution

_warned: set[str] = set()
_lock = threading.Lock()
CALLS: Counter[str] = Counter()  # eager calls (and captures) per engine / "bf16 fallback: why": for benches


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def fp8_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    per_head: bool = False,
) -> torch.Tensor:
    """quantise -> dequantise -> exact SDPA in fp32 -> q's dtype; q, k, v (B, H, S, D), mask (B, 1, 1, S) bool."""
    q8, k8, v8, d = quantize_qkv_ref(q, k, v, per_head)
    qd, kd, vd = dequantize(q8, d[0]), dequantize(k8, d[1]), dequantize(v8, d[2])
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).to(q.dtype)


# ------------------------------------------------------------------------------------------ cuDNN


def _import_cudnn():
    """`import cudnn` (the frontend) bound to the libcudnn torch already loaded, never a second copy."""
    torch.backends.cudnn.version()  # loads torch's libcudnn.so.9
    lib_dir = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcudnn.so" in line:
                    lib_dir = os.path.dirname(line.split()[-1])
                    break
    except OSError:
        pass
    old = os.environ.get("LD_LIBRARY_PATH")
    if lib_dir:  # the frontend dlopens the first libcudnn.so.9 on LD_LIBRARY_PATH (its __init__)
        os.environ["LD_LIBRARY_PATH"] = lib_dir + (os.pathsep + old if old else "")
    try:
        import cudnn
    finally:
        if lib_dir:
            if old is None:
                os.environ.pop("LD_LIBRARY_PATH", None)
            else:
                os.environ["LD_LIBRARY_PATH"] = old
    return cudnn


class CudnnFP8:
    """cuDNN FP8 SDPA graphs, one per (shape, output dtype, device), built on first use."""

    name = "cudnn"
    per_head = False  # the sdpa_fp8 node takes (1, 1, 1, 1) descales

    def __init__(self) -> None:
        self.cudnn = _import_cudnn()
        self.graphs: dict[tuple, tuple] = {}
        self.handles: dict[int, object] = {}
        self.consts: dict[int, torch.Tensor] = {}
        self.api: dict[
            tuple, str
        ] = {}  # key -> which builder worked and O's dtype, e.g. "pygraph O=bfloat16"

    def version(self) -> str:
        c = self.cudnn
        built = sorted(set(self.api.values()))
        return f"frontend {getattr(c, '__version__', '?')}, cuDNN {c.backend_version_string()}" + (
            f", graphs: {', '.join(built)}" if built else ""
        )

    def _handle(self, dev: int):
        if dev not in self.handles:
            with torch.cuda.device(dev):
                self.handles[dev] = self.cudnn.create_handle()
        return self.handles[dev]

    def _raw_handle(self, dev: int, api: str):
        """The handle as each builder takes it: a `cudnn.Handle`, or the C++ graph's raw cudnnHandle_t."""
        h = self._handle(dev)
        return h if api == "pygraph" else getattr(h, "backend_handle", h)

    def _consts(self, dev: int) -> torch.Tensor:
        """fp32 [descale_s, scale_s, scale_o] on the device (scale_o = 1: the output is not FP8)."""
        if dev not in self.consts:
            c = torch.empty(12, dtype=torch.float32, device=f"cuda:{dev}")  # 16-byte aligned scalars
            c[0], c[4], c[8] = 1.0 / P_SCALE, P_SCALE, 1.0
            self.consts[dev] = c
        return self.consts[dev]

    def _build(self, key: tuple, out_dtype: torch.dtype, dev: int):
        cudnn = self.cudnn
        B, H, S, Skv, D = key[:5]
        cdt = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}
        errors = []
        builders: list[tuple[str, Callable]] = [("pygraph", cudnn.pygraph)]
        backend = getattr(getattr(cudnn, "_pybind_module", None), "backend_graph", None)
        if backend is not None:  # the classic C++ builder, should the python layer decline
            builders.append(("backend_graph", backend))
        # O in the model's dtype, else fp16 (the FP8 output type cuDNN's tests cover; |O| <= max |V|)
        outs = [out_dtype] + ([torch.float16] if out_dtype != torch.float16 else [])
        for (api, make), o_dtype in ((b, o) for b in builders for o in outs):
            odt = cdt[o_dtype]
            try:
                g = make(
                    io_data_type=cudnn.data_type.FP8_E4M3,
                    intermediate_data_type=cudnn.data_type.FLOAT,
                    compute_data_type=cudnn.data_type.FLOAT,
                    handle=self._raw_handle(dev, api),
                )

                def t(uid, dim, stride, dt=cudnn.data_type.FP8_E4M3, g=g):
                    return g.tensor(uid=uid, dim=dim, stride=stride, data_type=dt)

                bshd = (S * H * D, D, H * D, 1)
                kv = (Skv * H * D, D, H * D, 1)
                one, f32 = ((1, 1, 1, 1), (1, 1, 1, 1)), cudnn.data_type.FLOAT
                q, k, v = t(1, (B, H, S, D), bshd), t(2, (B, H, Skv, D), kv), t(3, (B, H, Skv, D), kv)
                dq, dk, dv, ds, ss, so = (t(uid, *one, dt=f32) for uid in (4, 5, 6, 7, 8, 9))
                o, _stats, amax_s, amax_o = g.sdpa_fp8(
                    q=q,
                    k=k,
                    v=v,
                    descale_q=dq,
                    descale_k=dk,
                    descale_v=dv,
                    descale_s=ds,
                    scale_s=ss,
                    scale_o=so,
                    generate_stats=False,
                    attn_scale=1.0 / math.sqrt(D),
                    use_causal_mask=False,
                )
                o.set_uid(10).set_output(True).set_dim((B, H, S, D)).set_stride(bshd).set_data_type(odt)
                for uid, a in ((11, amax_s), (12, amax_o)):
                    a.set_uid(uid).set_output(True).set_dim(one[0]).set_stride(one[1]).set_data_type(f32)
                g.validate()
                g.build_operation_graph()
                g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                g.check_support()
                g.build_plans()
                self.api[key] = f"{api} O={str(o_dtype).removeprefix('torch.')}"
                return g, int(g.get_workspace_size()), o_dtype
            except Exception as e:  # noqa: BLE001 - try the next builder, report all
                errors.append(f"{api} O={o_dtype}: {type(e).__name__}: {str(e)[:400]}")
        raise RuntimeError("cuDNN FP8 SDPA graph not supported: " + " | ".join(errors))

    def __call__(self, q8, k8, v8, desc, out_dtype: torch.dtype) -> torch.Tensor:
        B, H, S, D = q8.shape
        Skv = k8.shape[2]
        dev = q8.device.index if q8.device.index is not None else torch.cuda.current_device()
        key = (B, H, S, Skv, D, out_dtype, dev)
        entry = self.graphs.get(key)
        if entry is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"cuDNN FP8 SDPA graph for {key} must be built before CUDA graph capture")
            with _lock:
                entry = self.graphs.get(key) or self._build(key, out_dtype, dev)
                self.graphs[key] = entry
        g, ws_size, o_dtype = entry
        handle = self._handle(dev)
        self.cudnn.set_stream(handle, torch.cuda.current_stream(q8.device).cuda_stream)
        out = torch.empty(B, S, H, D, dtype=o_dtype, device=q8.device).transpose(1, 2)  # BSHD storage
        scratch = torch.empty(8, dtype=torch.float32, device=q8.device)
        c = self._consts(dev)
        ws = torch.empty(max(ws_size, 1), dtype=torch.uint8, device=q8.device)
        pack = {
            1: q8,
            2: k8,
            3: v8,
            4: desc[0, 0, :1],
            5: desc[1, 0, :1],
            6: desc[2, 0, :1],
            7: c[0:1],
            8: c[4:5],
            9: c[8:9],
            10: out,
            11: scratch[0:1],
            12: scratch[4:5],
        }
        pack = {uid: t.data_ptr() for uid, t in pack.items()}
        if self.api[key].startswith("pygraph"):
            g.execute(pack, ws, handle=handle)
        elif hasattr(g, "execute"):  # the classic C++ graph
            g.execute(pack, ws.data_ptr(), handle=self._raw_handle(dev, "backend_graph"))
        else:  # 1.32's internal C++ graph: what pygraph.execute itself calls
            g._execute(pack, ws.data_ptr(), self._raw_handle(dev, "backend_graph"), None, None, None)
        return out if o_dtype == out_dtype else out.to(out_dtype)  # strides kept (BSHD)


# ------------------------------------------------------------------------------------------ FA3


def _import_fa3():
    for name in ("fa3_fwd_interface", "flash_attn_interface"):
        try:
            return __import__(name)
        except Exception:  # noqa: BLE001 - not installed, or built for another torch
            continue
    raise ImportError("no FlashAttention-3 module (pip install fa3-fwd, or flash-attn's hopper build)")


class FA3FP8:
    """FlashAttention-3's FP8 forward: e4m3 (B, S, H, D) in, bf16 out, (B, H) descales."""

    name = "fa3"
    per_head = True

    def __init__(self) -> None:
        self.mod = _import_fa3()

    def version(self) -> str:
        return f"{self.mod.__name__} {getattr(self.mod, '__version__', '')}".strip()

    def __call__(self, q8, k8, v8, desc, out_dtype: torch.dtype) -> torch.Tensor:
        out = self.mod.flash_attn_func(
            q8.transpose(1, 2),
            k8.transpose(1, 2),
            v8.transpose(1, 2),
            q_descale=desc[0],
            k_descale=desc[1],
            v_descale=desc[2],
        )
        out = out[0] if isinstance(out, tuple) else out  # (B, S, H, D) bf16
        return out.transpose(1, 2).to(out_dtype)


class ReferenceFP8:
    """What the engines compute, in torch (the CPU's engine for the joint path): dequantise, exact SDPA
    in fp32 (no e4m3 rounding of P), the model's dtype out; takes a padding mask."""

    name = "reference"
    per_head = False

    def __call__(
        self, q8, k8, v8, desc, out_dtype: torch.dtype, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        qd, kd, vd = (dequantize(x, d) for x, d in zip((q8, k8, v8), desc))
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).to(out_dtype)


class Int8Sage:
    """`kernels.attn_int8`: bf16 Q, K, V in (it quantises them itself), bf16 out; needs Triton."""

    name = "int8"
    takes_bf16 = True  # `run(q, k, v)`, not the e4m3 inputs of the other engines

    def __init__(self) -> None:
        from ..kernels import triton_available

        if not triton_available():
            raise ImportError("the int8 attention kernel needs triton")

    def version(self) -> str:
        import triton

        return f"qwenfast attn_int8 (triton {triton.__version__})"

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from ..kernels.attn_int8 import attention_int8

        return attention_int8(q, k, v)


class SageFP8:
    """SageAttention 2's Hopper kernel (`sageattention`, built from source): bf16 Q, K, V in (it smooths
    and quantises them itself: INT8 Q and K per thread's rows, FP8 V per channel), bf16 out."""

    name = "sage"
    takes_bf16 = True

    def __init__(self) -> None:
        import sageattention

        self.mod = sageattention
        self.fn = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90", None)
        if self.fn is None or not getattr(sageattention.core, "SM90_ENABLED", False):
            raise ImportError("sageattention is installed without its sm_90 kernel (build it with sm_90a)")

    def version(self) -> str:
        return f"sageattention {getattr(self.mod, '__version__', '')} sm90".replace("  ", " ")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, H, S, D) views of the model's (B, S, H, D) buffers: "NHD" reads them as they are
        out = self.fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            tensor_layout="NHD",
            is_causal=False,
            qk_quant_gran="per_thread",
            pv_accum_dtype="fp32+fp32",
            smooth_k=True,
        )
        return out.transpose(1, 2)


_FACTORIES: dict[str, Callable[[], object]] = {
    "cudnn": CudnnFP8,
    "fa3": FA3FP8,
    "int8": Int8Sage,
    "sage": SageFP8,
}
REFERENCE = ReferenceFP8()
_engines: dict[str, object] = {}
_engine_errors: dict[str, str] = {}


def load_engine(name: str):
    """The engine object for "cudnn" / "fa3" (loaded once), or None with the reason in `engine_error`."""
    if name not in _engines and name not in _engine_errors:
        try:
            _engines[name] = _FACTORIES[name]()
        except Exception as e:  # noqa: BLE001 - missing library, wrong build: reported, not raised
            _engine_errors[name] = f"{type(e).__name__}: {e}"
    return _engines.get(name)


def engine_error(name: str) -> str | None:
    return _engine_errors.get(name)


def engine_names(device: torch.device | None = None) -> tuple[str, ...]:
    """The engines to try, in order: `ENGINE_ORDER` for auto, else the one chosen; FA3's only where the
    arch table says its kernels run (`device`'s architecture; None: the current GPU's)."""
    choice = engine_choice()
    names = ENGINE_ORDER if choice == "auto" else (choice,)
    return tuple(n for n in names if n != "fa3" or arch(device).fa3)


def engine_choice() -> str:
    name = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if name not in ENGINES:
        raise ValueError(f"{ENV_VAR}={name!r}: choose one of {ENGINES}")
    return name


def run_engine(engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Quantise (per head where the engine takes it) and run one FP8 engine; (B, H, S, D) out."""
    if getattr(engine, "takes_bf16", False):
        return engine.run(q, k, v)
    q8, k8, v8, desc = quantize_qkv(q, k, v, per_head=engine.per_head)
    return engine(q8, k8, v8, desc, q.dtype)


def _why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    if not q.shape == k.shape == v.shape:
        return f"shapes {tuple(q.shape)} {tuple(k.shape)} (needs equal shapes)"
    return _why_not_meta(q.dtype, q.device, q.shape[-1], mask)


def _why_not_meta(
    dtype: torch.dtype, device: torch.device, head_dim: int, mask: torch.Tensor | None
) -> str | None:
    if mask is not None:
        return "a padding mask (the FP8 kernels take none here)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} inputs (FP8 attention is for bf16/fp16 models)"
    if not arch(device).fp8_attention:
        return (
            f"{arch(device).name}, without FP8 attention kernels (cuDNN's FP8 SDPA runs on sm_90 and sm_100)"
        )
    if not (head_dim % 16 == 0 and head_dim <= 256):
        return f"head dim {head_dim} (needs d % 16 == 0, d <= 256)"
    return None


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    fallback: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The "fp8" backend: CPU -> the reference; CUDA -> an FP8 engine, or `fallback(q, k, v, mask)`
    (cuDNN bf16) with a one-time warning saying why."""
    if not q.is_cuda:
        if engine_choice() in ("int8", "sage"):  # sage: the same recipe (its scales are finer)
            from ..kernels.attn_int8 import attention_int8_ref

            CALLS["cpu reference (int8)"] += 1
            return attention_int8_ref(q, k, v, mask)
        CALLS["cpu reference"] += 1
        return fp8_attention_ref(q, k, v, mask)
    why = _why_not(q, k, v, mask)
    if why is not None:
        CALLS["bf16 fallback: " + why] += 1
        _warn_once(why, f"attention='fp8': {why}; running cuDNN bf16 attention for these calls")
        return fallback(q, k, v, mask)
    names = engine_names(q.device)
    for name in names:
        eng = load_engine(name)
        if eng is None:
            continue
        key = (name, tuple(q.shape), q.dtype)
        if key in _engine_errors:
            continue
        try:
            out = run_engine(eng, q, k, v)
            CALLS[name] += 1
            return out
        except Exception as e:  # noqa: BLE001 - unsupported shape/build: next engine, said once
            if torch.cuda.is_current_stream_capturing():
                raise  # a capture must fail loudly (the graph runner then runs eagerly and warns)
            _engine_errors[key] = f"{type(e).__name__}: {e}"
            _warn_once(str(key), f"attention='fp8': the {name} FP8 engine failed on {tuple(q.shape)}: {e}")
    reasons = "; ".join(f"{n}: {engine_error(n) or 'failed on this shape'}" for n in names)
    CALLS["bf16 fallback: no engine"] += 1
    _warn_once(
        "none:" + reasons,
        f"attention='fp8': no FP8 attention engine ({reasons}); running cuDNN bf16 attention",
    )
    return fallback(q, k, v, mask)


# ------------------------------------------------------------------------ the fused joint path

_qk_descales = WeakIdKeyDictionary()  # first Q gain -> {(ids, versions): (2,) descales}


def _qk_descale_pair(q_gains: list[torch.Tensor], k_gains: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """fp32 (2,) [Q descale, K descale] of a joint buffer (`qk_descale` of its streams' gains), computed
    once per set of gains and kept while they live and are unchanged (their `_version`: an in-place
    edit, e.g. a LoRA merged into a norm, recomputes it). Never cached from inside a CUDA-graph capture:
    a captured computation has not run yet (its value exists only when the graph replays)."""
    from ..kernels.qk_norm_rope import qk_descale

    def compute() -> torch.Tensor:
        return torch.cat([qk_descale(q_gains, head_dim), qk_descale(k_gains, head_dim)])

    # the device too: a block moved (or streamed) to another device keeps its parameter objects
    key = tuple((id(w), w._version) for w in q_gains + k_gains) + (head_dim, q_gains[0].device)
    if q_gains[0].is_cuda and torch.cuda.is_current_stream_capturing():
        entry = _qk_descales.get(q_gains[0], {}).get(key)
        return entry if entry is not None else compute()
    entries = _qk_descales.setdefault(q_gains[0], {})
    if key not in entries:
        for k in [k for k in entries if k[-1] == key[-1]]:
            del entries[k]  # the gains changed on this device: the old value is stale
        entries[key] = compute()
    return entries[key]


def joint_engine(x: torch.Tensor, head_dim: int, mask: torch.Tensor | None):
    """The engine of a fused joint call on `x`'s device: the torch reference on CPU; on CUDA the engine
    `fp8_attention` would pick, or None (no engine, a mask, ...: the caller takes the plain path,
    which falls back to bf16 and says why)."""
    if not x.is_cuda:
        # int8, sage: `fp8_attention` emulates them (on the plain path)
        return None if engine_choice() in ("int8", "sage") else REFERENCE
    if _why_not_meta(x.dtype, x.device, head_dim, mask) is not None:
        return None
    for name in engine_names(x.device):
        eng = load_engine(name)
        if eng is not None and getattr(eng, "takes_bf16", False):
            return None  # it quantises bf16 Q, K, V itself: the plain path brings them
        if eng is not None and (name, "joint") not in _engine_errors:
            return eng
    return None


def fp8_joint_attention(
    streams: list[tuple],
    heads: int,
    head_dim: int,
    mask: torch.Tensor | None,
    fallback: Callable[..., torch.Tensor],
) -> torch.Tensor | None:
    """`joint_attention` with 8-bit attention: Q and K written in e4m3 by the QK-norm + RoPE kernel at
    their bound descales, V in the model's dtype then `quantize_heads`, one FP8 engine call -> (B, H,
    S, D). None where no engine takes it (the caller then runs the plain path). An engine that fails
    is not asked again; this call then runs `fallback` (cuDNN bf16) on the dequantised Q, K."""
    from ..kernels.qk_norm_rope import joint_qkv

    qkv0 = streams[0][0]
    eng = joint_engine(qkv0, head_dim, mask)
    if eng is None:
        return None
    B, H, D = qkv0.shape[0], heads, head_dim
    dqk = _qk_descale_pair([st[1] for st in streams], [st[2] for st in streams], D)  # (2,)
    q8, k8, v = joint_qkv(streams, H, D, qk_dtype=FP8, descale_qk=dqk)  # (B, H, S, D); v in the model's dtype
    S = q8.shape[2]
    desc = descale_rows(3, B, H, qkv0.device)  # (3, B*H): Q, K (the bounds), V (its amax)
    desc[:2] = dqk[:, None]
    v8, _ = quantize_heads(v, eng.per_head, desc[2])
    desc = desc.view(3, B, H)
    if eng is REFERENCE:
        CALLS["cpu reference (joint)"] += 1
        return eng(q8, k8, v8, desc, qkv0.dtype, mask)
    try:
        out = eng(q8, k8, v8, desc, qkv0.dtype)
    except Exception as e:  # noqa: BLE001 - said once, then the bf16 path for this and later calls
        if qkv0.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _engine_errors[(eng.name, "joint")] = f"{type(e).__name__}: {e}"
        _warn_once(
            f"joint:{eng.name}",
            f"attention='fp8': the {eng.name} FP8 engine failed on the joint "
            f"attention {(B, H, S, D)}: {e}; running cuDNN bf16 attention",
        )
        CALLS["bf16 fallback: engine failed"] += 1
        return fallback(dequantize(q8, desc[0]).to(v.dtype), dequantize(k8, desc[1]).to(v.dtype), v, mask)
    CALLS[eng.name + " (joint)"] += 1
    return out
