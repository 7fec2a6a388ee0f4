#!/usr/bin/env bash
# Why MemFerry's host AdamW ran 1.6-1.7x slower per parameter inside steps (and alone over many
# units) than the profiler measured on one block-sized buffer (session 4, starved-16gb/compare-17:
# 0.785 and 0.87 ns/param against 0.505), which put the scheduler's prediction 45 % low.
# One device call (about 4 minutes), nvidia-h200, carry .whl not needed:
#   bash bench/scripts/gpu_host_rate.sh
# 1. the CPU and memory layout (NUMA nodes, SMT, frequency governor);
# 2. the profiler's own figure, host_adamw_rate, on one 50 M buffer, with and without DMA load;
# 3. MemFerry's host AdamW alone (the bench's memferry-host-optimizer row) over 2, 5 and 18 units
#    (1, 4 and 17 layers): does the rate per parameter fall as the units grow?
# 4. the same at 17 layers with the host optimizer's threads pinned to 16, then 8, and with the
#    compiled single-pass kernel;
# 4b. the 17-layer alone row again with XPU_HOST_HUGEPAGES=1 (pinned buffers advised onto 2 MiB
#     pages), and whether the kernel gave huge pages at all (AnonHugePages around a 1 GiB buffer);
# 5. also (issue 5's gradient write): diag_dha_linear.py, whose fb_host_ring column says whether
#    host_linear's backward is faster with grad_write="ring" than with the DHA write.
set -uo pipefail
source bench/scripts/gpu_env.sh
R=${OUT:-/tmp}/host-rate; mkdir -p $R
{ lscpu; echo; numactl -H 2>/dev/null || ls -d /sys/devices/system/node/node*; echo;
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null;
  grep -E "MemTotal|Hugepagesize|AnonHugePages" /proc/meminfo; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $R/machine.txt 2>&1
python3 - > $R/profiler-rate.txt 2>&1 <<'PY'
import torch, xpu
from strategies.memferry.profiler import host_adamw_rate
b = xpu.get_backend()
for duty in (0.0, 0.35):
    r = host_adamw_rate(50_331_648, torch.bfloat16, 3, b, "torch", 0, duty)
    print(f"host_adamw_rate one 50 M buffer, dma_duty {duty}: {r * 1e9:.3f} ns/param, threads {torch.get_num_threads()}")
PY
cat $R/profiler-rate.txt
python3 - > $R/buffers-rate.txt 2>&1 <<'PY'  # one buffer reused vs many distinct buffers in turn
import time, statistics, torch, xpu
from strategies.memferry.config import AdamW
from strategies.memferry.host_kernel import make_host_kernel
from strategies.memferry.shadow import UnitShadow
b = xpu.get_backend()
n = 50_331_648
def unit():
    a = b.host_arena
    master, m, v, stage = (a.empty(n, torch.float32) for _ in range(4))
    work, g = a.empty(n, torch.bfloat16), a.empty(n, torch.bfloat16)
    for t in (master, stage): t.normal_()
    for t in (m, v, work, g): t.zero_()
    return UnitShadow(None, work, master, m, v, g, g, None, [])
units = [unit() for _ in range(12)]
k = make_host_kernel("torch", AdamW(lr=1e-4, weight_decay=0.0, host_kernel="torch"), units)
for threads in (torch.get_num_threads(), 8):
    torch.set_num_threads(threads)
    for count in (1, 4, 12):
        ts = []
        for rep in range(3):
            t0 = time.perf_counter()
            for u in units[:count]:
                k.apply(u, 1.0)
            ts.append(time.perf_counter() - t0)
        print(f"threads {threads:2d} units {count:2d}: {min(ts) / (count * n) * 1e9:.3f} ns/param (best of 3), median {statistics.median(ts) / (count * n) * 1e9:.3f}")
PY
cat $R/buffers-rate.txt
for L in 1 4 17; do
  timeout 150 python3 -m xpu bench examples/bench/starved-16gb.yaml --systems memferry-host-optimizer \
    --set model.layers=$L --set steps=5 --out $R/alone-$L --no-progress > $R/alone-$L.log 2>&1
done
python3 - <<'PY'  # one scenario with the host optimizer's threads pinned, 16 then 8
import os, yaml
d = yaml.safe_load(open("examples/bench/starved-16gb.yaml"))
d["systems"] = [{"name": "memferry", "label": f"memferry-host-optimizer-threads{t}",
                 "options": {"measure": "host-optimizer", "host_threads": t}} for t in (16, 8)] + [
    # the compiled single-pass kernel (28 B/param instead of 40), alone: session 2 found it 1.6x
    # faster than the three passes at a fixed size but 3-4x slower inside training steps
    {"name": "memferry", "label": "memferry-host-optimizer-single-pass",
     "options": {"measure": "host-optimizer", "host_kernel": "single-pass"}}]
d["model"]["layers"], d["steps"] = 17, 5
yaml.safe_dump(d, open(os.environ.get("OUT", "/tmp") + "/host-rate/threads.yaml", "w"))
PY
timeout 260 python3 -m xpu bench $R/threads.yaml --out $R/alone-17-threads --no-progress > $R/alone-17-threads.log 2>&1
XPU_HOST_HUGEPAGES=1 timeout 150 python3 -m xpu bench examples/bench/starved-16gb.yaml --systems memferry-host-optimizer \
  --set model.layers=17 --set steps=5 --out $R/alone-17-hugepages --no-progress > $R/alone-17-hugepages.log 2>&1
XPU_HOST_HUGEPAGES=1 python3 - <<'PY' | tee $R/hugepages.txt
import xpu
def anon_huge():
    return [l for l in open("/proc/meminfo") if l.startswith("AnonHugePages")][0].strip()
print("before:", anon_huge())
b = xpu.get_backend()
buf = b.alloc_pinned(1 << 30)
buf.fill_(1)
print("with a 1 GiB pinned buffer (XPU_HOST_HUGEPAGES=1):", anon_huge())
PY
python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", "/tmp")
for f in sorted(glob.glob(f"{out}/host-rate/alone-*/results.json")):
    for r in json.load(open(f))["rows"]:
        ns = r["step_s"] / r["params"] * 1e9 if r.get("step_s") else None
        print(f.split("/")[-2], r["system"], r["status"], r["params"], r.get("step_s"), f"{ns:.3f} ns/param" if ns else r.get("reason"),
              (r.get("notes") or "")[-120:])
PY
timeout 120 python3 bench/scripts/diag_dha_linear.py --ms 1024,4096,16384 > $R/diag-dha-linear.txt 2>&1
grep -A5 "^ *M " $R/diag-dha-linear.txt
