#!/usr/bin/env bash
# bench/scripts/sample_host.sh: what the host's kernel is doing, every INTERVAL seconds, until killed.
# Why: a rehearsal's host updates ran 1.2-1.5x slower than the same plan's training steps a minute
# later, with a million interrupts a second and 7 % system time (vmstat, H100, session 36); the
# kind of interrupt and the memory counters say which mechanism it is.
# Usage: bash bench/scripts/sample_host.sh OUT_FILE [INTERVAL] &   (one line per sample: the time,
#   interrupt totals by kind from /proc/interrupts, then memory counters from /proc/vmstat)
OUT=${1:?usage: sample_host.sh OUT_FILE [INTERVAL]}
INTERVAL=${2:-2}
KEYS='pgfault|pgmajfault|pgmigrate_fail|compact_isolated|thp_fault_alloc|thp_collapse_alloc|compact_stall|compact_migrate_scanned|pgmigrate_success|numa_hint_faults|nr_tlb_remote_flush|nr_tlb_remote_flush_received|nr_tlb_local_flush_all|pgscan_kswapd|pgsteal_kswapd|pgfree'
while true; do
  irq=$(awk 'NR > 1 { s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; if (s > 0) printf "%s=%d ", $1, s }' /proc/interrupts \
        | tr ' ' '\n' | grep -E '^(TLB|CAL|RES|LOC|IWI|PMI|NMI|[0-9]+):' | sort -t= -k2 -nr | head -12 | tr '\n' ' ')
  mem=$(grep -E "^($KEYS) " /proc/vmstat | tr ' ' '=' | tr '\n' ' ')
  echo "$(date +%T.%N | cut -c1-12) $irq| $mem" >> "$OUT"
  sleep "$INTERVAL"
done
