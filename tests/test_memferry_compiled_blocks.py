"""``MemFerry(compile_blocks=True)`` (``compiled_blocks.py``): blocks run through ``torch.compile``
where they can and train as the eager engine does; blocks read over the link stay eager; the
profile is taken on compiled copies; ``close()`` gives each block its forward back (cpu backend,
Inductor's C++ code: a few seconds of compiling per test)."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.compiled_blocks import CompiledForward, compiled_runs, compiles
from strategies.memferry.planning import plan_for
from strategies.memferry.profiler import BlockProfile, StepProfile
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
    """Whether ``forward`` is a :class:`CompiledForward` (or recomputation's partial around one)."""
    inner = forward.args[0] if hasattr(forward, "args") else forward
    return isinstance(inner, CompiledForward)


def _train(cpu_backend, plan: Plan, compile_blocks: bool) -> tuple[list[float], dict, list[bool], int]:
    """Three steps' losses, the trained state, which blocks' forwards were compiled, and how many
    times compiled block code ran in the steps (0 where dynamo skipped them: they ran eagerly)."""
    model = _model()
    engine = MemFerry(model, optim=AdamW(lr=1e-2, weight_decay=0.1), plan=copy.deepcopy(plan), backend=cpu_backend,
                      compile_blocks=compile_blocks)
    compiled = [_compiled(b.forward) for b in model.blocks]
    runs = compiled_runs()
    losses = [float(engine.train_step(x, y)) for x, y in _data()]
    runs = compiled_runs() - runs
    state = engine.state_dict()["model"]
    engine.close()
    assert all("forward" not in b.__dict__ for b in model.blocks)  # close() put the class's forward back
    return losses, state, compiled, runs


def test_compiled_blocks_train_as_the_eager_engine_and_dha_blocks_stay_eager(cpu_backend):
    plan = Plan([UnitPlan("prefetch", "prefetch", recompute=True), UnitPlan("dha", "dha")])
    eager_losses, eager_state, eager_compiled, eager_runs = _train(cpu_backend, plan, False)
    losses, state, compiled, runs = _train(cpu_backend, plan, True)
    assert eager_compiled == [False, False] and compiled == [True, False]
    # compiled code ran in the steps: the recomputing block's forward and its recomputation, in
    # each of 3 steps. The cpu backend's tracker (a dispatch mode) once made dynamo skip every
    # frame silently, and this test passed on blocks that ran eagerly (session 56).
    assert eager_runs == 0 and runs == 2 * 3
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    for name, t in eager_state.items():  # fp32: Inductor's fused kernels round differently, not more
        got = state[name]
        if name.endswith("attn.qkv.bias"):  # the key bias's gradient is zero but for rounding,
            q, _, v = t.chunk(3)  # which AdamW's normalisation scales up to a step of lr: left out
            (gq, _, gv), t = got.chunk(3), torch.cat([q, v])
            got = torch.cat([gq, gv])
        torch.testing.assert_close(got, t, rtol=1e-4, atol=1e-5, msg=name)


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
    # and each block eagerly too, for the blocks that stay eager: an eager profile's bytes
    assert not eager.profile.eager_blocks and len(compiled.profile.eager_blocks) == DIMS["layers"]
    assert [b.act_bytes for b in compiled.profile.eager_blocks] == [b.act_bytes for b in eager.profile.blocks]
    assert StepProfile.from_json(compiled.profile.to_json()) == compiled.profile
    # the plan says what compiling bought: both sums, from the profile's own figures
    [note] = [n for n in compiled.notes if n.startswith("compiled blocks: ")]
    ms = lambda bs: f"{sum(b.fwd_s + b.bwd_s for b in bs) * 1e3:.2f} ms"  # noqa: E731
    assert f"{ms(compiled.profile.blocks)} over 2 blocks, {ms(compiled.profile.eager_blocks)} eager" in note
    assert not [n for n in eager.notes if n.startswith("compiled blocks: ")]


def test_a_block_that_stays_eager_is_priced_at_its_eager_figures():
    """A compiled profile prices a DHA or offloading block at the block's eager times and bytes
    (it runs eagerly), and a block that compiles at the compiled ones."""
    from strategies.memferry.block_costs import option_cost
    from strategies.memferry.links import Links

    def block(fwd_s: float, act: int) -> BlockProfile:
        return BlockProfile(numel=1000, param_bytes=2000, fwd_s=fwd_s, bwd_s=2 * fwd_s, act_bytes=act,
                            act_bytes_recompute=100, act_bytes_offload_kept=act // 4)

    def profile(eager: list[BlockProfile]) -> StepProfile:
        return StepProfile([block(1e-3, 4000)] * 2, 0, 0, 0.0, 0.0, 0, 0, 2, 64, 1e-9, 1e-10,
                           compiled_blocks=True, eager_blocks=eager)

    links = Links(h2d_GBps=20.0, d2h_GBps=20.0, dha_read_GBps=20.0)
    slow = profile([block(5e-3, 9000)] * 2)
    same = profile([])  # a profile without eager figures prices every block at its own
    for unit in (UnitPlan("dha", "dha"), UnitPlan("prefetch", "prefetch", offload=True),
                 UnitPlan("prefetch", "prefetch")):
        eager, own = option_cost(slow, links, 0, unit), option_cost(same, links, 0, unit)
        if compiles(unit):
            assert eager == own
        else:
            assert eager.a > own.a and eager != own


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
    assert good["compiled_runs_per_step"] == DIMS["layers"]  # and each ran compiled once a step
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


def test_a_profile_scaled_to_a_longer_batch_scales_its_eager_figures_too():
    from strategies.memferry.batch_growth import scaled_profile

    blk = BlockProfile(numel=10, param_bytes=20, fwd_s=1e-3, bwd_s=2e-3, act_bytes=4000, act_bytes_recompute=100)
    eager = BlockProfile(numel=10, param_bytes=20, fwd_s=3e-3, bwd_s=6e-3, act_bytes=6000, act_bytes_recompute=100)
    profile = StepProfile([blk], 0, 0, 0.0, 0.0, 0, 0, 2, 64, 1e-9, 1e-10, compiled_blocks=True,
                          eager_blocks=[eager], seq=32)
    grown = scaled_profile(profile, rows=4, seq=32)  # twice the tokens, the same sequence
    assert grown.blocks[0].act_bytes == 8000 and grown.eager_blocks[0].act_bytes == 12000
    assert grown.eager_blocks[0].fwd_s == pytest.approx(6e-3)


def test_blocks_profiled_compiled_run_compiled_in_the_steps_after(cpu_backend):
    """Session 56: the profiler counted a compiled block's kept outputs under a dispatch mode
    (``selective_recompute.kept_output_bytes``); dynamo skipped that frame and marked the block
    class's code to be skipped from then on, so every engine's blocks ran eagerly at compiled
    prices. After a compiled profile, an engine's compiled blocks run compiled: each block's
    forward in every step (a named plan, so the blocks' choices do not hang on profiled times)."""
    x, y = _data(1)[0]
    assert plan_for(_model(), (x, y), None, backend=cpu_backend, compile_blocks=True).profile.compiled_blocks
    engine = MemFerry(_model(), optim=AdamW(lr=1e-2), plan=Plan([UnitPlan("prefetch", "prefetch")] * 2),
                      backend=cpu_backend, compile_blocks=True)
    runs = compiled_runs()
    for x, y in _data(2):
        engine.train_step(x, y)
    engine.close()
    assert compiled_runs() - runs == DIMS["layers"] * 2


def test_a_call_under_a_dispatch_mode_runs_eagerly_and_leaves_the_block_compiled():
    """A compiled block called while a user's ``TorchDispatchMode`` is active runs its eager
    forward (the mode sees every op); the calls after it run compiled again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from strategies.memferry.compiled_blocks import compile_forward

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    block = _model().blocks[0]
    compile_forward(block)
    x = torch.randn(2, DIMS["seq"], DIMS["hidden"], requires_grad=True)
    before = compiled_runs()
    block(x)
    with Seen() as seen:
        block(x)
    block(x)
    assert seen.ops > 0 and compiled_runs() - before == 2


def test_the_cpu_backend_counts_what_a_compiled_block_keeps_as_its_eager_self(cpu_backend):
    """On the cpu backend a compiled block compiles under the tracker and its activations count
    against the virtual device (Inductor's buffers go through the dispatcher): a forward's saved
    tensors and output hold what the eager block's do. Before, they counted a fourteenth of them."""
    from strategies.memferry.compiled_blocks import compile_forward

    x = torch.randn(4, DIMS["seq"], DIMS["hidden"], requires_grad=True)
    held = []
    for compiled in (False, True):
        with cpu_backend.device_scope(0):
            block = _model().blocks[0]
            if compiled:
                compile_forward(block)
            block(x).sum().backward()  # compiling's own buffers come and go first
            before = cpu_backend.memory_stats(0).allocated
            out = block(x)
            held.append(cpu_backend.memory_stats(0).allocated - before)
            del out
    assert held[0] > 0 and held[1] == held[0]
