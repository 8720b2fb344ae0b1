"""The "which GPU" tables (docs/gpus.md): what was measured here, beside estimates for the cards people own.

Measured rows come from records (an H100 / H200 only). Estimated rows come from a stated model and are
labelled as such, never as measurements:

    forward time >= max(GEMM FLOPs / the card's spec rate for the GEMM precision
                        + attention FLOPs / its bf16 rate,
                        weight bytes that do not fit / PCIe 4.0 x16 (25 GB/s))

with the FLOPs of `TransformerConfig.flops_per_forward` (1024², 128 text tokens), the spec rates of
runtime/arch.py's representative cards (dense, fp32 accumulation where a card has two rates), and the
weight bytes of `ModelSizes.qwen_image` less the modulation Linears (read once per sampling schedule by
the modulation table, not once per forward). It is a floor: the H100's measured row says how far above it a
real forward lands (the same ratio is a fair first guess for the other cards).
"""

from __future__ import annotations

from .records import Rec
from .report_tables import gpu_name, is_default, ms, newest, source, table

PCIE_GBS = 25.0  # PCIe 4.0 x16, achieved host -> GPU
VRAM_GB = {"A100 SXM": 80, "RTX 3090": 24, "RTX 4090": 24, "H100 SXM": 80, "B200": 180, "RTX 5090": 32}
ACTIVATIONS_GB = (
    3.0  # 1024² forward's activations, CUDA graph pool and workspace (memory planner, rounded up)
)


def _split_flops() -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one 1024² forward with 128 text tokens."""
    from ..config import TransformerConfig

    cfg = TransformerConfig()
    attn = cfg.attention_flops(4096, 128)
    return cfg.flops_per_forward(4096, 128) - attn, attn


def _weights_gb(path: str) -> float:
    """Transformer weights a forward reads from GPU memory: all but the modulation Linears (the modulation
    table computes their rows once per sampling schedule; on a card they do not fit they stay in host
    memory), the blocks' big Linears (24 d² per block) in one byte on the 8-bit paths, the rest in bf16."""
    from ..runtime.memory import ModelSizes

    s = ModelSizes.qwen_image()
    total = (s.transformer - s.num_blocks * s.block_modulation) / 1e9  # bf16
    if path == "bf16":
        return total
    linears = s.num_blocks * 24 * s.dim * s.dim / 1e9  # params = bytes at 8 bits
    return total - linears  # their 2 bf16 bytes each become 1


def estimate(card: str, rates: dict[str, float], path: str) -> dict:
    gemm, attn = _split_flops()
    compute_ms = (gemm / (rates[path] * 1e12) + attn / (rates["bf16"] * 1e12)) * 1e3
    over = max(0.0, _weights_gb(path) + ACTIVATIONS_GB - VRAM_GB[card])
    stream_ms = over / PCIE_GBS * 1e3
    return {
        "compute_ms": compute_ms,
        "over_gb": over,
        "stream_ms": stream_ms,
        "ms": max(compute_ms, stream_ms),
    }


def gpu_estimates(recs: list[Rec]) -> str:
    """Measured 1024² forwards (H100 / H200 records), then the model's floor for each architecture's card."""
    from ..runtime.arch import ARCHS

    body, used = [], []
    t = newest(
        recs,
        "transformer.jsonl",
        lambda r: "1024" in r.get("sizes", {}) and "H100" in gpu_name(r) and is_default(r),
    )
    i8 = newest(
        recs,
        "int8.jsonl",
        lambda r: r.get("bench") == "transformer" and "H100" in gpu_name(r) and is_default(r),
    )
    measured = {}
    if t:
        v = t["sizes"]["1024"]["variants"]
        measured["bf16"] = v.get("qwenfast fused + CUDA graph + modulation table", {}).get("ms")
        measured["fp8"] = v.get("qwenfast FP8 + CUDA graph + modulation table", {}).get("ms")
        used.append(t)
    if i8:
        measured["int8"] = (
            i8["sizes"]["1024"]["variants"].get("qwenfast INT8 + CUDA graph + modulation table", {}).get("ms")
        )
        used.append(i8)
    h100 = ARCHS["sm_90"]
    for path in ("bf16", "fp8", "int8"):
        if measured.get(path) is None:
            continue
        floor = estimate(h100.card, h100.rates, path)["ms"]
        body.append(
            [
                "H100 80GB HBM3 (sm_90)",
                path,
                "**measured**",
                ms(measured[path]),
                f"{measured[path] / floor:.2f}× its floor",
                "resident",
            ]
        )
    for a in ARCHS.values():
        for path in ("bf16", "fp8", "int8"):
            if path not in a.rates:
                continue
            e = estimate(a.card, a.rates, path)
            where = "resident" if not e["over_gb"] else f"{e['over_gb']:.1f} GB over: streamed each forward"
            body.append(
                [
                    f"{a.card} ({a.name}, {VRAM_GB[a.card]} GB)",
                    path,
                    "estimate (floor)",
                    ms(e["ms"]),
                    f"compute {ms(e['compute_ms'])}"
                    + (f", PCIe {ms(e['stream_ms'])}" if e["over_gb"] else ""),
                    where,
                ]
            )
    head = ["card", "GEMM precision", "kind", "1024² forward", "how", "transformer weights"]
    cmd = "bash bench/transformer.sh; qwenfast bench transformer --no-compile --int8 (INT8 row)"
    return table(head, body) + source(used, cmd)


