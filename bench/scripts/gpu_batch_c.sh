#!/usr/bin/env bash
# GPU batch C (session 2, issue 4): bare DESIGN.md §3 baselines beside `xpu bench` in one lease.
# Needs .whl carried (bash ../shared/device-wheels/prep.sh). Lands in $OUT/batch-c.tgz.
set -uo pipefail
W=/tmp/batch-c; rm -rf $W; mkdir -p $W
source bench/scripts/gpu_env.sh
for s in ${BARE:-z2 fsdp2}; do
  timeout 200 python3 bench/scripts/diag_bare_baselines.py $s > $W/bare-$s.log 2>&1; grep '^{"bare' $W/bare-$s.log || tail -5 $W/bare-$s.log
done
timeout 330 python3 -m xpu bench examples/bench/design-s3.yaml --systems ${SYSTEMS:-deepspeed-z2-offload,fsdp2-offload} \
   --no-progress --no-timeline --out $W/harness > $W/harness.log 2>&1
python3 - <<'PY'
import json
d = json.load(open("/tmp/batch-c/harness/results.json"))
for r in d["rows"]:
    print("harness", r["system"], r["status"], r.get("step_s"), r.get("step_times_s"), (r.get("reason") or "")[:200])
PY
tar czf ${OUT:-/tmp}/batch-c.tgz -C $W .
