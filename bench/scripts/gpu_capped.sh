#!/usr/bin/env bash
# design-s3-capped on the GPU machine, in two device calls on one warm machine (one call may last
# 600 s); the second appends to the first's results in /tmp. Carry .whl (bash ../shared/device-wheels/prep.sh).
#   SYSTEMS=memferry-auto,fsdp2-offload,deepspeed-z2-offload-20.5gb,deepspeed-zenflow-20.5gb bash bench/scripts/gpu_capped.sh
#   SYSTEMS=deepspeed-z2-offload-24gb,deepspeed-zenflow-24gb bash bench/scripts/gpu_capped.sh   (session 3's two calls)
# Results: $OUT/capped.tgz (results.json/md/png, timelines/, logs/).
set -uo pipefail
source bench/scripts/gpu_env.sh
R=/tmp/capped; mkdir -p $R
probe_once $R
timeout ${BUDGET_S:-530} python3 -m xpu bench examples/bench/design-s3-capped.yaml --systems "$SYSTEMS" --out $R --append --no-progress > $R/bench-$(date +%H%M%S).log 2>&1
python3 - <<'PY'
import json
import os
d = json.load(open("/tmp/capped/results.json" if os.path.exists("/tmp/capped/results.json") else "/tmp/capped/results.partial.json"))
for r in d["rows"]:
    print(f'{r["system"]:<26} {r["status"]:<6} median {r.get("step_s")} mean {r.get("step_mean_s")} peak {r.get("peak_device_gb")} loss {r.get("loss")} | {r.get("notes") or ""} {(r.get("reason") or "")[:160]}')
PY
[ -f /tmp/capped/results.partial.json ] && echo "cut short: rows so far in results.partial.json"
tar czf ${OUT:-/tmp}/capped.tgz -C /tmp capped
