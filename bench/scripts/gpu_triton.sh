#!/usr/bin/env bash
# Session 5, call 4: xpu.triton_dha on the H200 (GPU tests, diag_dha_triton.py against cuBLAS) and
# the private huge-page mapping (AnonHugePages; the 17-layer host AdamW alone, without and with
# XPU_HOST_HUGEPAGES=1). One device call, carry .whl:  bash bench/scripts/gpu_triton.sh
source bench/scripts/gpu_env.sh
R=$OUT/triton; mkdir -p $R
python3 -c "import triton, torch; print('triton', triton.__version__)" 2>&1 | tee $R/versions.txt
timeout 150 python3 -m pytest -q -m gpu tests/test_triton_dha.py tests/test_memferry_dha_linear.py tests/test_memferry_gpu.py > $R/pytest-gpu.log 2>&1; tail -3 $R/pytest-gpu.log
timeout 90 python3 bench/scripts/diag_dha_triton.py > $R/diag-dha-triton.txt 2>&1; grep -v '^{' $R/diag-dha-triton.txt | tail -14
XPU_HOST_HUGEPAGES=1 python3 - <<'PY' | tee $R/hugepages.txt
import xpu
def anon(): return [l for l in open("/proc/meminfo") if l.startswith("AnonHugePages")][0].strip()
print("before:", anon()); b = xpu.get_backend(); buf = b.alloc_pinned(1 << 30); buf.fill_(1)
print("1 GiB pinned buffer, XPU_HOST_HUGEPAGES=1:", anon())
PY
for hp in 0 1; do XPU_HOST_HUGEPAGES=$hp timeout 70 python3 -m xpu bench examples/bench/starved-16gb.yaml --systems memferry-host-optimizer --set model.layers=17 --set steps=5 --out $R/alone-17-hp$hp --no-progress > $R/alone-17-hp$hp.log 2>&1; grep "^| memferry" $R/alone-17-hp$hp/results.md | cut -c1-90; done
tar czf $OUT/triton.tgz -C $OUT triton
