#!/usr/bin/env bash
# On the GPU machine: xpu info, xpu probe --json, and the -m gpu conformance suite, logs under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1
python3 -m xpu info > "$OUT/xpu-info.txt" 2>&1
python3 -m xpu info --json > "$OUT/xpu-info.json" 2>>"$OUT/xpu-info.txt"
python3 -m xpu probe --json > "$OUT/probe.json" 2> "$OUT/probe.err"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest-gpu.txt" 2>&1
tail -40 "$OUT/pytest-gpu.txt"; cat "$OUT/xpu-info.txt"; tail -5 "$OUT/probe.err"
python3 - "$OUT/probe.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.endswith("GBps"): print(f"{k:24s} {v}")
print("matmul_TFLOPs", d.get("matmul_TFLOPs"))
for r in d.get("dha_matmul", []): print(r)
PY
