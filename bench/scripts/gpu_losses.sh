#!/usr/bin/env bash
# examples/bench/design-s3-losses.yaml on the GPU machine (one call). Carry .whl. Lands in $OUT/losses.tgz.
set -uo pipefail
source bench/scripts/gpu_env.sh
R=/tmp/losses; mkdir -p $R
probe_once $R
timeout ${BUDGET_S:-540} python3 -m xpu bench examples/bench/design-s3-losses.yaml ${SYSTEMS:+--systems "$SYSTEMS"} --out $R --append --no-progress > $R/bench.log 2>&1
python3 - <<'PY'
import json, os
f = "/tmp/losses/results.json" if os.path.exists("/tmp/losses/results.json") else "/tmp/losses/results.partial.json"
for r in json.load(open(f))["rows"]:
    print(f'{r["system"]:<26} {r["status"]:<4} mean {r.get("step_mean_s")} losses {[round(x, 4) for x in (r.get("losses") or [])]} {(r.get("reason") or "")[:150]}')
PY
tar czf ${OUT:-/tmp}/losses.tgz -C /tmp losses
