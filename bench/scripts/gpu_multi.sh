#!/usr/bin/env bash
# bench/scripts/gpu_multi.sh: the multi-GPU runs (nvidia-h200-x2 and up), one mode per device call
# on one warm machine, each within the deadline (DEADLINE_S, 570 s after GPU_T0; see gpu_env.sh).
#
# Usage: bash bench/scripts/gpu_multi.sh MODE [XPU BENCH ARGS...]
#   smoke       topology (nvidia-smi topo and nvlink, peer access, NCCL variables) into
#               $OUT/multi-smoke/topology.txt; the multi-GPU tests (TESTS, default
#               tests/test_multigpu.py tests/test_scaleup_gpu.py); the x2 scenarios' systems on a
#               small GPT (NCCL, the multi-path copier, DeepSpeed's CPUAdam build warmed for later
#               calls, MPress's stage processes); `xpu probe` of devices 1 and 0; the multi-path
#               copier into device 0 and into every device at once. The most telling first.
#   dp          examples/bench/x2-dp.yaml through gpu_bench.sh (out /tmp/bench/x2-dp, appended to)
#   mpress      examples/bench/x2-mpress.yaml through gpu_bench.sh (out /tmp/bench/x2-mpress)
#   mpress-max  the largest model, MPress against recompute only at the 10 GB cap (SYSTEMS, default
#               mpress-10gb,mpress-recompute-10gb), into the checkout's bench/results/x2-mpress-max/
#               with its trial journal: copy the returned $OUT/x2-mpress-max/ there after a cut-off
#               call, carry it, and the next call goes on from there
#   Extra arguments go to `xpu bench` (dp, mpress, mpress-max), e.g. --knob-range 8:64,
#   --set max_model.resolution=4. SYSTEMS picks systems as gpu_bench.sh's --systems does.
# Carry [".whl"] (bash ../shared/device-wheels/prep.sh here first) for the DeepSpeed rows.
#
# Examples:
#   bash bench/scripts/gpu_multi.sh smoke
#   SYSTEMS=memferry-dp-x2,z2-offload-x2 bash bench/scripts/gpu_multi.sh dp
#   bash bench/scripts/gpu_multi.sh mpress-max --knob-range 24:64
set -uo pipefail
MODE=${1:?mode: smoke | dp | mpress | mpress-max}
shift
HERE=bench/scripts
source $HERE/gpu_env.sh

case $MODE in
smoke)
  R=${OUT:-/tmp}/multi-smoke; mkdir -p "$R"
  { date -u; nvidia-smi -L; nvidia-smi topo -m; nvidia-smi nvlink -s 2>&1 | head -40
    python3 -c 'import torch; print("torch", torch.__version__, "devices", torch.cuda.device_count(), "p2p", torch.cuda.can_device_access_peer(0, 1))'
    env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)'; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } > "$R/topology.txt" 2>&1
  lap topology; head -30 "$R/topology.txt"
  # shellcheck disable=SC2086  # TESTS is a list of paths
  OUT=$R LOG=pytest-gpu.log bash $HERE/gpu_tests.sh ${TESTS:-tests/test_multigpu.py tests/test_scaleup_gpu.py}
  SMALL=(--set model.layers=4 --set model.hidden=512 --set model.heads=8 --set model.vocab=4096 --set seq=256
         --set steps=3 --set warmup=1 --set loss_after=3)
  OUT=$R bash $HERE/gpu_bench.sh x2-dp --systems memferry-dp-x2,z2-offload-x2 --out /tmp/multi/small-dp "${SMALL[@]}"
  OUT=$R bash $HERE/gpu_bench.sh x2-mpress --systems mpress-keep,mpress-recompute-10gb --out /tmp/multi/small-mpress "${SMALL[@]}"
  for dev in 1 0; do
    within 90 python3 -m xpu probe --device $dev --json > "$R/xpu-probe-dev$dev.json" 2> "$R/xpu-probe-dev$dev.log"
    lap "probe dev$dev rc=$?"
  done
  for t in 0 all; do
    within 60 python3 -m scaleup.bench_multipath --targets $t --sizes 256MiB,1GiB --preset dgx-h200 \
      --out "$R/multipath-$t" > "$R/multipath-$t.log" 2>&1
    lap "multipath targets $t rc=$?"; tail -15 "$R/multipath-$t.log"
  done
  ;;
dp|mpress)
  bash $HERE/gpu_bench.sh x2-$MODE --out /tmp/bench/x2-$MODE "$@"
  ;;
mpress-max)
  SYSTEMS=${SYSTEMS:-mpress-10gb,mpress-recompute-10gb} \
    bash $HERE/gpu_bench.sh x2-mpress --max-model --out bench/results/x2-mpress-max "$@"
  ;;
*)
  echo "gpu_multi.sh: unknown mode $MODE (smoke | dp | mpress | mpress-max)" >&2; exit 2
  ;;
esac
