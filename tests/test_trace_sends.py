"""bench/scripts/trace_sends.py: a send span's time split by the calls on its thread."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trace_sends():
    spec = importlib.util.spec_from_file_location("trace_sends", ROOT / "bench" / "scripts" / "trace_sends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_calls_are_split_exclusively_and_the_rest_is_python(trace_sends):
    events = [
        _x("grad_post:send", "user_annotation", 100, 100),
        _x("aten::_foreach_copy_", "cpu_op", 110, 60),
        _x("cudaMemcpyAsync", "cuda_runtime", 120, 25),
        _x("cudaMemcpyAsync", "cuda_runtime", 150, 15),
        _x("aten::record_stream", "cpu_op", 175, 10),
        _x("aten::add_", "cpu_op", 120, 50, tid=2),  # another thread: not this send's
        _x("cudaEventRecord", "cuda_runtime", 195, 10),  # runs past the span: not counted
    ]
    n, total, parts = trace_sends.send_parts(events)
    assert (n, total) == (1, 100.0)
    assert parts["aten::_foreach_copy_"] == (1, 20.0)
    assert parts["cudaMemcpyAsync"] == (2, 40.0)
    assert parts["aten::record_stream"] == (1, 10.0)
    assert parts["(python)"] == (1, 30.0)
    assert "aten::add_" not in parts and "cudaEventRecord" not in parts


def test_other_threads_runtime_calls_are_measured_where_they_overlap_the_sends(trace_sends):
    events = [
        _x("grad_post:send", "user_annotation", 100, 100),
        _x("grad_post:send", "user_annotation", 300, 50),
        _x("cudaEventSynchronize", "cuda_runtime", 150, 200, tid=2),  # 50 in the first, 50 in the second
        _x("cudaMemcpyAsync", "cuda_runtime", 120, 10),  # the sending thread's own: not "beside"
        _x("aten::add_", "cpu_op", 100, 100, tid=2),  # an operator, not a runtime call
    ]
    total, over = trace_sends.beside_sends(events)
    assert total == 150.0 and over == {"cudaEventSynchronize": 100.0}


def test_a_real_send_is_named_in_a_profile(trace_sends, cpu_backend, tmp_path):
    from strategies.memferry.config import AdamW
    from strategies.memferry.grad_post import GradientPost

    class _Opt:
        cfg = AdamW()  # what GradientPost reads of the optimizer's settings

        def submit(self, *args, **kwargs):
            self.args = args

    b = cpu_backend
    sources = [b.to_device(torch.randn(5, 3), 0), b.to_device(torch.randn(4), 0)]
    host = b.host_arena.empty(19, torch.float32)
    targets = [host[:15].view(5, 3), host[15:]]
    post = GradientPost(b, 0, b.stream(0), _Opt())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        post.send(0, sources, targets, final=True)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    import json

    n, total, parts = trace_sends.send_parts(json.loads(path.read_text())["traceEvents"])
    assert n == 1 and total > 0
    # The unit's two tensors in one call (the cpu backend's dispatch mode shows it twice, nested).
    assert "aten::_foreach_copy_" in parts and 0 < parts["(python)"][1] < total
    assert torch.equal(host, torch.cat([s.reshape(-1) for s in sources]))
    assert post.parts["copies"] > 0 and post.parts["cpu"] > 0
