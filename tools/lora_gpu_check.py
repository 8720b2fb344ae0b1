"""Full-size LoRA fuse/unfuse on a GPU: time, memory, bitwise restore (random bf16 weights).

A Lightning-shaped LoRA (rank 64 on every block Linear, kohya-style `lora_down`/`lora_up`/`alpha`,
bare `transformer_blocks.N.` names) is written to a safetensors file, then fused, switched and
unloaded on the 60-layer transformer. Prints one JSON record.

    python tools/lora_gpu_check.py [--layers 60] [--rank 64] [--out bench/results/lora_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from qwenfast.config import TransformerConfig
from qwenfast.loading.lora import LoraManager
from qwenfast.models.transformer import QwenImageTransformer, split_qkv_key


def make_lora(model, rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, m in model.named_modules():
        if not (isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")):
            continue
        split = split_qkv_key(n + ".weight")
        names = [k.removesuffix(".weight") for k in split] if split else [n]
        out = m.out_features // len(names)
        for name in names:
            sd[f"{name}.lora_down.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.02).to(
                torch.bfloat16
            )
            sd[f"{name}.lora_up.weight"] = (torch.randn(out, rank, generator=g) * 0.02).to(torch.bfloat16)
            sd[f"{name}.alpha"] = torch.tensor(float(rank))
    return sd


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 2**20, 2)


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-pin", action="store_true", help="pageable host copies of the originals")
    a = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = QwenImageTransformer(TransformerConfig(num_layers=a.layers)).eval().requires_grad_(False)
        torch.set_default_dtype(torch.float32)
    tmp = tempfile.mkdtemp()
    files = []
    for seed in (1, 2):
        p = os.path.join(tmp, f"lightning-{seed}.safetensors")
        save_file(make_lora(model, a.rank, seed), p)
        files.append(p)
    snap = {k: v.clone().cpu() for k, v in model.state_dict().items()}
    m = LoraManager(model)
    m.pin_originals = not a.no_pin
    rss0 = rss_gib()
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    _, t_first = timed(lambda: m.load(files[0], 1.0))  # read + check + originals to pinned host + fuse
    peak = torch.cuda.max_memory_allocated() - base_mem
    host = m.originals_bytes
    rss_growth = rss_gib() - rss0
    # fused weight == round(orig + alpha/rank * up @ down) in fp32, for one layer
    from safetensors import safe_open

    with safe_open(files[0], "pt") as f:
        up = f.get_tensor("transformer_blocks.3.attn.to_k.lora_up.weight").float()
        down = f.get_tensor("transformer_blocks.3.attn.to_k.lora_down.weight").float()
    w0 = snap["transformer_blocks.3.attn.to_qkv.weight"]
    d = w0.shape[0] // 3
    expect = (w0[d : 2 * d].float() + up @ down).to(torch.bfloat16)
    got = model.transformer_blocks[3].attn.to_qkv.weight[d : 2 * d].cpu()
    exact = torch.equal(expect, got)
    _, t_switch = timed(lambda: m.set([(files[1], 1.0)]))  # restore all + fuse the other
    _, t_strength = timed(lambda: m.set([(files[1], 0.5)]))
    _, t_unload = timed(lambda: m.unload())
    restored = all(torch.equal(v.cpu(), snap[k]) for k, v in model.state_dict().items())
    rss_after_unload = rss_gib() - rss0
    _, t_reload = timed(lambda: m.load(files[0], 1.0))  # host memory already grown once (VM effects gone)
    m.unload()
    restored &= all(torch.equal(v.cpu(), snap[k]) for k, v in model.state_dict().items())
    rec = {
        "device": torch.cuda.get_device_name(),
        "layers": a.layers,
        "rank": a.rank,
        "lora_file_GiB": round(os.path.getsize(files[0]) / 2**30, 3),
        "first_load_s": round(t_first, 2),
        "switch_s": round(t_switch, 2),
        "strength_change_s": round(t_strength, 2),
        "unload_s": round(t_unload, 2),
        "reload_after_unload_s": round(t_reload, 2),
        "pinned": not a.no_pin,
        "host_originals_GiB": round(host / 2**30, 2),
        "process_rss_growth_GiB": round(rss_growth, 2),
        "rss_growth_after_unload_GiB": round(rss_after_unload, 2),
        "gpu_peak_extra_MiB": round(peak / 2**20, 1),
        "fused_weight_bitwise_as_expected": exact,
        "unload_restores_bitwise": restored,
    }
    print(json.dumps(rec, indent=1))
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(rec, fh, indent=1)


if __name__ == "__main__":
    main()
