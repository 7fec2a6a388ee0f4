#!/usr/bin/env bash
# The MemFerry issue's memory-starved case on the GPU machine (examples/bench/starved-16gb.yaml).
# Carry .whl. The search writes into the checkout (bench/results/starved-16gb/), and its trial
# journal (max_model_trials.jsonl) makes a rerun go on where a call's time limit cut it: after
# a call, unpack $OUT/starved.tgz into the checkout here, and the next call carries it.
#   PARALLEL=1 SYSTEMS=deepspeed-z3-offload,deepspeed-z2-offload KNOB=10:24 bash bench/scripts/gpu_starved.sh
#        # each system's search in its own process at once (a trial only has to train, its time is
#        # not compared), each into max-model-<system>/; their journals then go into max-model/
#   SYSTEMS=memferry-auto KNOB=128:160 RESOLUTION=8 bash bench/scripts/gpu_starved.sh
#        # host-bound near 140 layers; RESOLUTION stops bisecting within that many layers
#   SYSTEMS=deepspeed-z2-offload,deepspeed-z3-offload,memferry-auto KNOB=... bash bench/scripts/gpu_starved.sh
#        # at the end, with each system's range: every trial reused, one max_model.json with all rows
#   COMPARE=<layers> bash bench/scripts/gpu_starved.sh
#        # Z3 against memferry at Z3's largest, with device compute and the CPU optimizer measured alone
set -uo pipefail
source bench/scripts/gpu_env.sh
R=bench/results/starved-16gb; mkdir -p $R/max-model
probe_once $R
BUDGET_S=${BUDGET_S:-540}
search() {  # search SYSTEMS OUT_DIR TIMEOUT_S
  timeout $3 python3 -m xpu bench examples/bench/starved-16gb.yaml --max-model --systems "$1" ${KNOB:+--knob-range $KNOB} \
    ${RESOLUTION:+--set max_model.resolution=$RESOLUTION} --out $2 --no-progress > $2-$(date +%H%M%S).log 2>&1
}
if [ -n "${COMPARE:-}" ]; then
  timeout $BUDGET_S python3 -m xpu bench examples/bench/starved-16gb.yaml --set model.layers=$COMPARE \
    --systems deepspeed-z3-offload,memferry-auto,torch-compute,memferry-host-optimizer --set steps=10 \
    --out $R/compare-$COMPARE --no-progress > $R/compare-$COMPARE.log 2>&1
  grep "^| " $R/compare-$COMPARE/results.md | cut -c1-260
elif [ -n "${PARALLEL:-}" ]; then
  for s in ${SYSTEMS//,/ }; do
    mkdir -p $R/max-model-$s
    search $s $R/max-model-$s $((BUDGET_S - 30)) &
  done
  wait
  cat $R/max-model-*/max_model_trials.jsonl >> $R/max-model/max_model_trials.jsonl 2>/dev/null
  search "$SYSTEMS" $R/max-model 90  # every trial reused: only writes max_model.json/.md
else
  search "$SYSTEMS" $R/max-model $BUDGET_S
fi
python3 - <<'PY'
import json, pathlib
for line in open("bench/results/starved-16gb/max-model/max_model_trials.jsonl") if pathlib.Path(
        "bench/results/starved-16gb/max-model/max_model_trials.jsonl").exists() else []:
    r = json.loads(line)["row"]
    print(r["system"], r["model"]["layers"], r["status"], r.get("step_s"), r.get("peak_device_gb"), r.get("peak_host_gb"),
          r.get("setup_s"), (r.get("reason") or "")[:120])
PY
tar czf ${OUT:-/tmp}/starved.tgz $R
