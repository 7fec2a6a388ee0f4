"""Diagnostic: where the training thread's gradient sends spend their time, from a raw trace.

    python3 bench/scripts/trace_sends.py RESULTS_DIR/timelines/<system>.raw.json.gz [--span grad_post:send]

Runs on any machine (no device). Reads the raw ``torch.profiler`` trace a bench run keeps with
``--raw-trace`` and, inside every ``grad_post:send`` span (``GradientPost.send``'s
``record_function``), adds up the time of the calls made on that span's thread: operators
(``cpu_op``, exclusive of the operators they call) and runtime/driver calls (``cuda_runtime``,
``cuda_driver``), by name. What is left over is Python between the calls. Prints one table, most
time first, in microseconds per span: which call makes a send cost 0.5 ms where it costs 0.15 ms
alone (``diag_grad_post.py``). Then the runtime calls other threads were inside meanwhile (the
host optimizer's worker waiting on a landing event, spinning by default: ``AdamW.landing_wait``).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

import numpy as np

CALLS = ("cpu_op", "cuda_runtime", "cuda_driver")


def send_parts(events: list[dict], span: str = "grad_post:send") -> tuple[int, float, dict[str, tuple[int, float]]]:
    """Spans named ``span``: how many, their total microseconds, and per call name inside them
    (same process and thread) its count and exclusive microseconds; ``"(python)"`` is the rest."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("name") == span]
    by_thread: dict[tuple, list[dict]] = defaultdict(list)  # each thread's calls by start, for bisection
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in CALLS:
            by_thread[(e["pid"], e["tid"])].append(e)
    starts = {}
    for key, calls in by_thread.items():
        calls.sort(key=lambda c: (c["ts"], -c["dur"]))
        starts[key] = [c["ts"] for c in calls]
    parts: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    total = 0.0
    for sp in spans:
        a, b, key = sp["ts"], sp["ts"] + sp["dur"], (sp["pid"], sp["tid"])
        calls = by_thread.get(key, [])
        lo, hi = bisect.bisect_left(starts.get(key, []), a), bisect.bisect_right(starts.get(key, []), b)
        inside = [c for c in calls[lo:hi] if c["ts"] + c["dur"] <= b]
        covered = 0.0
        stack: list[tuple[float, dict]] = []  # open calls (end, event), to take children's time off
        exclusive = {id(c): float(c["dur"]) for c in inside}
        for c in inside:
            while stack and stack[-1][0] <= c["ts"]:
                stack.pop()
            if stack:
                exclusive[id(stack[-1][1])] -= c["dur"]
            else:
                covered += c["dur"]  # top level: the span's time spent in calls
            stack.append((c["ts"] + c["dur"], c))
        for c in inside:
            parts[c["name"]][0] += 1
            parts[c["name"]][1] += exclusive[id(c)]
        parts["(python)"][0] += 1
        parts["(python)"][1] += sp["dur"] - covered
        total += sp["dur"]
    return len(spans), total, {k: (int(n), t) for k, (n, t) in parts.items()}


def beside_sends(events: list[dict], span: str = "grad_post:send") -> tuple[float, dict[str, float]]:
    """The spans' total microseconds, and per runtime/driver call made on OTHER threads the
    microseconds of it that overlapped them: e.g. the host optimizer's worker inside
    ``cudaEventSynchronize`` (spinning, by default) while the training thread sent."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("name") == span]
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in CALLS[1:]]
    names = sorted({c["name"] for c in calls})
    index = {n: i for i, n in enumerate(names)}
    code = np.array([index[c["name"]] for c in calls], dtype=np.int64)
    start = np.array([c["ts"] for c in calls], dtype=np.float64)
    end = start + np.array([c["dur"] for c in calls], dtype=np.float64)
    thread = [(c["pid"], c["tid"]) for c in calls]
    own: dict[tuple, np.ndarray] = {}  # per sending thread: which calls are its own
    total, over = 0.0, np.zeros(len(names))
    for sp in spans:  # vectorised over the calls: a step has tens of thousands
        a, b, key = sp["ts"], sp["ts"] + sp["dur"], (sp["pid"], sp["tid"])
        if key not in own:
            own[key] = np.array([t == key for t in thread], dtype=bool)
        total += sp["dur"]
        o = np.clip(np.minimum(b, end) - np.maximum(a, start), 0.0, None)
        o[own[key]] = 0.0
        over += np.bincount(code, weights=o, minlength=len(names))
    return total, {n: float(v) for n, v in zip(names, over) if v > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a raw profiler trace (Chrome trace JSON, optionally gzipped)")
    ap.add_argument("--span", default="grad_post:send", help="the record_function name to split")
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    n, total, parts = send_parts(events, args.span)
    if not n:
        raise SystemExit(f"no '{args.span}' span in {args.trace}: was it recorded with --raw-trace, after this code?")
    print(f"{n} spans '{args.span}', {total / n:.0f} us each on average")
    print("| call | calls per span | us per span | share |")
    print("|---|---:|---:|---:|")
    for name, (count, us) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count / n:.1f} | {us / n:.1f} | {us / total:.0%} |")
    _, over = beside_sends(events, args.span)
    print("\nMeanwhile on other threads (runtime calls overlapping the sends; share of the sends' time):")
    print("| call | us per span | share |")
    print("|---|---:|---:|")
    for name, us in sorted(over.items(), key=lambda kv: -kv[1])[:10]:
        print(f"| {name} | {us / n:.1f} | {us / total:.0%} |")


if __name__ == "__main__":
    main()
