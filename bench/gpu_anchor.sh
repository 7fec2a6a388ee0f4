#!/bin/bash
# DESIGN.md §3 anchor scenario on the lent GPU machine (one H200), through `xpu bench`.
#
# Once, here (not on the device): copy the DeepSpeed wheels into the checkout's ignored .whl/
#     bash ../shared/device-wheels/prep.sh
# Then on the device (run tool, carry [".whl"]). One device call may last 600 s, so the
# seven systems run in two calls on the same warm machine; the second merges (--append)
# into the first's results, kept in /tmp on that machine:
#     SYSTEMS=torch,fsdp2-offload,deepspeed-z2-offload,deepspeed-z3-offload bash bench/gpu_anchor.sh
#     SYSTEMS=deepspeed-twinflow-0.5,deepspeed-twinflow-0.2,deepspeed-zenflow bash bench/gpu_anchor.sh
# Without SYSTEMS every system runs in one call (needs about 10 minutes with cold JIT builds).
# Extra arguments go to `xpu bench` (e.g. --device-mem-gb 24). Results: $OUT/design-s3/
# (results.json, results.md, results.png, timelines/, logs/). If the machine went cold between
# the calls, merge the two downloads here with:
#     python3 -m xpu bench --merge A/results.json B/results.json --out bench/results/<date>-<machine>
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
if ! PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1; then
    if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
        DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
            --target "$SITE" .whl/deepspeed-*.tar.gz
    else
        echo "gpu_anchor.sh: no .whl/ (run bash ../shared/device-wheels/prep.sh here and carry .whl);" \
             "DeepSpeed rows will read 'missing'" >&2
    fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XPU_BACKEND=cuda
# DeepSpeed's CPUAdam/FusedAdam build just in time; keep the builds for the next call on this machine.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ds_ext}
RESULTS=${RESULTS:-/tmp/bench-design-s3}
mkdir -p "$RESULTS"

python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)" || true
args=(examples/bench/design-s3.yaml --out "$RESULTS" --append --no-progress)
if [ -n "${SYSTEMS:-}" ]; then
    args+=(--systems "$SYSTEMS")
fi
python3 -m xpu bench "${args[@]}" "$@"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/design-s3"
    cp -r "$RESULTS"/. "$OUT/design-s3/"
fi
