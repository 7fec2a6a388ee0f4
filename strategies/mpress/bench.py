"""Registers MPress with the benchmark harness (imported by the harness's discovery)."""
from bench.systems import register_system

register_system(
    "mpress",
    "strategies.mpress.bench_system:make",
    options={"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "auto"},
    description="MPress: pipeline stages in their own processes (one device each), activations kept, "
                "recomputed, host- or peer-swapped per block by the planner",
)
