#!/usr/bin/env bash
# GPU batch: foundation (info, probe, -m gpu tests), scaleup engine bench, MemFerry plans on the DESIGN GPT.
# Everything lands in $OUT/batch-a.tgz (the device tool returns at most 8 files).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/batch-a; rm -rf $W; mkdir -p $W/foundation $W/scaleup $W/memferry
( OUT=$W/foundation bash bench/scripts/gpu_foundation.sh > $W/foundation/summary.txt 2>&1 )
tail -3 $W/foundation/pytest-gpu.txt
python3 bench/scripts/diag_stream_event.py 2>&1 | tee $W/foundation/diag-stream-event.txt
python3 -m bench.transfers.engine --out $W/scaleup > $W/scaleup/log.txt 2>&1; tail -9 $W/scaleup/log.txt
timeout 400 python3 examples/memferry_gpt.py --preset design --steps 5 --warmup 2 \
  --plans "${PLANS:-plain,prefetch,prefetch2,prefetch+recompute,resident12}" --json $W/memferry/plans.jsonl \
  > $W/memferry/log.txt 2>&1; tail -12 $W/memferry/log.txt
tar czf ${OUT:-/tmp}/batch-a.tgz -C $W .
