"""The plan of least memory (strategies/memferry/least_memory.py) and the scheduler's fallback to
it, on the scheduler tests' random profiles and the H200 profile of docs/design.md §3.
Run from the repository root: PYTHONPATH=. python THIS > least-memory.md"""
import dataclasses, random, sys, time
sys.path.insert(0, "tests")
from test_memferry_scheduler import H200_LINKS, _fix, h200_profile, random_links, random_profile
from strategies.memferry.cost import predict
from strategies.memferry.least_memory import least_memory
from strategies.memferry.scheduler import NoPlanFitsError, schedule, unit_choices

print("## Least budget and its plan\n\n| profile | blocks | seed | least budget (B) | its plan predicted (B) | search (s) |\n|---|---:|---:|---:|---:|---:|")
for n in (8, 16, 24, 48):
    for seed in range(3):
        rng = random.Random(seed)
        prof, links = _fix(random_profile(rng, n)), random_links(rng)
        t = time.time()
        need, plan = least_memory(prof, links, unit_choices(bool(links.dha_read_GBps), True, prof.accumulation_steps > 1))
        dt = time.time() - t
        print(f"| random | {n} | {seed} | {need} | {predict(plan, prof, links, 0.10).peak_bytes} | {dt:.2f} |", flush=True)
base = h200_profile()
for n in (24, 64, 128):
    for acc in (1, 8):
        prof = dataclasses.replace(base, blocks=[base.blocks[0]] * n, accumulation_steps=acc)
        t = time.time()
        need, plan = least_memory(prof, H200_LINKS, unit_choices(device_sum=acc > 1))
        dt = time.time() - t
        print(f"| §3 H200, accumulation {acc} | {n} | - | {need} | {predict(plan, prof, H200_LINKS, 0.10).peak_bytes} | {dt:.2f} |", flush=True)

print("\n## The scheduler at the least budget\n\n| blocks | search limits | seed | result | predicted peak / budget | time (s) |\n|---:|---|---:|---|---:|---:|")
for n, labels in ((50, "auto"), (12, 3)):
    for seed in range(4):
        rng = random.Random(seed)
        prof, links = _fix(random_profile(rng, n)), random_links(rng)
        need, _ = least_memory(prof, links, unit_choices(bool(links.dha_read_GBps), True, prof.accumulation_steps > 1))
        t = time.time()
        try:
            plan = schedule(prof, links, need, n, explain=False, max_labels=labels)
            fell = any("plan of least device memory" in x for x in plan.notes)
            res = "plan of least memory" if fell else "searched plan"
            ratio = f"{predict(plan, prof, links, 0.10).peak_bytes / need:.3f}"
        except NoPlanFitsError as e:
            res, ratio = f"NoPlanFitsError (names {e.minimum})", "-"
        limits = "groups of 3, 300 labels" if n == 50 else "3 labels"
        print(f"| {n} | {limits} | {seed} | {res} | {ratio} | {time.time() - t:.1f} |", flush=True)
