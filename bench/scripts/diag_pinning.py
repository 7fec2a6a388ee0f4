"""Diagnostic: how fast the backend pins host memory, and what the kernel does meanwhile.

    python3 bench/scripts/diag_pinning.py [--gib 16] [--buffers 16] [--ways plain,prefault,private,huge,hugefault]

Why: making the 128-layer GPT's shadow (about 98 GB pinned) took 73 s on an H100 host, and
meanwhile the kernel sent up to 480 k TLB-shootdown interrupts a second to the cores running the
process's threads, beside 300-700 k page faults and frees a second
(bench/results/2026-12-06-h100-session37/). This script asked whether the pinning sends them.

Each way below pins ``--gib`` GiB as ``--buffers`` equal buffers, the way the host arena takes a
shadow's buffers, and writes each once (as making a shadow does). It prints the times, then the
/proc/vmstat and /proc/interrupts deltas (page faults, compaction, migrations, TLB shootdowns):

``plain``     4 KiB pages of a shared mapping, registered as it is: the arena before session 38;
``prefault``  the same mapping first touched by torch's thread pool (every core faults pages
              at once), then registered;
``private``   a private anonymous mapping (the default is shared: shmem), registered. Why: the
              kernel skips pinned private pages when it compacts memory (their extra reference
              shows), but it may try, and fail, to migrate pinned shmem pages, each try
              unmapping the page on every core: a guess at the storm's source, which
              ``pgmigrate_fail`` and ``compact_isolated`` would show;
``huge``      a private mapping advised onto 2 MiB pages, registered as it is: the arena in
              session 38;
``hugefault`` ``backend.alloc_pinned`` as it is now (``hostmem.mapped_buffer``): the same mapping
              first touched by torch's thread pool, then registered. The kernel zeroes each huge
              page on the thread that faults it, so one registering thread zeroes them all
              (5.5 GB/s in session 38) where the pool's threads share the work.

Session 38 ran it on an H100 host (bench/results/2026-12-06-h100-session38/pinning.txt): pinning
alone sent no storm any way (under 40 shootdowns for 16 GiB); ``huge`` pinned in 3.1 s against
7.3 s ``plain``. The storms came from compaction while a 98 GB shadow was made (see that README).
Session 39 on the H200's host (bench/results/2026-12-06-h200-session39/call1/pinning.txt):
``hugefault`` 0.87 s against ``huge`` 2.82 s, so the backends fault their buffers that way since.

Every buffer is freed before the next way starts. On the cpu backend it runs as a rehearsal of
the script only: there nothing is pinned, and ``alloc_pinned`` (``hugefault``) is plain torch memory.
"""
from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import time
from typing import Iterator

import torch

import xpu
from xpu.hostmem import ENV, anonymous_mapping

VMSTAT = ("pgfault", "pgfree", "pgmigrate_success", "pgmigrate_fail", "compact_isolated", "compact_migrate_scanned",
          "compact_stall", "thp_fault_alloc")


def counters() -> dict[str, int]:
    """The kernel's running totals this script reports: /proc/vmstat's :data:`VMSTAT` and the
    TLB-shootdown and function-call interrupts summed over cores (absent keys read 0)."""
    out = dict.fromkeys(VMSTAT, 0) | {"TLB": 0, "CAL": 0}
    try:
        with open("/proc/vmstat") as fh:
            for line in fh:
                key, value = line.split()
                if key in out:
                    out[key] = int(value)
        with open("/proc/interrupts") as fh:
            for line in fh:
                parts = line.split()
                if parts and parts[0].rstrip(":") in ("TLB", "CAL"):
                    out[parts[0].rstrip(":")] = sum(int(p) for p in parts[1:] if p.isdigit())
    except OSError:
        pass
    return out


@contextlib.contextmanager
def _huge_pages(value: str) -> Iterator[None]:
    """``XPU_HOST_HUGEPAGES`` set to ``value`` meanwhile (read when a buffer is mapped)."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = value
    try:
        yield
    finally:
        os.environ.pop(ENV) if saved is None else os.environ.__setitem__(ENV, saved)


def pin(backend: xpu.Backend, way: str, nbytes: int) -> tuple[torch.Tensor, object]:
    """One pinned buffer of ``nbytes`` made ``way``; (the buffer, what to keep alive with it)."""
    if way == "hugefault":  # the backends' own way since session 39 (hostmem.mapped_buffer)
        with _huge_pages("1"):
            return backend.alloc_pinned(nbytes), None
    # a mapping of our own, registered as the backend would
    if way in ("plain", "huge"):
        with _huge_pages("1" if way == "huge" else "0"):
            mapping = anonymous_mapping(nbytes)
    elif way == "prefault":
        mapping = mmap.mmap(-1, nbytes)
    else:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    if way == "prefault":
        buf.zero_()  # torch's intra-op pool: the pages are faulted in by every core at once
    backend.register_host(buf)
    return buf, mapping


def main() -> None:
    """Pin and free ``--gib`` GiB each way named by ``--ways``; one line per way."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="GiB pinned each way (default 16)")
    ap.add_argument("--buffers", type=int, default=16, help="equal buffers they are cut into (default 16)")
    ap.add_argument("--ways", default="plain,prefault,private,huge,hugefault",
                    help="comma list: plain, prefault, private, huge, hugefault")
    args = ap.parse_args()
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(ways) - {"plain", "prefault", "private", "huge", "hugefault"})
    if unknown or args.gib <= 0 or args.buffers < 1:
        ap.error(f"--ways takes plain, prefault, private, huge, hugefault (got {unknown}); --gib > 0 and --buffers >= 1")
    backend = xpu.get_backend()
    each = int(args.gib * (1 << 30)) // args.buffers
    print(f"backend {backend.name}, {args.buffers} buffers of {each / (1 << 30):.2f} GiB, threads {torch.get_num_threads()}")
    for way in ways:
        before, t0 = counters(), time.perf_counter()
        held = [pin(backend, way, each) for _ in range(args.buffers)]
        pinned_s = time.perf_counter() - t0
        for buf, _ in held:
            buf.fill_(1)  # as making a shadow writes every buffer once
        written_s = time.perf_counter() - t0
        after = counters()
        for buf, _ in held:
            backend.unregister_host(buf)
        del held
        moved = " ".join(f"{k} {after[k] - before[k]:,}" for k in after)
        print(f"{way:9s}: pinned in {pinned_s:.2f} s, and written once in {written_s:.2f} s "
              f"({args.buffers * each / written_s / 1e9:.2f} GB/s); {moved}", flush=True)


if __name__ == "__main__":
    main()
