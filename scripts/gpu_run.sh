#!/bin/bash
# Everything #58 needs an NVIDIA GPU for, after the CUDA build, as named steps with their own timeouts (an
# NVIDIA machine may be at hand for 15 minutes, one command for 10, and the build takes 5). On the machine, from
# the project's root (/work/shared/gpu/cuda_check.sh builds llama-cpp-python with CUDA into /tmp/site and
# llama-server from the same CMake build into /tmp/llbuild, sets PYTHONPATH, then runs its arguments):
#
#     OUT=/some/folder bash .gpu/cuda_check.sh 'bash scripts/gpu_run.sh libstdcxx laptop'   # with the build: ~10 min
#     OUT=/some/folder bash .gpu/cuda_check.sh 'bash scripts/gpu_run.sh speed prices'       # warm machine: ~6 min
#
# With no step named, all four run in this order. Results land in docs/results/ (commit them) and in $OUT.
# `bash scripts/gpu_run.sh --vulkan [steps]` rehearses the same steps here on llama.cpp's Vulkan build and Mesa's
# software device (.venv-vulkan and llama-server from the wheel's build: python -m edgevlm_testkit.vulkan_build
# --server), with the sizes scaled to a miniature pair and a 256-token picture budget (lavapipe's limits).
#   libstdcxx  is libstdc++ private to the CUDA library (nm -D / ldd), and does numpy-first load, crash or refuse
#   laptop     a ballast leaves 4, then 6 GiB free; LLaVA-1.5-7B at full size, --ngl auto: chat, serve, caption
#   speed      edgevlm against llama-server of the same build: TTFT, decode 1 and 4 streams, captioning
#   prices     decode tokens/s per placement (layers, KV on the device or the host, KV types): the price table
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-.gpu/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[gpu_run t+$(( $(date +%s) - T0 ))s] $*"; }
PY=python3 VK=""
if [ "${1:-}" = "--vulkan" ]; then
  shift; VK=1; PY=$PWD/.venv-vulkan/bin/python
  export GGML_VK_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PWD/testkit${PYTHONPATH:+:$PYTHONPATH}
  [ -x "$PY" ] || { echo "no .venv-vulkan: python scripts/gpu_check.py --vulkan --tests makes it" >&2; exit 2; }
  vulkaninfo --summary 2>/dev/null | grep -m2 -E "deviceName|driverInfo"
else
  nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
fi
SERVER=${LLAMA_SERVER:-/tmp/llbuild/bin/llama-server}
LIB=$("$PY" -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')" 2>/dev/null)

libstdcxx() {  # where libstdc++'s code is, and what a numpy-first process does (docs/gpu.md, "Loading on NVIDIA")
  local L
  L=$(ls "$LIB"/libggml-cuda.so* "$LIB"/libggml-vulkan.so* 2>/dev/null | head -n 1)
  el "the device's library: $L"; ldd "$L" | grep -E 'stdc|gcc_s|cudart'
  echo "exported: $(nm -D --defined-only "$L" | wc -l); libstdc++'s own (_M_insert<long>, __cxa_throw," \
    "__gxx_personality_v0): $(nm -D --defined-only "$L" | grep -cE ' (_ZNSo9_M_insertIlEERSoT_|__cxa_throw|__gxx_personality_v0)$')"
  strings -a "$L" | grep -m3 'GCC:'; grep -m3 -i 'exclude-libs' /tmp/build.log
  timeout 120 "$PY" -c 'import numpy, llama_cpp; llama_cpp.Llama("models/edgevlm-demo.gguf", n_gpu_layers=-1, verbose=False).close(); print("numpy first: loaded")'
  el "numpy first, llama_cpp.Llama: rc=$? (139: the crash)"
  timeout 120 "$PY" -c 'import numpy, runpy, sys; sys.argv=["edgevlm","chat","--model","demo","--ngl","-1","-n","8","Describe the image."]; runpy.run_module("edgevlm", run_name="__main__")'
  el "numpy first, edgevlm chat: rc=$? (0: answered; 2: refused with the cause; 139: crashed)"
}
laptop() {
  if [ -n "$VK" ]; then timeout 600 "$PY" scripts/laptop_check.py; else timeout 290 python3 scripts/gpu_check.py --inner --laptop 4 6; fi
  el "laptop rc=$?"
}
speed() {
  if [ -n "$VK" ]; then
    timeout 900 "$PY" scripts/bench_gpu_speed.py --vulkan-server --image-tokens 256 --reps 2 --ttft-reps 2 \
      --caption-images 8 --tag lavapipe-rehearsal --logs "$OUT"
  else
    timeout 330 python3 scripts/bench_gpu_speed.py --llama-server "$SERVER" --same-build --pair qwen2vl:real \
      --reps 2 --ttft-reps 2 --tag cuda-real --logs "$OUT"
  fi
  el "speed rc=$?"
}
prices() {
  if [ -n "$VK" ]; then timeout 900 "$PY" scripts/bench_kv_price.py --shape medium --repeats 1 --fills 64
  else timeout 200 python3 scripts/bench_kv_price.py --shape large --repeats 3 --update-table; fi
  el "prices rc=$?"
}

[ $# -gt 0 ] || set -- libstdcxx laptop speed prices
for step in "$@"; do
  case $step in
    libstdcxx|laptop|speed|prices) el "step $step"; "$step" ;;
    *) echo "unknown step $step (libstdcxx laptop speed prices)" >&2; exit 2 ;;
  esac
done
cp docs/results/laptop_check-*.json docs/results/bench_gpu_speed-*.json docs/results/bench_kv_price-*.json \
  edgevlm/data/kv_prices.json "$OUT"/ 2>/dev/null
el end