PARTS = (  # profile_forward's kernel categories -> the table's parts (the floor: their FLOPs at a spec rate)
    (("gemm",), "matrix products (the blocks' FP8 GEMMs; a few bf16 ones)", "fp8"),
    (("attention",), "attention (bf16: FlashAttention-3, else cuDNN)", "bf16"),
    (
        ("norm", "gelu", "qk_norm_rope", "quant", "other"),
        "LayerNorm + modulation, gated residuals, GELU, QK-norm + RoPE, quantisation",
        None,
    ),
)


def forward_split(recs: list[Rec]) -> str:
    """Where one 1024² FP8 forward's GPU time goes (`bench/profile_forward.py`, the newest default record
    of an H100 / H200), each part beside its floor (`_split_flops` at the sm_90 spec rates), and the
    forward's time back to back against after an idle pause: the SM clock a sustained load holds."""
    r = newest(
        recs,
        "profile_forward.jsonl",
        lambda r: (
            r.get("bench") == "profile_forward"
            and r.get("size") == 1024
            and r.get("gelu") == "sigmoid"
            and r.get("spaced_ms") is not None
            and is_default(r)
            and ("H100" in gpu_name(r) or "H200" in gpu_name(r))
        ),
    )
    if r is None:
        return "*No record yet: `python bench/profile_forward.py`.*"
    from ..runtime.arch import ARCHS

    rates = ARCHS["sm_90"].rates
    gemm, attn = _split_flops()
    flops = {"fp8": gemm, "bf16": attn}  # the part's FLOPs by the rate they run at
    cats = r["by_category_ms"]
    rows = []
    for keys, label, rate in PARTS:
        t = sum(cats.get(k, 0.0) for k in keys)
        if rate is None:
            rows.append([label, ms(t), "", "bound by memory traffic and instructions (not modelled)"])
            continue
        floor = flops[rate] / (rates[rate] * 1e12) * 1e3
        how = f"{flops[rate] / 1e12:.1f} TFLOP at the {rate} dense spec rate ({rates[rate]:g} TFLOP/s)"
        rows.append([label, ms(t), ms(floor), f"{how}: {flops[rate] / t / 1e9:.0f} TFLOP/s reached"])
    floor = estimate(ARCHS["sm_90"].card, rates, "fp8")["compute_ms"]  # the gpu-estimates table's floor
    clk, watts, capped = r["sm_clock_mhz_in_loop"], r.get("power_w_in_loop"), r.get("power_capped_share")
    held = (
        f"sampled while they ran: SM clock median {clk['median']} MHz (max {clk['max']}), power median "
        f"{watts['median']:.0f} W, the power cap holding the clock in {capped:.0%} of the samples"
        if watts and capped is not None
        else f"SM clock sampled while they ran: {clk['min']}-{clk['max']} MHz, median {clk['median']}"
    )
    rows += [
        ["idle between kernels", ms(r["gap_ms"]), "", f"{r['kernels']} kernels in one CUDA graph"],
        ["one forward after 0.3 s idle", ms(r["spaced_ms"]), ms(floor), "each forward timed after a pause"],
        [
            "forwards back to back",
            ms(r["wall_ms"]),
            ms(floor),
            held,
        ],
    ]
    head = ["1024² FP8 forward, 128 text tokens", "GPU time", "floor", "how"]
    return table(head, rows) + source([r], "python bench/profile_forward.py --results bench/results")


