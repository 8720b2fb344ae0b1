# Sourced by the bench/gpu_*.sh device scripts (run from the repo root): diffusers from the carried
# wheel (.whl/), the environment every measurement uses, $OUT and $LOG (which starts with the GPU's name).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/gpu.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee "$LOG"
