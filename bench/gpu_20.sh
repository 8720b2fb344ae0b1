#!/usr/bin/env bash
# Issue 20 (H200): (1) the API workflow loader -> LoRA -> sampler -> SaveImage through the real ComfyUI
# (hiddenswitch/pip-and-uv-installable-ComfyUI@87606c5f) on the GPU, bf16, vs `qwenfast generate` with the
# same seed (integrations/comfyui/run_workflow.py); (2) the full-size Qwen-Image VAE decoder (random weights)
# exported to ONNX: fp16 at 1024x1024 (size, time) and fp32 at 256x256 checked in onnxruntime (CPU) vs torch.
# The lead carries .comfy/ (git-ignored, ~56 MB: the fork's packages + deps as tarballs; see .comfy/MANIFEST.txt).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out20}; mkdir -p "$OUT"
LOG="$OUT/gpu_20.log"; : > "$LOG"

echo "== 1. ComfyUI workflow on the GPU" | tee -a "$LOG"
C=/tmp/comfy20; rm -rf "$C"; mkdir -p "$C/fork" "$C/site" "$C/stubs"
if [ -f .comfy/fork.tar.gz ]; then
    tar -xzf .comfy/fork.tar.gz -C "$C/fork" && tar -xzf .comfy/site_noav.tar.gz -C "$C/site"
    python3 -c "import av" 2>/dev/null || tar -xzf .comfy/av.tar.gz -C "$C/site"
    if ! python3 -c "import cv2" 2>/dev/null; then  # opencv is too big to carry; the workflow never calls it
        printf 'def __getattr__(name):\n    raise ImportError("cv2 is a stub here (bench/gpu_20.sh): opencv not installed")\n' > "$C/stubs/cv2.py"
    fi
    PYTHONPATH=/tmp/site:$PWD:$C/fork:$C/stubs COMFYUI_LABEL="hiddenswitch/pip-and-uv-installable-ComfyUI@87606c5f (comfyui 0.12.1), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
        timeout 200 python3 integrations/comfyui/run_workflow.py --dir "$C/run" --device cuda --extra-site "$C/site" \
        --steps 20 --tolerance 0.02 --record "$OUT/comfyui-gpu" --results "$OUT" 2>&1 \
        | grep -v '^\s\|^Stack (most recent' | tail -25 | tee -a "$LOG"
else
    echo "skipped: .comfy/ was not carried (run with carry=['.comfy'])" | tee -a "$LOG"
fi

echo "== 2. ONNX export of the full-size VAE decoder (random weights)" | tee -a "$LOG"
mkdir -p /tmp/onnx20
for spec in "fp16 1024 --device cuda" "fp32 256 --device cuda --check"; do
    set -- $spec; dt=$1; side=$2; shift 2
    timeout 120 python3 -m qwenfast.cli export onnx --component vae-decoder --random-weights --dtype "$dt" \
        --height "$side" --width "$side" -o "/tmp/onnx20/vae_decoder_${dt}_${side}.onnx" "$@" 2> /tmp/onnx20/err.txt | tee -a "$LOG"
    rec=$(tail -1 /tmp/onnx20/err.txt)
    echo "$rec" | grep -q '^{' && echo "{\"what\": \"onnx_export_vae_decoder_full_size\", \"record\": $rec}" \
        | tee -a "$OUT/onnx_export.jsonl" | tee -a "$LOG" || { cat /tmp/onnx20/err.txt | tail -5 | tee -a "$LOG"; }
done
ls -la /tmp/onnx20 | tee -a "$LOG"
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'what':<34} {'result':<60}")
for line in (out / "comfyui.jsonl").read_text().splitlines() if (out / "comfyui.jsonl").exists() else []:
    r = json.loads(line)
    print(f"{'comfyui vs qwenfast generate':<34} ok={r['ok']} png max diff {r['png_max_abs_diff']:.4f} (tol {r['tolerance']}), lora moves {r['lora_moves_image_by']:.3f}")
for line in (out / "onnx_export.jsonl").read_text().splitlines() if (out / "onnx_export.jsonl").exists() else []:
    r = json.loads(line)["record"]
    mb = (r["onnx_bytes"] + r["data_bytes"]) / 2**20
    print(f"{'onnx vae-decoder ' + r['dtype'] + ' ' + str(r['inputs']['latents']):<34} {mb:.1f} MiB, {r['seconds']}s export" + (f", ort vs torch {r['max_abs_diff_vs_torch']:.2e}" if 'max_abs_diff_vs_torch' in r else ''))
PY
echo done | tee -a "$LOG"
