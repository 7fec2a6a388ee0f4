#!/usr/bin/env bash
# examples/bench/design-s3-losses.yaml on the GPU machine (one call). Carry .whl. Lands in $OUT/losses.tgz.
set -uo pipefail
SITE=/tmp/site
if [ -d .whl ] && ! PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .whl/deepspeed-*.tar.gz
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 XPU_BACKEND=cuda TORCH_EXTENSIONS_DIR=/tmp/ds_ext
R=/tmp/losses; mkdir -p $R
python3 -c "import sys, xpu; from xpu.probe import load_cached; sys.exit(load_cached(xpu.get_backend()) is None)" \
  || python3 -m xpu probe --json > $R/xpu-probe.json 2>/dev/null
timeout ${BUDGET_S:-540} python3 -m xpu bench examples/bench/design-s3-losses.yaml ${SYSTEMS:+--systems "$SYSTEMS"} --out $R --append --no-progress > $R/bench.log 2>&1
python3 - <<'PY'
import json, os
f = "/tmp/losses/results.json" if os.path.exists("/tmp/losses/results.json") else "/tmp/losses/results.partial.json"
for r in json.load(open(f))["rows"]:
    print(f'{r["system"]:<26} {r["status"]:<4} mean {r.get("step_mean_s")} losses {[round(x, 4) for x in (r.get("losses") or [])]} {(r.get("reason") or "")[:150]}')
PY
tar czf ${OUT:-/tmp}/losses.tgz -C /tmp losses
