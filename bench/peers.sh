#!/usr/bin/env bash
# The peers table (docs/benchmarks.md "Beside the peers", README): qwenfast beside diffusers 0.42.1
# (eager, regional torch.compile, torchao float8 + compile), cache-dit and ComfyUI (its model, and its
# whole Qwen-Image workflow beside the qwenfast nodes), each engine in its own process over the same
# seeded random full-size weights. Carry diffusers, cache-dit 1.5.3 and torchao 0.17.0 wheels in .whl/
# where the machine lacks them; QWENFAST_COMFYUI names a ComfyUI work tree (docs/comfyui.md: the fork,
# its commit, its dependencies). One H100 or H200, about 14 minutes in three stages of one device call
# each (a: 6 min, b: 4 min, c: 4 min), each adding its engines to the earlier rows (--keep); the last
# stage writes the record. STAGE=highres: the high-resolution table (diffusers and qwenfast at 2048² and
# 2512², about 8 minutes, one device call; its 8-bit attention row runs the sage engine, built first from
# $SAGE_SRC (default .sage, see bench/build_sageattention.py; two minutes on 64 cores) when that is there,
# else the int8 engine: both keep the quality gate).
source bench/env.sh
CASES="--case fwd:1024 --case fwd:1328 --case fwd:2048 --case e2e:1024:50:cfg --case e2e:1024:4:nocfg"
KEEP="--keep /tmp/peerskeep --timeout 540"
case "${STAGE:-all}" in
    a) $QF bench peers $CASES --engine diffusers --engine qwenfast --engine cache-dit $KEEP ;;
    b) $QF bench peers $CASES --engine comfyui-workflow --engine comfyui $KEEP ;;
    c) $QF bench peers $CASES --engine diffusers-torchao $KEEP --results "$RESULTS" ;;
    all) $QF bench peers $CASES --results "$RESULTS" ;;
    highres) engine=int8
             if [ -d "${SAGE_SRC:-.sage}" ] && python3 bench/build_sageattention.py --src "${SAGE_SRC:-.sage}" --target /tmp/site; then
                 engine=sage; export PYTHONPATH=/tmp/site:$PYTHONPATH
             fi
             QWENFAST_FP8_ATTENTION=${QWENFAST_FP8_ATTENTION:-$engine} $QF bench peers --highres --engine diffusers \
                 --engine qwenfast --cache none --timeout 540 --results "$RESULTS" ;;
    *) echo "STAGE must be a, b, c, all or highres" >&2; exit 2 ;;
esac
