#!/bin/bash
# Everything #58 needs an NVIDIA GPU for, as one run after the CUDA build — within about 10 minutes (an NVIDIA
# machine may be at hand for 15, and the build takes 5). On the machine, from the project's root:
#
#     OUT=/some/folder bash .gpu/cuda_check.sh 'bash scripts/gpu_run.sh'
#
# (/work/shared/gpu/cuda_check.sh builds llama-cpp-python with CUDA into /tmp/site, sets PYTHONPATH, then runs
# its arguments.) Each step has its own timeout, so a slow one cannot take the others' time; results land in
# docs/results/ (commit them) and are copied to $OUT. Steps whose script is not in this checkout are skipped.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-.gpu/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[gpu_run t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
step() {  # step SECONDS SCRIPT ARGS...: run scripts/SCRIPT if it exists, within SECONDS
  local limit=$1 script=$2; shift 2
  if [ ! -f "scripts/$script" ]; then el "skip $script (not in this checkout)"; return; fi
  el "$script $*"; timeout "$limit" python3 "scripts/$script" "$@"; el "$script rc=$?"
}
# 1. a laptop on this GPU (#58 part 1): a ballast leaves 4, then 6 GiB free; LLaVA-1.5-7B at full size (random
#    Q4_K blocks, ~40 s to write on 2 busy cores, cached), --ngl auto: chat, serve with 4 clients, caption of 16
step 300 gpu_check.py --inner --laptop 4 6
# 2. the speed benchmark and 3. the KV price (other helpers' scripts; the lead sets their arguments)
step 150 bench_gpu_speed.py
step 120 bench_kv_price.py
cp docs/results/laptop_check-*.json docs/results/bench_gpu_speed-*.json docs/results/bench_kv_price-*.json "$OUT"/ 2>/dev/null
el end
