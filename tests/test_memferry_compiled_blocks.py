"""``MemFerry(compile_blocks=True)`` (``compiled_blocks.py``): blocks run through ``torch.compile``
where they can and train as the eager engine does; blocks read over the link stay eager; the
profile is taken on compiled copies; ``close()`` gives each block its forward back (cpu backend,
Inductor's C++ code: a few seconds of compiling per test)."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.planning import plan_for
from strategies.models import build_model

DIMS = dict(layers=2, hidden=32, heads=4, vocab=64, seq=16)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", dtype=torch.float32, **DIMS)


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, DIMS["vocab"], (steps, 2, DIMS["seq"] + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tok]


def _compiled(forward) -> bool:
    """Whether ``forward`` is torch.compile's wrapper (or recomputation's partial around one)."""
    inner = forward.args[0] if hasattr(forward, "args") else forward
    return hasattr(inner, "_torchdynamo_orig_callable")


def _train(cpu_backend, plan: Plan, compile_blocks: bool) -> tuple[list[float], dict, list[bool]]:
    model = _model()
    engine = MemFerry(model, optim=AdamW(lr=1e-2, weight_decay=0.1), plan=copy.deepcopy(plan), backend=cpu_backend,
                      compile_blocks=compile_blocks)
    compiled = [_compiled(b.forward) for b in model.blocks]
    losses = [float(engine.train_step(x, y)) for x, y in _data()]
    state = engine.state_dict()["model"]
    engine.close()
    assert all("forward" not in b.__dict__ for b in model.blocks)  # close() put the class's forward back
    return losses, state, compiled


def test_compiled_blocks_train_as_the_eager_engine_and_dha_blocks_stay_eager(cpu_backend):
    plan = Plan([UnitPlan("prefetch", "prefetch", recompute=True), UnitPlan("dha", "dha")])
    eager_losses, eager_state, eager_compiled = _train(cpu_backend, plan, False)
    losses, state, compiled = _train(cpu_backend, plan, True)
    assert eager_compiled == [False, False] and compiled == [True, False]
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    for name, t in eager_state.items():  # fp32: Inductor's fused kernels round differently, not more
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_the_profile_is_taken_on_compiled_copies_and_says_so(cpu_backend, monkeypatch):
    import strategies.memferry.profiler as profiler

    model = _model()
    x, y = _data(1)[0]
    eager = plan_for(model, (x, y), None, backend=cpu_backend)
    seen = []
    real = profiler.compile_forward
    monkeypatch.setattr(profiler, "compile_forward", lambda m: (seen.append(m), real(m)))
    compiled = plan_for(model, (x, y), None, backend=cpu_backend, compile_blocks=True)
    assert not eager.profile.compiled_blocks and compiled.profile.compiled_blocks
    # the profiled copies were compiled (one distinct block: timed, then timed again on a real
    # device only), never the user's blocks, which are left as they came
    assert len(seen) == 1 and all(m is not b for m in seen for b in model.blocks)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    # measured as compiled: the compiled graph saves fewer tensors than eager autograd does
    assert compiled.profile.blocks[0].act_bytes <= eager.profile.blocks[0].act_bytes


def test_the_benchmark_option_reaches_the_engine_and_is_checked(cpu_backend, monkeypatch):
    """``compile_blocks: true`` in a scenario compiles the row's blocks; a value that is not a
    bool is refused in one line before a model is built."""
    import strategies.memferry.executor as executor
    from bench.scenario import load_scenario
    from bench.worker import run_spec

    compiled = []
    real = executor.compile_forward
    monkeypatch.setattr(executor, "compile_forward", lambda m: (compiled.append(m), real(m)))

    def row(value):
        scenario = load_scenario({"model": {"family": "gpt", **{k: v for k, v in DIMS.items() if k != "seq"}},
                                  "batch": 2, "seq": DIMS["seq"], "steps": 1, "warmup": 1, "dtype": "fp32",
                                  "seed": 0, "timeline": False,
                                  "systems": [{"name": "memferry", "options": {"plan": "prefetch",
                                                                               "compile_blocks": value}}]})
        return run_spec({"scenario": scenario.to_dict(), "label": "memferry", "timeline_path": None}, in_process=True)

    good = row(True)
    assert good["status"] == "ok" and good["options"]["compile_blocks"] is True, good.get("reason")
    assert len(compiled) == DIMS["layers"]  # each block of the row's engine
    bad = row("yes")
    assert bad["status"] != "ok" and "compile_blocks must be true or false, got 'yes'" in bad["reason"]


def test_xpu_train_s_option_reaches_the_engine(cpu_backend, monkeypatch):
    """``strategy.options.compile_blocks: true`` in a training config compiles the engine's blocks,
    and the run trains (its loss falls)."""
    import strategies.memferry.executor as executor
    from strategies.training import load_config, train

    compiled = []
    real = executor.compile_forward
    monkeypatch.setattr(executor, "compile_forward", lambda m: (compiled.append(m), real(m)))
    config = load_config({"model": {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256},
                          "steps": 8, "batch": 4, "seq": 16, "optimizer": {"lr": 3e-3},
                          "data": {"kind": "synthetic", "branching": 2},
                          "strategy": {"name": "memferry", "options": {"compile_blocks": True}}})
    result = train(config, backend=cpu_backend)
    assert len(compiled) == 2 and result.losses[-1] < result.losses[0]
