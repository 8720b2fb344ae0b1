# Sourced by the bench/*.sh entry scripts (run from the repository root on a GPU machine).
#  - installs the wheels carried in .whl/ (diffusers 0.42.1 and whatever else the machine lacks) into
#    /tmp/site, when there are any;
#  - RESULTS: where the records go (default bench/results; a device call sets RESULTS=$OUT);
#  - QWENFAST_COMMIT: the commit the records name, for a copy of the tree without .git;
#  - prints the GPU, its memory, clocks and power limit once.
set -uo pipefail
# (once per process tree: serve.sh's STAGE=pair runs two stages at once, which inherit the installed wheels)
if [ -z "${QWENFAST_WHEELS_IN:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD QWENFAST_WHEELS_IN=1
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
QF="python3 -m qwenfast.cli"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader
