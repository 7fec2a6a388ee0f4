#!/usr/bin/env bash
# bench/scripts/gpu_bench.sh: one `xpu bench` scenario on the device machine, within the
# device's time limit, into one result that later calls on the same warm machine append to.
#
# Usage: bash bench/scripts/gpu_bench.sh SCENARIO [--systems A,B,...] [--out DIR] [XPU BENCH ARGS...]
#   SCENARIO   a name in examples/bench/ (design-s3, design-s3-capped, starved-16gb, x2-dp, ...)
#              or a YAML path
#   --systems  labels or system names; each runs in its own `xpu bench --append` call, in the
#              order given, with what is left of the deadline (a system with under 20 s left is
#              skipped, so the copy below always happens). Without it, one call runs the whole
#              scenario (a cut-off leaves the finished rows in results.partial.json).
#   --out DIR  where xpu bench writes (default /tmp/bench/<scenario name>); a later call on the
#              same warm machine appends to it
#   the rest   given to every `xpu bench` call: --set KEY=VALUE, --device-mem-gb N, --no-timeline,
#              --max-model --knob-range LO:HI ... With --max-model (or --min-cap) all systems go in
#              one call: the search's trial journal in DIR lets a re-run go on where a cut-off one
#              stopped (unpack the returned DIR.tar.gz into the checkout and carry it).
# Environment: SYSTEMS (as --systems), DEADLINE_S (570) and GPU_T0 (see gpu_env.sh).
# Output: DIR (results.json/.md/.png, timelines/, logs/, bench-*.log, host-bench-*.txt: the host
# sampled every second, bench/scripts/sample_host.sh), then a summary of the
# rows, and DIR packed into $OUT/<basename of DIR>.tar.gz when $OUT is set (the device tool's
# folder; one file, as the tool brings back at most 8 a call).
#
# Examples (carry [".whl"] for the DeepSpeed rows):
#   bash bench/scripts/gpu_bench.sh design-s3 --systems torch,fsdp2-offload,deepspeed-z2-offload
#   bash bench/scripts/gpu_bench.sh design-s3 --systems deepspeed-twinflow-0.5,deepspeed-zenflow   # next call appends
#   bash bench/scripts/gpu_bench.sh starved-16gb --systems memferry-host-optimizer --set model.layers=17 --out /tmp/alone-17
#   bash bench/scripts/gpu_bench.sh starved-16gb --systems memferry-auto --max-model --knob-range 128:160 \
#        --set max_model.resolution=32 --out bench/results/starved-16gb/max-model
#   bash bench/scripts/gpu_bench.sh qwen2-1.5b-finetune --min-cap --systems fsdp2-offload,deepspeed-z3-offload \
#        --cap-resolution 2 --set steps=1 --set warmup=0 --out /tmp/bench/q15-mincap
# Run it from the checkout's root (relative paths are taken from there).
set -uo pipefail

SCENARIO=${1:?usage: gpu_bench.sh SCENARIO [--systems A,B] [--out DIR] [xpu bench args]}
shift
SYSTEMS=${SYSTEMS:-}
DIR=""
EXTRA=()
SEARCH=""
while [ $# -gt 0 ]; do
  case $1 in
    --systems) SYSTEMS=$2; shift 2 ;;
    --systems=*) SYSTEMS=${1#*=}; shift ;;
    --out) DIR=$2; shift 2 ;;
    --out=*) DIR=${1#*=}; shift ;;
    --max-model|--min-cap) SEARCH=${1#--}; EXTRA+=("$1"); shift ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
NAME=$(basename "$SCENARIO" .yaml)
DIR=${DIR:-/tmp/bench/$NAME}
mkdir -p "$DIR"

source bench/scripts/gpu_env.sh
probe_once "$DIR"
lap "probe ($NAME into $DIR)"

rc=0
bench() {  # bench LOG_NAME [xpu bench args]: one call with what is left of the deadline
  local log=$DIR/bench-$1.log; shift
  # What the host's kernel does meanwhile (interrupts by kind, memory counters: sample_host.sh):
  # a rehearsal ran on a host busy with a million interrupts a second (session 36).
  bash bench/scripts/sample_host.sh "$DIR/host-$(basename "$log" .log).txt" 1 & local sampler=$!
  within 100000 python3 -m xpu bench "$SCENARIO" --out "$DIR" --no-progress "$@" ${EXTRA[@]+"${EXTRA[@]}"} > "$log" 2>&1
  local r=$?; kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  lap "xpu bench $* rc=$r (log $log)"; [ $r -ne 0 ] && rc=$r; tail -3 "$log"
}
if [ -n "$SEARCH" ]; then
  bench "$SEARCH" ${SYSTEMS:+--systems "$SYSTEMS"}
elif [ -n "$SYSTEMS" ]; then
  for s in ${SYSTEMS//,/ }; do
    bench "$s" --systems "$s" --append
  done
else
  bench all --append
fi

python3 - "$DIR" <<'PY'
import json, os, sys
d = sys.argv[1]
for name in ("results.json", "results.partial.json", "max_model.json", "min_cap.json"):
    path = os.path.join(d, name)
    if not os.path.exists(path):
        continue
    print(f"== {path}")
    for r in json.load(open(path)).get("rows", []):
        if "max_value" in r:  # a max-model row: the largest that trained, and the trials
            trials = " ".join(f'{t.get("value")}:{t.get("status")}' for t in r.get("trials") or [])
            print(f'{r["system"]:<28} {r["status"]:<7} largest {r.get("knob")}={r.get("max_value")} '
                  f'({r.get("max_params")} params) trials {trials} | {(r.get("reason") or "")[:200]}')
            continue
        if "min_cap_gb" in r:  # a min-cap row: the smallest cap, the one below that failed, the trials
            below = r.get("failed_below") or {}
            trials = " ".join(f'{t.get("device_mem_gb")}:{t.get("status")}' for t in r.get("trials") or [])
            print(f'{r["system"]:<28} {r["status"]:<7} smallest cap {r.get("min_cap_gb")} GB (below '
                  f'{below.get("device_mem_gb")}: {below.get("status")}) median {r.get("step_s")} peak '
                  f'{r.get("peak_device_gb")} loss {r.get("loss")} trials {trials} | {(r.get("reason") or "")[:200]}')
            continue
        print(f'{r["system"]:<28} {r["status"]:<7} median {r.get("step_s")} mean {r.get("step_mean_s")} '
              f'peak {r.get("peak_device_gb")} reserved {r.get("peak_device_reserved_gb")} (setup '
              f'{r.get("setup_peak_device_reserved_gb")}) alloc retries {r.get("alloc_retries")} loss {r.get("loss")} '
              f'| {r.get("notes") or ""} {(r.get("reason") or "")[:200]}')
PY

if [ -n "${OUT:-}" ]; then
  # One file per scenario: the device tool brings back at most 8 files a call (tar xzf it here).
  tar czf "$OUT/$(basename "$DIR").tar.gz" -C "$(dirname "$DIR")" "$(basename "$DIR")"
fi
exit $rc
