"""One module per device family; each registers here with one line.

The NPU backend keeps its helpers beside it: ``npu_topology`` (npu-smi, nominal rates) and
``npu_hostreg`` (host-memory registrations).

Higher priority wins auto-detection (``XPU_BACKEND`` unset): an NPU, then a CUDA GPU, else
the cpu reference backend.
"""
from xpu.registry import register_backend

register_backend("npu", "backends.npu:NpuBackend", priority=30)
register_backend("cuda", "backends.cuda:CudaBackend", priority=20)
register_backend("cpu", "backends.cpu:CpuBackend", priority=0)
