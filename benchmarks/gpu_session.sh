#!/usr/bin/env bash
# Everything a lent GPU should run, most valuable first, each step bounded so that the whole fits
# one device call (under 10 minutes): the -m gpu tests, the GPU benchmark tables, the big-model path
# and the overhead breakdown. Outputs go to $OUT (the device tool brings that folder
# back); paste the tables into docs/benchmark-runs.md by hand, with this command and the machine.
#
#   bash benchmarks/gpu_session.sh                  # on the GPU machine (device: cuda:0)
#   DEVICE=cpu bash benchmarks/gpu_session.sh       # a dry run here, small inputs, tests on the CPU
#   STEPS="compiled processes lock" bash benchmarks/gpu_session.sh   # a second call: the steps the first leaves out
#   STEPS="layouts-cpu" bash benchmarks/gpu_session.sh   # issue 50's layouts on the machine's CPU cores, quieter than 2
set -u
export PYTHONUNBUFFERED=1  # a step stopped at its limit keeps every row it printed
export PYTHONFAULTHANDLER=1  # ... and, stopped by SIGABRT, prints where each thread was
cd "$(dirname "$0")/.."
out=${OUT:-gpu-session}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
small=()
[ "$device" = cpu ] && small=(--small)
# the GPU machine reaches no package index, so an editable install (which builds) fails there
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

steps=" ${STEPS:-efficiencies gpu-one gpu-memory pytest-gpu gpu-breakdown large-model} "
step() {  # step NAME SECONDS COMMAND...: run it bounded (if STEPS names it), keep its output, note how it ended
    local name=$1 limit=$2
    shift 2
    [[ "$steps" == *" $name "* ]] || return 0
    local started=$SECONDS
    timeout -s ABRT "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s (limit $limit s)" | tee -a "$out/summary.txt"
}

# the target cost model's efficiencies (issue 74, item 1): small shapes on the CPU; on a GPU named by GPU=
gpu=${GPU:-H200}
[ "$device" = cpu ] && gpu=H100
step efficiencies 240 python benchmarks/fit_efficiencies.py --gpu "$gpu" --gpu-device "$device" "${small[@]}" \
    --repeats 5 --out "$out/efficiencies-$gpu.json"
step gpu-one 300 python benchmarks/gpu.py --device "$device" "${small[@]}" --repeats 5 --no-write --parts one
step gpu-memory 65 python benchmarks/gpu.py --device "$device" "${small[@]}" --no-write --parts memory
step pytest-gpu 110 python -m pytest -m gpu -q -p no:cacheprovider --gpu-device "$device"
step gpu-breakdown 55 python benchmarks/gpu_breakdown.py --device "$device" "${small[@]}" --parts overhead \
    --models ResNet-50 --repeats 5 --out "$out/breakdown"
step large-model 40 python benchmarks/large_model.py --device "$device" --part both --no-write
step compiled 300 python benchmarks/gpu.py --device "$device" "${small[@]}" --repeats 5 --no-write --parts compiled \
    --chunk-counts 1,4
step processes 150 python benchmarks/processes_cpu.py --device "${device%%:*}" --ranks 1 --chunks 4 --repeats 3
step lock 120 python benchmarks/gpu_breakdown.py --device "$device" "${small[@]}" --parts lock --repeats 5 \
    --out "$out/breakdown"
# 4 gloo ranks with a core each: the layouts' absolute band on a machine that does not drift as a
# shared 2-core VM does (docs/benchmarks.md, "Layouts of 4 CPU processes")
step layouts-cpu 420 python benchmarks/layouts_cpu.py --ranks 4 --models mlp,mobilenetv3,decoder8k --repeats 3
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
# the device tool brings back at most 8 files: every text output in one file, the traces in one archive
for f in "$out"/*.txt; do echo "=== $(basename "$f")"; cat "$f"; done >"$out/session.log"
tar czf "$out/breakdown.tgz" -C "$out" breakdown 2>/dev/null && rm -rf "$out/breakdown"
rm -f "$out"/*.txt
