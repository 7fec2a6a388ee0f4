#!/usr/bin/env bash
# Runs on nvidia-h200-x2 (the multi-GPU issue), one mode per device call on one warm machine.
# Carry .whl (bash ../shared/device-wheels/prep.sh here first).
#   bash bench/scripts/gpu_x2.sh smoke    # topology, the multi-GPU pytest, small x2 benches, xpu probe per GPU,
#                                         # the multi-path copier (in that order: the most telling first)
#   bash bench/scripts/gpu_x2.sh mpress   # examples/bench/x2-mpress.yaml
#   bash bench/scripts/gpu_x2.sh dp       # examples/bench/x2-dp.yaml
#   bash bench/scripts/gpu_x2.sh mpress-max  # largest model: MPress vs recompute-only at the 10 GB cap; the
#       search writes into the checkout (bench/results/x2-mpress-max/) with its trial journal: unpack
#       $OUT/x2-mpress-max.tgz here after a cut-off call and the next call goes on from there.
#       KNOB=LO:HI narrows the layer range, RESOLUTION=N stops bisecting within N layers (saves trials).
# Every step gets what is left of DEADLINE_S (570 s, under the device's 600 s per call, counted
# from this script's start, DeepSpeed's install included), and a step with under 20 s left is
# skipped, so the results always come back: $OUT/x2-<mode>.tgz (everything under /tmp/x2/<mode>).
set -uo pipefail
t0=$(date +%s)
MODE=${1:?mode: smoke | mpress | dp | mpress-max}
DEADLINE_S=${DEADLINE_S:-570}
left() { echo $(( DEADLINE_S - 15 - ($(date +%s) - t0) )); }  # seconds a step may take (15 s kept for tar)
lap() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# within MAX CMD...: run CMD for at most MAX seconds and what is left, or skip it
within() { local max=$1; shift; local n; n=$(left)
           if [ "$n" -lt 20 ]; then lap "skipped (no time left): $*"; return 124; fi
           [ "$max" -lt "$n" ] && n=$max; timeout "$n" "$@"; }
source bench/scripts/gpu_env.sh
R=/tmp/x2/$MODE; [ "$MODE" = mpress-max ] && R=bench/results/x2-mpress-max; mkdir -p $R
case $MODE in
smoke)
  { date -u; nvidia-smi -L; nvidia-smi topo -m; nvidia-smi nvlink -s 2>&1 | head -40;
    python3 -c 'import torch; print("torch", torch.__version__, "devices", torch.cuda.device_count(), "p2p", torch.cuda.can_device_access_peer(0, 1))';
    env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' ; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } > $R/topology.txt 2>&1
  lap topology; head -30 $R/topology.txt
  within 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rs ${TESTS:-tests/test_multigpu.py tests/test_scaleup_gpu.py} > $R/pytest-gpu.txt 2>&1
  lap pytest rc=$?; tail -30 $R/pytest-gpu.txt
  # The x2 scenarios' systems on a small GPT: NCCL, the multi-path copier, DeepSpeed's CPUAdam build (warmed
  # here for the later calls), MPress's stage processes.
  SMALL="--set model.layers=4 --set model.hidden=512 --set model.heads=8 --set model.vocab=4096 --set seq=256 --set steps=3 --set warmup=1 --set loss_after=3"
  within 150 python3 -m xpu bench examples/bench/x2-dp.yaml $SMALL --systems memferry-dp-x2,z2-offload-x2 --out $R/small-dp --no-progress > $R/small-dp.log 2>&1; lap small dp rc=$?
  within 90 python3 -m xpu bench examples/bench/x2-mpress.yaml $SMALL --systems mpress-keep,mpress-recompute-10gb --out $R/small-mpress --no-progress > $R/small-mpress.log 2>&1; lap small mpress rc=$?
  grep -h "^| " $R/small-*/results.md 2>/dev/null | cut -c1-260
  within 90 python3 -m xpu probe --device 1 --json > $R/xpu-probe-dev1.json 2> $R/xpu-probe-dev1.log; lap probe dev1 rc=$?
  within 90 python3 -m xpu probe --device 0 --json > $R/xpu-probe-dev0.json 2> $R/xpu-probe-dev0.log; lap probe dev0 rc=$?
  within 60 python3 -m bench.transfers.multipath --targets 0 --sizes 256MiB,1GiB --preset dgx-h200 --out $R/multipath-dev0 > $R/multipath-dev0.log 2>&1; lap multipath dev0 rc=$?
  within 60 python3 -m bench.transfers.multipath --targets all --sizes 256MiB,1GiB --preset dgx-h200 --out $R/multipath-all > $R/multipath-all.log 2>&1; lap multipath all rc=$?
  tail -25 $R/multipath-dev0.log 2>/dev/null; tail -12 $R/multipath-all.log 2>/dev/null
  ;;
mpress-max)
  within 560 python3 -m xpu bench examples/bench/x2-mpress.yaml --max-model \
    --systems ${SYSTEMS:-mpress-10gb,mpress-recompute-10gb} ${KNOB:+--knob-range $KNOB} \
    ${RESOLUTION:+--set max_model.resolution=$RESOLUTION} --out $R --no-progress > $R/max-model-$(date +%H%M%S).log 2>&1
  lap max-model rc=$?
  cat $R/max_model.md 2>/dev/null | grep "^| " | cut -c1-200
  tar czf ${OUT:-/tmp}/x2-$MODE.tgz $R; exit 0
  ;;
mpress|dp)
  probe_once $R
  lap probe
  within 560 python3 -m xpu bench examples/bench/x2-$MODE.yaml ${SYSTEMS:+--systems "$SYSTEMS"} --out $R --append --no-progress > $R/bench-$(date +%H%M%S).log 2>&1
  lap bench rc=$?
  python3 - "$R" <<'PY'
import json, os, sys
r = sys.argv[1]
f = os.path.join(r, "results.json") if os.path.exists(os.path.join(r, "results.json")) else os.path.join(r, "results.partial.json")
for row in json.load(open(f))["rows"] if os.path.exists(f) else []:
    print(f'{row["system"]:<24} {row["status"]:<6} median {row.get("step_s")} mean {row.get("step_mean_s")} '
          f'loss {row.get("loss")} | {row.get("notes") or ""} {(row.get("reason") or "")[:300]}')
PY
  ;;
esac
tar czf ${OUT:-/tmp}/x2-$MODE.tgz -C /tmp/x2 $MODE
