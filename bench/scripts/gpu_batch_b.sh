#!/usr/bin/env bash
# GPU batch B (session 2): host AdamW diagnosis, MemFerry under the 17.7 GB cap with the
# host optimizer's phase times, MPress -m gpu tests. Everything lands in $OUT/batch-b.tgz.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XPU_BACKEND=cuda
W=/tmp/batch-b; rm -rf $W; mkdir -p $W
( lscpu; nproc; free -g ) > $W/cpu.txt 2>&1
python3 -m xpu probe --json > $W/xpu-probe.json 2> $W/probe.err; tail -2 $W/probe.err
timeout 150 python3 bench/scripts/diag_host_adamw.py --full > $W/diag-host-adamw.txt 2>&1; tail -22 $W/diag-host-adamw.txt
timeout 90 python3 -m pytest -m gpu -q tests/test_mpress_gpu.py > $W/pytest-mpress-gpu.txt 2>&1; tail -3 $W/pytest-mpress-gpu.txt
timeout 300 python3 -m xpu bench examples/bench/design-s3-capped.yaml --systems ${SYSTEMS:-memferry-auto,memferry-auto-t14} \
   --steps 20 --no-progress --out $W/capped > $W/capped.log 2>&1
python3 - <<'PY'
import json
d = json.load(open("/tmp/batch-b/capped/results.json"))
for r in d["rows"]:
    print(r["system"], r["status"], r.get("step_s"), r.get("step_mean_s"), r.get("peak_device_gb"), r.get("notes"), (r.get("reason") or "")[:200])
PY
tar czf ${OUT:-/tmp}/batch-b.tgz -C $W .
