import sys, json, time
root = sys.argv[1]; sys.path.insert(0, root)
from strategies.memferry.scheduler import schedule
from strategies.memferry.cost import predict
from strategies.memferry.links import links_from_probe
from strategies.memferry.profiler import StepProfile
class Dev:
    class caps: dha = True
log, probe, cap = sys.argv[2], sys.argv[3], float(sys.argv[4])
prof = StepProfile.from_json([l for l in open(log) if l.startswith("memferry profile: ")][0][18:])
links = links_from_probe(Dev(), 0, probe=json.load(open(probe)))
for ml in [int(a) for a in sys.argv[5:]]:
    t = time.time()
    p = schedule(prof, links, cap * 1e9, margin=0.05, explain=False, max_labels=ml)
    print(ml, f"{time.time()-t:.1f}s", f"{predict(p, prof, links, 0.05).step_s*1e3:.1f}", "capped" if any("kept at most" in n for n in p.notes) else "exact", flush=True)
