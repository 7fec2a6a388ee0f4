# bench/scripts/gpu_env.sh: the set-up every GPU script shares. Sourced, never run, from the
# checkout's root on the device machine (the other gpu_*.sh source it themselves).
#
# Usage:   source bench/scripts/gpu_env.sh
# Example: source bench/scripts/gpu_env.sh && within 60 python3 bench/scripts/diag_dw_write.py
#
# Once per machine (a warm machine keeps /tmp between calls):
#   - DeepSpeed and its dependencies from the carried .whl/ into /tmp/site (skipped without
#     .whl/: prepare it here with `bash ../shared/device-wheels/prep.sh`, then carry [".whl"]);
#   - this checkout installed editable (`pip install -e .`, no dependencies, no index), so the
#     `xpu` command and the entry-point groups (xpu.commands, xpu.backends) are registered;
#     done again when the checkout's path or pyproject.toml changes.
# Every time: the environment of every run (PYTHONPATH, XPU_BACKEND=cuda, NVLink multicast
# off, DeepSpeed's build folder) and these helpers:
#   probe_once DIR     `xpu probe` once per machine kind (cached); its JSON into DIR the first time
#   left               seconds left before the deadline, DEADLINE_S (570) after GPU_T0
#   within MAX CMD...  run CMD for at most MAX seconds and what is left; skipped (rc 124) under 20 s
#   lap MESSAGE        print MESSAGE with the seconds since GPU_T0
#   pack_out DIR...    the DIRs, and every file already under $OUT, into ONE $OUT/results.tar.gz
#                      (the device tool brings back at most 8 files and silently drops the rest:
#                      session 26 lost a diagnosis and a row that way); run it last
# GPU_T0 is set here unless already exported: `export GPU_T0=$(date +%s)` before several
# scripts in one device call gives them one deadline (the device allows 600 s per call).

SITE=/tmp/site
export GPU_T0=${GPU_T0:-$(date +%s)}
export DEADLINE_S=${DEADLINE_S:-570}

# A marker spares the later scripts of a call the import check (it imports torch: seconds).
if [ -d .whl ] && [ ! -f "$SITE/.deepspeed-installed" ]; then
  if ! PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .whl/deepspeed-*.tar.gz
  fi
  PYTHONPATH="$SITE" python3 -c "import deepspeed" >/dev/null 2>&1 && touch "$SITE/.deepspeed-installed"
fi

# The editable install registers the package's entry points; a marker keyed by the checkout's
# path and pyproject.toml keeps it to once per machine and checkout.
_xpu_key="$PWD $(cksum < pyproject.toml)"
if [ "$(cat "$SITE/.xpu-offload-editable" 2>/dev/null)" != "$_xpu_key" ]; then
  mkdir -p "$SITE"
  if PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
       --no-deps --no-build-isolation --no-index -e . > "$SITE/pip-editable.log" 2>&1; then
    echo "$_xpu_key" > "$SITE/.xpu-offload-editable"
  else
    # No build backend offline: write the package's metadata into /tmp/site by hand (importlib
    # reads entry points from any *.dist-info on sys.path; modules come from $PWD as before).
    echo "gpu_env.sh: pip install -e . failed (see $SITE/pip-editable.log); registering the entry points by hand" >&2
    python3 - "$SITE" <<'PY' && echo "$_xpu_key" > "$SITE/.xpu-offload-editable"
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n" for g, items in groups.items()))
PY
  fi
fi
unset _xpu_key

# NVLink multicast stays off on the lent machines (device README), in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 XPU_BACKEND=cuda TORCH_EXTENSIONS_DIR=/tmp/ds_ext

# The scheduler plans with measured link and host-memory rates: probe once per machine (cached;
# again when the cache predates the host section), the JSON into $1.
probe_once() {
  python3 -c "import sys, xpu; from xpu.probe import load_cached; c = load_cached(xpu.get_backend()); sys.exit(c is None or 'host' not in c)" \
    || python3 -m xpu probe --json > "$1/xpu-probe.json" 2>/dev/null
}

left() { echo $(( DEADLINE_S - ($(date +%s) - GPU_T0) )); }
lap() { echo "[$(( $(date +%s) - GPU_T0 )) s] $*"; }
pack_out() {
  [ -n "${OUT:-}" ] || return 0
  local stage=/tmp/pack-out; rm -rf "$stage"; mkdir -p "$stage"
  find "$OUT" -maxdepth 1 -type f -exec mv {} "$stage/" \;
  for d in "$@"; do [ -e "$d" ] && cp -r "$d" "$stage/"; done
  tar czf "$OUT/results.tar.gz" --exclude='*.raw.json.gz' --exclude='*.png' -C "$stage" .
  lap "packed $(ls "$stage" | wc -l) entries into $OUT/results.tar.gz"
}
within() {
  local max=$1 n; shift; n=$(left)
  if [ "$n" -lt 20 ]; then lap "skipped (no time left): $*"; return 124; fi
  [ "$max" -lt "$n" ] && n=$max
  timeout "$n" "$@"
}
