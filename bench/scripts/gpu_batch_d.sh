#!/usr/bin/env bash
# GPU batch D (session 3): MemFerry's per-parameter gradients and first update against plain
# PyTorch on the DESIGN.md §3 width (why its losses left the baselines'), and issue 4's check of
# the host-memory sampler's cost on ZeRO-2 (the +15 % harness gap), with plain PyTorch mixed
# precision beside them. Needs .whl carried. Lands in $OUT/batch-d.tgz.
set -uo pipefail
W=/tmp/batch-d; rm -rf $W; mkdir -p $W
source bench/scripts/gpu_env.sh
timeout 150 python3 bench/scripts/diag_grads.py --layers 2 --plans prefetch,prefetch+recompute,dha > $W/diag-grads.txt 2>&1
timeout 100 python3 bench/scripts/diag_grads.py --layers 2 --plans prefetch+recompute --loss-chunks 8 > $W/diag-grads-lc8.txt 2>&1
grep -v Warning $W/diag-grads.txt | tail -40; tail -14 $W/diag-grads-lc8.txt
for s in 0 0.2; do
  XPU_BENCH_HOST_SAMPLE_S=$s timeout 200 python3 -m xpu bench examples/bench/design-s3.yaml --systems ${SYSTEMS:-deepspeed-z2-offload} \
     --no-progress --no-timeline --out $W/sample-$s > $W/sample-$s.log 2>&1
done
timeout 120 python3 -m xpu bench examples/bench/design-s3.yaml --systems torch-amp --no-progress --no-timeline --out $W/torch-amp > $W/torch-amp.log 2>&1
python3 - <<'PY'
import glob, json
for f in sorted(glob.glob("/tmp/batch-d/*/results.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[3], r["system"], r["status"], "median", r.get("step_s"), "mean", r.get("step_mean_s"),
              "losses", [round(x, 3) for x in (r.get("losses") or [])[:6]], (r.get("reason") or "")[:200])
PY
tar czf ${OUT:-/tmp}/batch-d.tgz -C $W .
