"""Diagnostic: does a generic torch.Stream wait on a torch.cuda.Event? (it decides CudaBackend.current_stream)."""
import torch

n = 256 << 20
src = torch.ones(n, dtype=torch.uint8).pin_memory()
for label, compute in (("generic torch.accelerator stream", torch.accelerator.current_stream(0)),
                       ("torch.cuda.current_stream", torch.cuda.current_stream(0))):
    bad = 0
    for trial in range(5):
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
        compute.wait_event(ev)
        with torch.cuda.stream(torch.cuda.current_stream(0)):
            total = int(dst.sum(dtype=torch.int64).item())
        bad += total != n
        torch.cuda.synchronize()
    print(f"{label:36s} wrong sums: {bad}/5")
