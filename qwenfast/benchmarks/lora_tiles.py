"""Tile sweep of the per-row LoRA kernels (qwenfast/kernels/lora_rows.py) on the image stream's four layer
shapes at 1024², batch 4, each row its own rank-64 LoRA (the fused qkv stack: rank 192 in three column
blocks), FP8 input codes as the FP8 path feeds the shrink. Prints each tile's time per block (the four
layers summed) and the expand's rate counting one read and one write of each output; the shrink with K
split for more programs (`TILES["programs"]`) and each layer's rate at the fastest tiles; then, with --rows,
`qwenfast bench serve --workload rows` (fp8 and bf16, or --weights) at the fastest tiles (`STAGE=tiles bash
bench/serve.sh`). --expand / --shrink take other tile lists ("BM BN BR warps stages, ..." for the expand).

    python -m qwenfast.benchmarks.lora_tiles [--rows --lora-folder .bench_loras --results bench/results]

Tried and taken out (commit dd7437f): an expand whose programs walk a run of columns with the next tile of y
loaded before the current one's products (two tiles in flight). H100, the four layers per block: 1.02 ms
at its best tile (64 x 128 x 64, 8 warps, 1024 columns a program) against 0.81 ms for `_expand_kernel`.
And (commit 324c769) each row's column-block ranges gathered by the launcher, so that the qkv stack's
expand loads them with the row's slots, one dependent load less before its products: 0.814 ms per block
against 0.811 without, no faster (the qkv expand still ~1.66 TB/s).

A Hopper GPU; about 2 minutes without --rows. An analysis tool: the tiles it finds go into `TILES` by
hand, after `test_default_tiles_do_not_spill` (ptxas, no GPU) says they compile without spills.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..kernels import lora_rows as LR

B, L, SLOTS = 4, 4096, 9
SHAPES = [(3072, 9216, 192, 3), (3072, 3072, 64, 1), (3072, 12288, 64, 1), (12288, 3072, 64, 1)]  # K, N, R, G


def _tiles(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in t.split()) for t in text.split(",")]


# expand: (BM, BN, BR, warps, stages); shrink: (BM, BK, warps, stages, BR max)
EXPAND = _tiles(
    "128 128 32 8 3, 64 64 32 8 3, 64 64 32 4 3, 32 128 32 8 3, 32 128 32 4 3, 64 128 32 4 3, 64 128 32 8 3,"
    "64 128 64 8 3, 128 64 32 4 3, 64 256 32 8 3, 128 256 32 8 3, 64 64 64 4 2, 64 128 32 4 4,"
    "64 128 32 8 3 128, 64 128 32 4 3 128, 64 64 32 4 3 128"  # (a register cap: two programs an SM)
)
SHRINK = _tiles(
    "128 64 8 3 64, 64 64 4 3 64, 64 128 4 3 64, 128 128 8 3 64, 128 64 4 4 64, 128 64 8 4 128, 64 128 4 4 128,"
    "128 128 8 3 128, 64 64 4 4 64, 256 64 8 3 64"
)


def layers(dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for K, N, R, G in SHAPES:
        down = torch.randn(SLOTS, R, K, device=dev, generator=g).bfloat16() * 0.02
        up = torch.randn(SLOTS, N, R, device=dev, generator=g).bfloat16() * 0.02
        rr = torch.tensor([[(i * R // G, (i + 1) * R // G) for i in range(G)]] * SLOTS, dtype=torch.int32)
        x = torch.randn(B, L, K, device=dev, generator=g).to(torch.float8_e4m3fn)
        xs = torch.rand(B, L, device=dev, generator=g) * 0.01
        y = torch.randn(B, L, N, device=dev, generator=g).bfloat16()
        h = torch.empty(B, L, R, device=dev, dtype=torch.bfloat16)
        out.append((down, up, rr.to(dev) if G > 1 else None, x, xs, y, h))
    return out


def programs_sweep(data, idx, scale, tiles, bench) -> list:
    """The shrink at `tiles` with K split until it launches at least half of `programs` (the image stream's
    fc2 layer is 128 programs at batch 4 unsplit: fewer than an H100's 132 SMs, one program each); ms per
    block. [[tile, programs, ms], ...]"""
    out = []
    print(f"{'shrink tile':32} programs  ms/block")
    for tile in dict.fromkeys(tiles):
        for programs in (200, 528, 1056):
            LR.TILES.update(shrink=tile, programs=programs)
            ms = sum(
                bench(lambda d=d: LR._shrink(d[3], d[0], idx, scale, d[6], d[4]), warmup=10, rep=60)
                for d in data
            )
            out.append([list(tile), programs, round(ms, 3)])
            print(f"{str(tile):32} {programs:8}  {ms:8.3f}")
    return out


def per_layer(data, idx, scale, bench) -> list:
    """Each layer at the tiles now in `TILES`: the expand's and the shrink's ms and the rate at which they
    move their bytes (the expand reads and writes y; the shrink reads the e4m3 codes of x), TB/s: which
    layer sits furthest below the memory's rate."""
    out = []
    print(f"{'layer (K, N, R)':22} expand ms  TB/s   shrink ms  TB/s")
    for (K, N, R, _), (down, up, rr, x, xs, y, h) in zip(SHAPES, data):
        e = bench(lambda: LR._expand(h, up, idx, y, rr), warmup=10, rep=60)
        sh = bench(lambda: LR._shrink(x, down, idx, scale, h, xs), warmup=10, rep=60)
        eb, sb = 2 * y.numel() * y.element_size(), x.numel() * x.element_size()
        out.append([[K, N, R], round(e, 4), round(eb / e / 1e9, 2), round(sh, 4), round(sb / sh / 1e9, 2)])
        print(f"{str((K, N, R)):22} {e:9.4f}  {eb / e / 1e9:4.2f}   {sh:9.4f}  {sb / sh / 1e9:4.2f}")
    return out


# fused FP8 GEMM: (BM, BN, BK, warps, stages, GROUP_M, BR, programs per SM (0: one a tile), halved stores)
GEMM = _tiles(
    "128 256 128 8 3 16 16 1 1, 128 256 128 8 3 8 16 1 1, 128 256 128 8 3 4 16 1 1, 128 256 128 8 3 8 32 1 1,"
    "128 256 128 8 4 8 16 1 1, 128 256 128 8 3 16 16 0 0"
)


def _gemm_tiles(text: str) -> list[tuple[int, ...]]:
    """--gemm's tiles, so that the commands of earlier records still parse: seven numbers are one program a
    tile (P 0, SUB 0: all there was before commit 90056f6; its 4-stage tiles no longer fit the shared
    memory of the kernel's tile loop, and the sweep leaves out a tile that does not launch); a tenth (the
    flattened loops, measured slower and taken out after commit 682d9fb) may be 0, which every tile now is."""
    tiles = [t + (0, 0) if len(t) == 7 else t for t in _tiles(text)]
    for t in tiles:
        if len(t) not in (9, 10) or (len(t) == 10 and t[9]):
            raise argparse.ArgumentTypeError(
                f"{t}: 9 numbers (a tenth 1, the flattened loops, was taken out)"
            )
    return [t[:9] for t in tiles]


SHRINK_TMA = _tiles("128 128 8 3 64, 64 128 4 4 64, 128 256 8 3 64, 64 256 4 3 64, 128 128 4 4 64")


def shrink_tma_sweep(tiles, bench) -> dict:
    """The shrink of the e4m3 codes through TMA descriptors (`TILES["shrink_tma"]`) against the pointer
    kernel at its default tile, on the image stream's four layers: ms per block (each layer's too), the
    fastest kept in `TILES` if it beats the pointer kernel."""
    data, idx = layers(), torch.arange(1, B + 1, device="cuda").view(B, 1)
    scale = torch.ones(B, 1, device="cuda")

    def per_layer():
        return [bench(lambda d=d: LR._shrink(d[3], d[0], idx, scale, d[6], d[4])) for d in data]

    LR.TILES["shrink_tma"] = None
    out = {"pointer": [round(v, 4) for v in per_layer()], "tma": []}
    for t in tiles:
        LR.TILES["shrink_tma"] = t
        try:
            out["tma"].append([list(t), [round(v, 4) for v in per_layer()]])
        except Exception as e:  # (a tile that does not compile or fit: out of the sweep)
            print(f"  shrink tile {t}: {type(e).__name__}: {str(e)[:200]}")
    blk = lambda v: round(sum(v), 4)  # noqa: E731
    best = min(out["tma"], key=lambda r: blk(r[1]), default=None)
    print(f"shrink per block: pointer {blk(out['pointer']):.4f} ms {out['pointer']}")
    for t, v in out["tma"]:
        print(f"  TMA {str(tuple(t)):28} {blk(v):.4f} ms {v}")
    LR.TILES["shrink_tma"] = tuple(best[0]) if best and blk(best[1]) < blk(out["pointer"]) else None
    out["chosen"] = LR.TILES["shrink_tma"]
    return out


def gemm_sweep(tiles, bench) -> dict:
    """The FP8 GEMM with the update in its epilogue (kernels/fp8_lora_gemm.py) against cuBLASLt's
    (`torch._scaled_mm`, rowwise scales, bias) followed by the expand, on the image stream's four layers
    (batch 4, 1024², each row its own rank-64 LoRA; the shrink, the same in both, left out): per layer ms
    and TFLOP/s, per block the sums, each tile also without a LoRA (the GEMM's own rate against cuBLAS's).
    Checks the fused output against the pair's (relative error, FP8's bf16 rounding)."""
    from ..kernels import fp8_lora_gemm as F

    g = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.arange(1, B + 1, device="cuda").view(B, 1)
    M, out = B * L, {"layers": [], "tiles": [list(t) for t in tiles]}
    print(
        f"{'layer (K, N, R)':20} cuBLAS ms  TFLOP/s  +expand ms   "
        + "  ".join(f"tile{i} lora/none" for i in range(len(tiles)))
    )
    for K, N, R, G in SHAPES:
        x8 = (torch.randn(M, K, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        w8 = (torch.randn(N, K, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        sx = torch.rand(M, 1, device="cuda", generator=g) * 1e-3
        sw = torch.rand(N, 1, device="cuda", generator=g) * 1e-3
        bias = torch.randn(N, device="cuda", generator=g).bfloat16()
        h = torch.randn(B, L, R, device="cuda", generator=g).bfloat16()
        up = torch.randn(SLOTS, N, R, device="cuda", generator=g).bfloat16() * 0.05
        rr = torch.tensor([[(i * R // G, (i + 1) * R // G) for i in range(G)]] * SLOTS, dtype=torch.int32)
        rr = rr.cuda() if G > 1 else None

        def cublas():  # (as `FP8Linear._gemm` calls it)
            kw = dict(scale_a=sx, scale_b=sw.t(), bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
            return torch._scaled_mm(x8, w8.t(), **kw)

        def pair():
            return LR._expand(h, up, idx, cublas().view(B, L, N), rr)

        cub = bench(cublas)
        row = {"layer": [K, N, R], "cublas_ms": round(cub, 4), "cublas_expand_ms": round(bench(pair), 4)}
        ref, row["fused"] = pair().float().view(M, N), []
        for t in tiles:
            F.FUSED_GEMM["gemm"] = t
            lo = (h, up, idx, rr)
            try:
                got = F.fp8_lora_gemm(x8, sx, w8, sw, bias, M, lo, torch.bfloat16).float()
                err = float((got - ref).norm() / ref.norm())
                row["fused"].append(
                    [
                        round(bench(lambda: F.fp8_lora_gemm(x8, sx, w8, sw, bias, M, lo, torch.bfloat16)), 4),
                        round(
                            bench(lambda: F.fp8_lora_gemm(x8, sx, w8, sw, bias, M, None, torch.bfloat16)), 4
                        ),
                        round(err, 5),
                    ]
                )
            except Exception as e:  # (a tile that does not compile or fit: out of the sweep)
                print(f"  tile {t}: {type(e).__name__}: {str(e)[:200]}")
                row["fused"].append([float("inf"), float("inf"), None])
        tf = 2 * M * N * K / cub / 1e9
        print(
            f"{str((K, N, R)):20} {cub:9.4f}  {tf:7.0f}  {row['cublas_expand_ms']:10.4f}   "
            + "  ".join(f"{a:.4f}/{b:.4f} ({e or 0:.0e})" for a, b, e in row["fused"])
        )
        out["layers"].append(row)
    out["block_cublas_expand_ms"] = round(sum(r["cublas_expand_ms"] for r in out["layers"]), 4)
    out["block_fused_ms"] = [
        round(sum(r["fused"][i][0] for r in out["layers"]), 4) for i in range(len(tiles))
    ]
    best = min(range(len(tiles)), key=lambda i: out["block_fused_ms"][i])
    out["best"] = [list(tiles[best]), out["block_fused_ms"][best]]
    print(f"per block: cuBLAS + expand {out['block_cublas_expand_ms']:.3f} ms; fused {out['block_fused_ms']}")
    if out["block_fused_ms"][best] < float("inf"):  # (else none ran: the default stays)
        F.FUSED_GEMM["gemm"] = tuple(tiles[best])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", action="store_true", help="then the rows benchmark at the fastest tiles")
    ap.add_argument("--lora-folder", default=".bench_loras")
    ap.add_argument("--results", default=None)
    ap.add_argument("--expand", type=_tiles, default=EXPAND, help='expand tiles "BM BN BR warps stages, ..."')
    ap.add_argument(
        "--shrink", type=_tiles, default=SHRINK, help='shrink tiles "BM BK warps stages BRmax, ..."'
    )
    ap.add_argument("--weights", default="fp8,bf16", help="the rows benchmark's bases (comma-separated)")
    ap.add_argument(
        "--gemm",
        type=_gemm_tiles,
        nargs="?",
        const=GEMM,
        default=None,
        help='only the FP8 GEMM with the update in its epilogue: tiles "BM BN BK warps stages '
        'GROUP_M BR P SUB, ..." (P programs per SM, 0: one a tile; SUB 1: halved stores; default: a '
        "sweep), then --rows at the fastest",
    )
    a = ap.parse_args()
    import triton.testing

    if a.gemm:
        bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60)  # noqa: E731
        print(
            json.dumps({"gemm": gemm_sweep(a.gemm, bench), "shrink_tma": shrink_tma_sweep(SHRINK_TMA, bench)})
        )
        if a.rows:
            from qwenfast.benchmarks.serve_baselines import run_rows

            for w in a.weights.split(","):
                run_rows(a.lora_folder, out_dir=a.results, weights=w)
        return

    data, idx = layers(), torch.arange(1, B + 1, device="cuda").view(B, 1)
    scale = torch.ones(B, 1, device="cuda")
    ybytes = sum(2 * y.numel() * y.element_size() for *_, y, _ in data)

    def timed(fn) -> float:
        return sum(triton.testing.do_bench(lambda d=d: fn(*d), warmup=10, rep=60) for d in data)

    def expand(down, up, rr, x, xs, y, h):
        return LR._expand(h, up, idx, y, rr)

    res = {"expand": [], "shrink": []}
    default = dict(LR.TILES)  # (the programs sweep also times the default shrink tile)
    print(f"{'expand tile (BM, BN, BR, warps, stages)':42} prefetch  ms/block  TB/s")
    for tile in a.expand:
        for pre in (0, 1):
            LR.TILES.update(expand=tile, prefetch=pre)
            ms = timed(expand)
            res["expand"].append([list(tile), pre, round(ms, 3)])
            print(f"{str(tile):42} {pre:8}  {ms:8.3f}  {ybytes / ms / 1e9:4.2f}")
    print(f"{'shrink tile (BM, BK, warps, stages, BR max)':42}           ms/block")
    for tile in a.shrink:
        LR.TILES.update(shrink=tile)
        ms = timed(lambda down, up, rr, x, xs, y, h: LR._shrink(x, down, idx, scale, h, xs))
        res["shrink"].append([list(tile), round(ms, 3)])
        print(f"{str(tile):42}           {ms:8.3f}")
    be, bs = min(res["expand"], key=lambda r: r[2]), min(res["shrink"], key=lambda r: r[1])
    res["best"] = {"expand": be, "shrink": bs}
    LR.TILES.update(expand=tuple(be[0]), prefetch=be[1])
    res["shrink_programs"] = programs_sweep(
        data, idx, scale, [tuple(bs[0]), default["shrink"]], triton.testing.do_bench
    )
    bp = min(res["shrink_programs"], key=lambda r: r[2])
    res["best"]["shrink_programs"] = bp
    LR.TILES.update(shrink=tuple(bp[0]), programs=bp[1])
    res["per_layer"] = per_layer(data, idx, scale, triton.testing.do_bench)  # at the fastest tiles
    print(json.dumps(res))
    if a.rows:  # the forward at the fastest tiles (the records name them: `tiles`)
        from qwenfast.benchmarks.serve_baselines import run_rows

        for w in a.weights.split(","):
            run_rows(a.lora_folder, out_dir=a.results, weights=w)


if __name__ == "__main__":
    main()
