#!/usr/bin/env bash
# Everything a lent GPU should run, most valuable first, each step bounded so that the whole fits
# one device call (about 9 minutes): the -m gpu tests, the GPU benchmark tables (process mode
# included), and the overhead breakdown. Outputs go to $OUT (the device tool brings that folder
# back); paste the tables into docs/benchmarks.md by hand, with this command and the machine.
#
#   bash benchmarks/gpu_session.sh                  # on the GPU machine (device: cuda:0)
#   DEVICE=cpu bash benchmarks/gpu_session.sh       # a dry run here, small inputs, tests on the CPU
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-session}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
small=()
[ "$device" = cpu ] && small=(--small)
python -m pip install --quiet -e . --no-deps >"$out/install.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: run it bounded, keep its output, note how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s (limit $limit s)" | tee -a "$out/summary.txt"
}

step pytest-gpu 240 python -m pytest -m gpu -q -p no:cacheprovider --gpu-device "$device"
step gpu-tables 240 python benchmarks/gpu.py --device "$device" "${small[@]}" --repeats 5 --no-write \
    --parts one,memory,processes
step gpu-breakdown 60 python benchmarks/gpu_breakdown.py --device "$device" "${small[@]}" --parts overhead \
    --out "$out/breakdown"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
