#!/usr/bin/env bash
# bench/scripts/gpu_diag.sh: one diagnosis on the device machine, its output kept under $OUT.
#
# Usage: bash bench/scripts/gpu_diag.sh WHAT [ARGS...]
#   WHAT is one of
#     machine      the machine's facts: nvidia-smi -L and topo -m, lscpu, NUMA nodes, transparent
#                  huge pages, memory, `xpu info`, and `xpu probe --json` (also to $OUT/xpu-probe.json)
#     engine       `python3 -m scaleup.bench_engine` (the transfer engine against raw copies; JSON
#                  into $OUT/engine/)
#     NAME         bench/scripts/diag_NAME.py with ARGS: dha_linear, dha_triton, dw_write, grads,
#                  host_adamw, host_rate, bare_baselines (needs the .whl DeepSpeed), stream_event,
#                  grad_post, hook_thread
#   Runs from the checkout's root, for at most what is left of DEADLINE_S (570 s after GPU_T0,
#   see gpu_env.sh).
# Environment: LOG names the output file (default diag-WHAT.txt, under $OUT or /tmp).
# Output: the file, and its last lines printed; the exit status is the diagnosis's.
#
# Examples:
#   bash bench/scripts/gpu_diag.sh machine
#   LOG=diag-dha-linear-8192.txt bash bench/scripts/gpu_diag.sh dha_linear --ms 8192
#   bash bench/scripts/gpu_diag.sh host_rate --what profiler,buffers
#   export GPU_T0=$(date +%s); bash bench/scripts/gpu_diag.sh dw_write; bash bench/scripts/gpu_diag.sh dha_triton
set -uo pipefail
WHAT=${1:?usage: gpu_diag.sh machine | engine | NAME (bench/scripts/diag_NAME.py) [ARGS]}
shift
source bench/scripts/gpu_env.sh
DEST=${OUT:-/tmp}
mkdir -p "$DEST"
FILE=$DEST/${LOG:-diag-${WHAT//_/-}.txt}

case $WHAT in
machine)
  { date -u; nvidia-smi -L; nvidia-smi topo -m; echo; lscpu; echo;
    numactl -H 2>/dev/null || ls -d /sys/devices/system/node/node*; echo;
    grep -E "MemTotal|MemAvailable|Hugepagesize|AnonHugePages" /proc/meminfo
    echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"; echo;
    python3 -m xpu info; } > "$FILE" 2>&1
  within 200 python3 -m xpu probe --json > "$DEST/xpu-probe.json" 2>> "$FILE"
  rc=$?
  python3 - "$DEST/xpu-probe.json" >> "$FILE" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.endswith(("GBps", "TFLOPs")):
        print(f"{k:24s} {v}")
for r in d.get("dha_matmul", []):
    print(r)
PY
  ;;
engine)
  within 300 python3 -m scaleup.bench_engine --out "$DEST/engine" "$@" > "$FILE" 2>&1
  rc=$?
  ;;
*)
  script=bench/scripts/diag_$WHAT.py
  [ -f "$script" ] || { echo "gpu_diag.sh: no $script ($(ls bench/scripts/diag_*.py | sed 's|.*/diag_||; s|\.py||' | tr '\n' ' '))" >&2; exit 2; }
  within 100000 python3 "$script" "$@" > "$FILE" 2>&1
  rc=$?
  ;;
esac
lap "$WHAT rc=$rc ($FILE)"
grep -v '^{' "$FILE" | tail -30
exit $rc
