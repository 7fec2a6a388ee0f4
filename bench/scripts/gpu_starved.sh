#!/usr/bin/env bash
# The MemFerry issue's memory-starved case on the GPU machine (examples/bench/starved-16gb.yaml).
# Carry .whl. The search writes into the checkout (bench/results/starved-16gb/), and its trial
# journal (max_model_trials.jsonl) makes a rerun go on where a call's time limit cut it: after
# a call, unpack $OUT/starved.tgz into the checkout here, and the next call carries it.
#   SYSTEMS=deepspeed-z3-offload KNOB=8:64 bash bench/scripts/gpu_starved.sh   # largest per system
#   SYSTEMS=deepspeed-z2-offload KNOB=8:64 bash bench/scripts/gpu_starved.sh
#   SYSTEMS=memferry-auto KNOB=64:192 bash bench/scripts/gpu_starved.sh        # host-bound near 120 layers
#   SYSTEMS=deepspeed-z2-offload,deepspeed-z3-offload,memferry-auto bash bench/scripts/gpu_starved.sh
#                                  # at the end: every trial reused, one max_model.json with all rows
#   COMPARE=<layers> bash bench/scripts/gpu_starved.sh                         # z3 vs memferry at Z3's largest
set -uo pipefail
source bench/scripts/gpu_env.sh
R=bench/results/starved-16gb; mkdir -p $R
probe_once $R
if [ -n "${COMPARE:-}" ]; then
  timeout ${BUDGET_S:-540} python3 -m xpu bench examples/bench/starved-16gb.yaml --set model.layers=$COMPARE \
    --systems deepspeed-z3-offload,memferry-auto --set steps=10 --out $R/compare-$COMPARE --no-progress > $R/compare-$COMPARE.log 2>&1
  grep "^| " $R/compare-$COMPARE/results.md | cut -c1-240
else
  RANGE=${KNOB:+--knob-range $KNOB}
  timeout ${BUDGET_S:-540} python3 -m xpu bench examples/bench/starved-16gb.yaml --max-model --systems "$SYSTEMS" $RANGE \
    --out $R/max-model --no-progress > $R/max-model-$(date +%H%M%S).log 2>&1
  python3 - <<'PY'
import json
for line in open("bench/results/starved-16gb/max-model/max_model_trials.jsonl"):
    r = json.loads(line)["row"]
    print(r["system"], r["model"]["layers"], r["status"], r.get("step_s"), r.get("peak_device_gb"), (r.get("reason") or "")[:120])
PY
fi
tar czf ${OUT:-/tmp}/starved.tgz $R