def gpu_played(recs: list[Rec]) -> str:
    """1024² forwards on an H100 told by QWENFAST_ARCH to choose as another card would: which paths that
    card gets (FP8 weights run weight-only without FP8 GEMMs), timed on Hopper's units, not that card's."""
    rows, used = [], []
    rs = [r for r in recs if r.file == "int8.jsonl" and (r.get("env") or {}).get("QWENFAST_ARCH")]
    names = {
        "qwenfast fused + CUDA graph + modulation table": "bf16",
        "qwenfast FP8 + CUDA graph + modulation table": "FP8 weights (weight-only: widened to bf16 per call)",
        "qwenfast INT8 + CUDA graph + modulation table": "INT8 W8A8",
    }
    for path, label in names.items():
        r = max(
            (r for r in rs if path in r["sizes"]["1024"]["variants"]),
            key=lambda r: str(r.get("date")),
            default=None,
        )
        if r is None:
            continue
        used.append(r)
        rows.append(
            [
                f"{gpu_name(r)} as {r['env']['QWENFAST_ARCH']}",
                label,
                ms(r["sizes"]["1024"]["variants"][path]["ms"]),
            ]
        )
    if not rows:
        return "*No record yet: `QWENFAST_ARCH=sm_86 qwenfast bench transformer --no-compile --int8`.*"
    cmd = "QWENFAST_ARCH=sm_86 qwenfast bench transformer --no-compile --int8 --results bench/results"
    return table(["GPU (choosing as)", "transformer blocks' GEMMs", "1024² forward"], rows) + source(
        used, cmd
    )


def memory_tiers(recs: list[Rec]) -> str:
    """`--vram N` measured: full-size Qwen-Image with FP8 weights, one fresh process per memory cap on an
    H100 (`set_per_process_memory_fraction`), against the uncapped resident run of the same record."""
    r = newest(recs, "tiers.jsonl", lambda r: any(row.get("cap_gib") is None for row in r["rows"]))
    if r is None:  # (a run without its uncapped row has no "x resident": `--no-resident` runs are left out)
        return "*No record yet: `qwenfast bench tiers --caps 24,16,12,8 --results bench/results`.*"
    rows = []
    for row in r["rows"]:
        cap = row.get("cap_gib")
        for name, label in (("4", "4 steps, no CFG"), ("50", "50 steps, CFG 4")):
            c = row.get(name) or {}
            if "s" not in c:
                if "error" in c:
                    rows.append(
                        [f"{cap:g} GiB" if cap else "resident", label, c["error"][:60], "", "", "", ""]
                    )
                continue
            plan = row.get("plan") or {}
            where = (
                "all resident"
                if not plan
                else f"{plan['resident_blocks']}/60 blocks, {plan['te_resident_layers']}/28 TE layers"
            )
            rows.append(
                [
                    f"{cap:g} GiB" if cap else "resident",
                    label,
                    where,
                    f"{c['s']:.2f} s ({c.get('x_resident', 1):.2f}x)",
                    f"{c['same_prompt_s']:.2f} s ({c.get('same_prompt_x_resident', 1):.2f}x)",
                    f"{c['peak_gib']:.2f} / {c['predicted_gib']:.2f} ({c['prediction_err']:+.1%})",
                    f"{c['block_gb'] + c['text_encoder_gb']:.0f}",
                ]
            )
    head = ["cap", "workload", "plan", "new prompt", "same prompt", "peak / planned GiB", "host->GPU GB"]
    cmd = "qwenfast bench tiers --caps 24,16,12,8 --results bench/results"
    return table(head, rows) + source([r], cmd)


def memory_tiers_held(recs: list[Rec]) -> str:
    """The planner against what a capped process holds once CUDA graphs replay streamed forwards: the
    timed calls' peak allocation plus the graph pool (which holds the denoise activations from the
    capture on), against the plan that counts the pool; newest record per cap that measured it."""
    rows, used = [], []
    for cap in (24.0, 16.0, 12.0, 8.0):
        r = newest(
            recs,
            "tiers.jsonl",
            lambda r: any(
                row.get("cap_gib") == cap and "held_peak_gib" in (row.get("4") or {}) for row in r["rows"]
            ),
        )
        if r is None:
            continue
        used.append(r)
        row = next(x for x in r["rows"] if x.get("cap_gib") == cap)
        for name, label in (("4", "4 steps, no CFG"), ("50", "50 steps, CFG 4")):
            c = row.get(name) or {}
            if "held_peak_gib" in c:
                rows.append(
                    [
                        f"{cap:g} GiB",
                        label,
                        f"{c['peak_gib']:.2f}",
                        f"{c['graph_pool_gib']:.2f} / {c['planned_graph_pool_gib']:.2f}",
                        f"{c['held_peak_gib']:.2f} / {c['predicted_held_gib']:.2f} ({c['held_prediction_err']:+.1%})",
                        "tiled" if c.get("vae_tiled") else "untiled",
                    ]
                )
    if not rows:
        return "*No record yet: `qwenfast bench tiers --caps 8 --no-resident --results bench/results`.*"
    head = ["cap", "workload", "peak allocated GiB", "graph pool / planned GiB", "held / planned GiB", "VAE"]
    return table(head, rows) + source(
        used, "qwenfast bench tiers --caps 8 --no-resident --results bench/results"
    )
