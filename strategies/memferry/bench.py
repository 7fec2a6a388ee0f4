"""Registers MemFerry with the benchmark harness (imported by the harness's discovery)."""
from bench.systems import register_system

register_system(
    "memferry",
    "strategies.memferry.bench_system:make",
    options={"plan": "prefetch+recompute", "max_grad_norm": None, "host_threads": None,
             "host_kernel": "auto", "loss_chunks": 1, "memory_margin": 0.10},
    description="MemFerry: parameters homed in host memory; per-block prefetch / DHA / device-homed plans",
)
