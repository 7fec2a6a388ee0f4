#!/usr/bin/env bash
# bench/scripts/gpu_tests.sh: the `-m gpu` tests on the device machine, within the deadline,
# with the whole log kept under $OUT.
#
# Usage: bash bench/scripts/gpu_tests.sh [TEST FILES or PYTEST ARGS...]    (default: tests/)
#   Runs `python3 -m pytest -m gpu -q -rs -p no:cacheprovider ARGS`, at most what is left of
#   DEADLINE_S (570 s after GPU_T0, see gpu_env.sh), from the checkout's root.
# Environment: LOG (default pytest-gpu.log) names the log, written to $OUT (or /tmp).
# Output: the log's last lines printed; the exit status is pytest's (124: cut by the deadline).
#
# Examples:
#   bash bench/scripts/gpu_tests.sh
#   LOG=pytest-memferry.log bash bench/scripts/gpu_tests.sh tests/test_memferry_gpu.py tests/test_memferry_dha_linear.py
#   bash bench/scripts/gpu_tests.sh tests/test_multigpu.py tests/test_scaleup_gpu.py    # on nvidia-h200-x2
set -uo pipefail
source bench/scripts/gpu_env.sh
LOGFILE=${OUT:-/tmp}/${LOG:-pytest-gpu.log}
mkdir -p "$(dirname "$LOGFILE")"
[ $# -eq 0 ] && set -- tests/
within 100000 python3 -m pytest -m gpu -q -rs -p no:cacheprovider "$@" > "$LOGFILE" 2>&1
rc=$?
lap "pytest -m gpu $* rc=$rc (log $LOGFILE)"
tail -30 "$LOGFILE"
exit $rc
