# Sourced by the GPU scripts (from the checkout's root): DeepSpeed from the carried .whl/ into
# /tmp/site (once per machine), the environment every run shares, and `probe_once DIR`.
SITE=/tmp/site
if [ -d .whl ] && ! PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .whl/deepspeed-*.tar.gz
fi
# NVLink multicast stays off on the lent machines (device README), in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 XPU_BACKEND=cuda TORCH_EXTENSIONS_DIR=/tmp/ds_ext

# The scheduler plans with measured link rates: probe once per machine (cached), the JSON into $1.
probe_once() {
  python3 -c "import sys, xpu; from xpu.probe import load_cached; sys.exit(load_cached(xpu.get_backend()) is None)" \
    || python3 -m xpu probe --json > "$1/xpu-probe.json" 2>/dev/null
}
