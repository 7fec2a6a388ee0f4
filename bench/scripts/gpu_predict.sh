#!/usr/bin/env bash
# MemFerry's prediction against its measurement in the memory-starved case (issue 5), after
# session 5's host-rate findings and the ring gradient write. One device call, nvidia-h200,
# carry .whl; everything lands in $R (tarred into $OUT/predict.tgz):
#   R=bench/results/<date>-h200-session5/predict bash bench/scripts/gpu_predict.sh
# 1. the MemFerry GPU tests (host_linear's "auto" gradient write changed);
# 2. diag_dha_linear at M = 8192 (the starved case's tokens per step);
# 3. at ZeRO-3's largest (17 layers): deepspeed-z3-offload, memferry-auto and the two
#    measured-alone rows, 10 timed steps, in one run;
# 4. memferry-auto at LARGE layers (default 64): the host-bound regime of the largest models.
# Every step runs within what is left of a 570 s deadline, so the tar always happens.
set -uo pipefail
source bench/scripts/gpu_env.sh
START=$SECONDS
within() { local left=$((${DEADLINE:-570} - (SECONDS - START))); [ "$left" -gt 10 ] && timeout $((left < $1 ? left : $1)) "${@:2}"; }
R=${R:-bench/results/predict}; mkdir -p $R
probe_once $R
within 150 python3 -m pytest -q -m gpu tests/test_memferry_gpu.py tests/test_memferry_dha_linear.py > $R/pytest-gpu.log 2>&1
tail -2 $R/pytest-gpu.log
within 60 python3 bench/scripts/diag_dha_linear.py --ms 8192 > $R/diag-dha-linear-8192.txt 2>&1
grep -A2 "^ *M " $R/diag-dha-linear-8192.txt
within 220 python3 -m xpu bench examples/bench/starved-16gb.yaml --set model.layers=17 \
  --systems deepspeed-z3-offload,memferry-auto,torch-compute,memferry-host-optimizer --set steps=10 \
  --out $R/compare-17 --no-progress > $R/compare-17.log 2>&1
grep "^| " $R/compare-17/results.md | cut -c1-200
within 400 python3 -m xpu bench examples/bench/starved-16gb.yaml --set model.layers=${LARGE:-64} \
  --systems memferry-auto --set steps=4 --set warmup=1 --out $R/memferry-${LARGE:-64} --no-progress > $R/memferry-${LARGE:-64}.log 2>&1
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/*/results.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-2], r["system"], r["status"], r.get("step_s"), r.get("step_mean_s"), (r.get("notes") or r.get("reason") or "")[:300])
PY
tar czf ${OUT:-/tmp}/predict.tgz $R
