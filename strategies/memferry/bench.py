"""Registers MemFerry with the benchmark harness (imported by the harness's discovery)."""
from bench.systems import register_system

register_system(
    "memferry",
    "strategies.memferry.bench_system:make",
    options={"plan": "prefetch+recompute", "max_grad_norm": None, "host_threads": None,
             "host_kernel": "auto", "loss_chunks": 1, "memory_margin": 0.10,
             "measure": "step"},
    description="MemFerry: parameters homed in host memory; per-block prefetch / DHA / device-homed plans",
)

register_system(
    "memferry-dp",
    "strategies.memferry.bench_dp:make",
    options={"ranks": 2, "plan": "prefetch+recompute", "max_grad_norm": None, "loss_chunks": 1,
             "host_threads": None, "host_kernel": "auto", "memory_margin": 0.10},
    description="MemFerry data parallel: one rank process per device, the scenario's batch split between "
                "them, gradients averaged, host optimizer sharded by rank",
)
