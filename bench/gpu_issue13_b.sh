#!/usr/bin/env bash
# Engine-core issue, device call 2 of 2 (H200): end to end (text encoder + denoise + VAE, diffusers in
# the same process) on the commit before the refactor (.old, see gpu_issue13_a.sh) and on this tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ln -sfn "$PWD/qwenfast/assets" .old/qwenfast/assets
export PYTHONUNBUFFERED=1
for v in old new; do
  root=$PWD; [ $v = old ] && root=$PWD/.old
  mkdir -p "$OUT/$v"
  echo "== pipeline $v" | tee -a "$OUT/gpu.log"
  PYTHONPATH=/tmp/site:$root timeout 280 python3 -m qwenfast.cli bench pipeline --fp8 --case 1024:4:nocfg \
      --case 1024:50:cfg --results "$OUT/$v" 2>&1 | grep -v "it/s\]" | grep -v '^{' | cut -c1-600 | tee -a "$OUT/gpu.log"
done
echo done | tee -a "$OUT/gpu.log"
