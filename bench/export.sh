#!/usr/bin/env bash
# The export table (docs/export.md): the full-size Qwen-Image VAE decoder (random weights) exported to
# ONNX in fp16 at 1024² (file size, time) and in fp32 at 256², checked in onnxruntime (CPU) against
# torch. Any GPU (or CPU, slowly); needs the [export] extra (onnx, onnxruntime); about 2 minutes.
source bench/env.sh
tmp=$(mktemp -d)
for spec in "fp16 1024" "fp32 256 --check"; do
    set -- $spec; dt=$1; side=$2; shift 2
    $QF export onnx --component vae-decoder --random-weights --dtype "$dt" --height "$side" --width "$side" \
        --device cuda -o "$tmp/vae_decoder_${dt}_${side}.onnx" "$@" 2> "$tmp/err.txt"
    tail -1 "$tmp/err.txt" | python3 -c "import json, sys; from qwenfast.benchmarks import save_record
save_record({'bench': 'onnx_export', 'record': json.loads(sys.stdin.read())}, '$RESULTS/onnx_export.jsonl')" \
        || cat "$tmp/err.txt"
done
