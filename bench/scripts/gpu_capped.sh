#!/usr/bin/env bash
# design-s3-capped on the GPU machine, in two device calls on one warm machine (one call may last
# 600 s); the second appends to the first's results in /tmp. Carry .whl (bash ../shared/device-wheels/prep.sh).
#   SYSTEMS=memferry-auto,memferry-auto-3pass,memferry-auto-wholeloss,torch,fsdp2-offload bash bench/scripts/gpu_capped.sh
#   SYSTEMS=deepspeed-z2-offload,deepspeed-z3-offload,deepspeed-zenflow bash bench/scripts/gpu_capped.sh
# Results: $OUT/capped.tgz (results.json/md/png, timelines/, logs/).
set -uo pipefail
SITE=/tmp/site
if [ -d .whl ] && ! PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .whl/deepspeed-*.tar.gz
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 XPU_BACKEND=cuda TORCH_EXTENSIONS_DIR=/tmp/ds_ext
R=/tmp/capped; mkdir -p $R
# the scheduler plans with measured link rates: probe once per machine (cached)
python3 -c "import sys, xpu; from xpu.probe import load_cached; sys.exit(load_cached(xpu.get_backend()) is None)" \
  || python3 -m xpu probe --json > $R/xpu-probe.json 2>/dev/null
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
