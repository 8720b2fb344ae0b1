#!/usr/bin/env bash
# Engine-core issue, device call 1 of 2 (H200): GPU tests of the new core, then the transformer
# benchmark on the commit before the refactor (8d50797, carried as .old/qwenfast: `git archive 8d50797
# qwenfast | tar -x -C .old`, assets linked) and on this tree, same machine, one after the other; then
# the demo quality gate per code path (text-to-image and edits) on this tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ln -sfn "$PWD/qwenfast/assets" .old/qwenfast/assets
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.log"
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_engine_core.py \
    tests/test_pipeline.py tests/test_fp8.py tests/test_lora.py tests/test_runtime_memory.py 2>&1 | tail -4 | tee -a "$OUT/gpu.log"
for v in old new; do
  root=$PWD; [ $v = old ] && root=$PWD/.old
  mkdir -p "$OUT/$v"
  echo "== transformer $v" | tee -a "$OUT/gpu.log"
  PYTHONPATH=/tmp/site:$root timeout 150 python3 -m qwenfast.cli bench transformer --size 1024 --compare diffusers \
      --no-compile --iters 10 --results "$OUT/$v" 2>&1 | grep -v '^{' | tail -9 | tee -a "$OUT/gpu.log"
done
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m qwenfast.cli bench quality --paths --results "$OUT/new" 2>&1 \
    | grep -v '^{' | tee -a "$OUT/gpu.log"
PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m qwenfast.cli bench quality --paths --model edit --results "$OUT/new" 2>&1 \
    | grep -v '^{' | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
