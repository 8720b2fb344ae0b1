#!/usr/bin/env bash
# The peers table (docs/benchmarks.md "Beside the peers", README): qwenfast beside diffusers 0.42.1
# (eager, regional torch.compile, torchao float8 + compile) and cache-dit, each engine in its own
# process over the same seeded random full-size weights. Carry diffusers, cache-dit 1.5.3 and torchao
# 0.17.0 wheels in .whl/ where the machine lacks them. One H100 or H200; two invocations of about
# 5 minutes (one device call each), the second adding its engines to the first's rows (--keep).
source bench/env.sh
CASES="--case fwd:1024 --case fwd:1328 --case fwd:2048 --case e2e:1024:50:cfg --case e2e:1024:4:nocfg"
case "${STAGE:-all}" in
    a) $QF bench peers $CASES --engine diffusers --engine qwenfast --keep /tmp/peerskeep ;;
    b) $QF bench peers $CASES --engine diffusers-torchao --engine cache-dit --keep /tmp/peerskeep --results "$RESULTS" ;;
    all) $QF bench peers $CASES --results "$RESULTS" ;;
    *) echo "STAGE must be a, b or all" >&2; exit 2 ;;
esac
