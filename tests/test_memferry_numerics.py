"""MemFerry trains exactly like plain PyTorch AdamW (fp32, cpu backend), whatever the plan."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.units import split_units
from strategies.weight_decay import no_decay_names, param_groups


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        # No qkv bias: attention ignores the key bias, so its gradient is rounding noise that
        # AdamW (g / sqrt(v)) turns into lr-sized steps in any two implementations alike.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=32, layers=4, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(n)]


def reference(model, data, cfg):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)  # MemFerry's default groups
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_self_loss(model, data, cfg):
    """Plain PyTorch AdamW on a copy of a model that computes its own loss (``model(x, y)``)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    losses = []
    for x, y in data:
        loss = ref(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ref


def assert_engine_matches(model, cfg, plan, data, backend, ref_losses, ref, loss_fn=None):
    """MemFerry on a copy of ``model`` (computing its own loss unless ``loss_fn``) follows the
    plain-AdamW reference ``ref`` (a module, or a dict of its parameters): losses and final
    parameters within 1e-5."""
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=backend, loss_fn=loss_fn)
    losses = [engine.train_step(x, y).item() for x, y in data]
    state = engine.state_dict()["model"]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    for name, p in (ref.items() if isinstance(ref, dict) else ref.named_parameters()):
        torch.testing.assert_close(state[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


PLANS = {
    "prefetch": lambda n: Plan.uniform(n, UnitPlan("prefetch", "prefetch")),
    "prefetch-depth2": lambda n: Plan.uniform(n, UnitPlan("prefetch", "prefetch"), prefetch_depth=2),
    "dha": lambda n: Plan.uniform(n, UnitPlan("dha", "dha")),
    "device-optimizer": lambda n: Plan([UnitPlan("resident", "resident", optimizer="device"),
                                        UnitPlan("resident", "resident", recompute=True, optimizer="device"),
                                        UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha")], rest_optimizer="device"),
    "offload": lambda n: Plan([UnitPlan("resident", "resident", offload=True, optimizer="device"),
                               UnitPlan("prefetch", "prefetch", offload=True), UnitPlan("dha", "dha", offload=True),
                               UnitPlan("prefetch", "prefetch")]),
    "selective": lambda n: Plan([UnitPlan("resident", "resident", recompute=True, selective=True, optimizer="device"),
                                 UnitPlan("resident", "resident", recompute=True, selective=True),
                                 UnitPlan("prefetch", "prefetch", recompute=True, selective=True),
                                 UnitPlan("prefetch", "prefetch", recompute=True, selective=True)], rest_optimizer="device"),
    "mixed": lambda n: Plan([UnitPlan("resident", "resident"), UnitPlan("dha", "prefetch", recompute=True),
                             UnitPlan("prefetch", "dha", recompute=True), UnitPlan("prefetch", "prefetch", recompute=True)]),
}


@functools.cache
def _reference_run(clip):
    """The seeded model, its data and plain AdamW's losses and weights on them: one run per ``clip``
    for every plan (ten steps, each one's loss compared; the clip fires in every one)."""
    torch.manual_seed(0)
    model = TinyGPT()
    data = batches(10)
    return model, data, *reference(model, data, AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip))


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_plain_pytorch_adamw(cpu_backend, plan_name, clip):
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    model, data, ref_losses, ref_params = _reference_run(clip)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=PLANS[plan_name](4), loss_fn=lm_loss, backend=cpu_backend)
    losses = [engine.train_step(x, y).item() for x, y in data]
    state = engine.state_dict()["model"]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert set(state) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=1e-5, msg=name)


def test_checkpoint_at_step_10_resumes_the_same_trajectory(cpu_backend, tmp_path):
    torch.manual_seed(1)
    model = TinyGPT()
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(20, seed=3)
    plan = PLANS["device-optimizer"](4)
    first = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, loss_fn=lm_loss, backend=cpu_backend)
    straight = [first.train_step(x, y).item() for x, y in data[:10]]
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    straight += [first.train_step(x, y).item() for x, y in data[10:]]
    final = first.state_dict()["model"]
    first.close()

    resumed = MemFerry(TinyGPT(), optim=cfg, plan=plan, loss_fn=lm_loss, backend=cpu_backend)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    tail = [resumed.train_step(x, y).item() for x, y in data[10:]]
    state = resumed.state_dict()["model"]
    resumed.close()
    assert tail == straight[10:]  # bit-identical: master weights and moments round-trip exactly
    for name in final:
        assert torch.equal(state[name], final[name]), name


def test_weights_stay_off_the_device_and_bytes_move_per_plan(cpu_backend):
    torch.manual_seed(0)
    model = TinyGPT(d=64, layers=4)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    rest_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks"))
    engine = MemFerry(model, plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), loss_fn=lm_loss, backend=cpu_backend)
    x, y = batches(1)[0]
    cpu_backend.reset_peak_memory(0)
    engine.train_step(x, y)
    engine.synchronize()
    # forward loads 4 blocks; backward reloads the first 3 (the last is kept), plus the rest unit once
    assert engine.executor.bytes_h2d == 7 * block_bytes + rest_bytes
    assert engine.executor.bytes_d2h == 4 * block_bytes + rest_bytes
    # between steps only the rest unit's weights hold device memory
    assert cpu_backend.memory_stats(0).allocated == rest_bytes
    engine.close()


def test_bad_plans_are_refused_before_anything_changes(cpu_backend):
    model = TinyGPT()
    with pytest.raises(ValueError, match="covers 2 blocks, the model has 4"):
        MemFerry(model, plan=Plan.uniform(2), backend=cpu_backend)
    with pytest.raises(ValueError, match="without recompute, backward reads the weights forward saved"):
        MemFerry(model, plan=Plan.uniform(4, UnitPlan("dha", "prefetch")), backend=cpu_backend)
    with pytest.raises(ValueError, match="unknown mode 'disk'"):
        UnitPlan("disk", "disk")
    with pytest.raises(ValueError, match="needs a resident unit"):
        UnitPlan("prefetch", "prefetch", optimizer="device")
    with pytest.raises(ValueError, match="lr must be positive"):
        AdamW(lr=0)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("in_forward", [True, False], ids=["grad-in-forward", "recomputed"])
def test_sliced_loss_model_trains_exactly(cpu_backend, in_forward):
    """The benchmark GPT with its loss in slices (each slice's gradients made in forward, or the
    head run again inside backward while the rest unit is loaded) still trains as plain PyTorch does."""
    from strategies.models import build_model

    torch.manual_seed(0)
    # no biases: the key bias's gradient is rounding noise (see Block above)
    model = build_model("gpt", layers=3, hidden=32, heads=4, vocab=64, seq=16, bias=False)
    model.loss_chunks, model.loss_grad_in_forward = 4, in_forward
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(8, seed=5)
    ref_losses, ref = reference_self_loss(model, data, cfg)
    plan = Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch", recompute=True),
                 UnitPlan("dha", "dha")], rest_optimizer="host")
    assert_engine_matches(model, cfg, plan, data, cpu_backend, ref_losses, ref)


def mixed_precision_reference(model, x, y, steps, lr, weight_decay, device=None, compute_dtype=None):
    """The textbook mixed-precision AdamW loop on a copy of ``model``: 16-bit weights and
    gradients, fp32 masters and moments, the 16-bit copy rounded from the master each step.
    With ``compute_dtype`` (an fp32 ``model``), the masters start from the fp32 values and the
    parameters are cast to it. Returns the losses and the fp32 masters (on the host)."""
    ref = copy.deepcopy(model).to(device) if device is not None else copy.deepcopy(model)
    masters = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    if compute_dtype is not None:
        for p, mp in zip(ref.parameters(), masters):
            p.data = mp.detach().to(compute_dtype)
    skip = no_decay_names(ref)  # MemFerry's default: biases and norms get no decay
    names = [n for n, _ in ref.named_parameters()]
    opt = torch.optim.AdamW([{"params": [m for n, m in zip(names, masters) if n not in skip], "weight_decay": weight_decay},
                             {"params": [m for n, m in zip(names, masters) if n in skip], "weight_decay": 0.0}], lr=lr)
    losses = []
    for _ in range(steps):
        loss = ref(x, y)
        losses.append(float(loss.detach()))
        for p in ref.parameters():
            p.grad = None
        loss.backward()
        for mp, p in zip(masters, ref.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for mp, p in zip(masters, ref.parameters()):
                p.copy_(mp)
    return losses, [m.detach().cpu() for m in masters]


@pytest.fixture
def one_thread():
    """One intra-op thread while the test runs: a bf16 matmul's sums are rounded in an order that
    depends on how many threads split them, and over six Adam steps a near-zero gradient whose
    sign that rounding flips moves its master by up to 2 lr, so the comparison would depend on the
    machine's thread count. With one thread the engine and the reference sum alike everywhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bf16_engine_equals_mixed_precision_adamw_reference(cpu_backend, one_thread):
    """In bf16, MemFerry is the usual mixed-precision AdamW: bf16 weights and gradients, fp32
    masters and moments, the bf16 copy rounded from the master after each update. Checked
    against that loop written out in plain PyTorch (same batch six times)."""
    from strategies.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt", layers=3, hidden=64, heads=4, vocab=128, seq=32, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 128, (4, 33), generator=g)
    x, y = tok[:, :-1], tok[:, 1:]
    ref_losses, masters = mixed_precision_reference(model, x, y, steps=6, lr=1e-3, weight_decay=0.1)
    ref = model
    plan = Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch", recompute=True),
                 UnitPlan("dha", "dha")], rest_optimizer="host")
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3, weight_decay=0.1), plan=plan, backend=cpu_backend)
    losses = [engine.train_step(x, y).float().item() for _ in range(6)]
    state = engine.state_dict()["optimizer"]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=2e-3)
    for (name, _), mp in zip(ref.named_parameters(), masters):
        torch.testing.assert_close(state[name]["master"], mp, atol=2e-4, rtol=0, msg=name)


def test_compute_dtype_keeps_an_fp32_model_s_values_as_masters(cpu_backend):
    """An fp32 model trained in bf16 (``compute_dtype``): the masters are its fp32 values,
    not their bf16 roundings, training is the mixed-precision loop started from them, and the
    state dict comes back in fp32 and round-trips exactly."""
    from strategies.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt", layers=3, hidden=64, heads=4, vocab=128, seq=32)  # fp32
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    tok = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = tok[:, :-1], tok[:, 1:]
    ref_losses, masters = mixed_precision_reference(model, x, y, steps=4, lr=1e-3, weight_decay=0.1,
                                                    compute_dtype=torch.bfloat16)
    plan = Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch", recompute=True),
                 UnitPlan("dha", "dha")], rest_optimizer="host")
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3, weight_decay=0.1), plan=plan, backend=cpu_backend,
                      compute_dtype=torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    before = engine.state_dict()
    for name, want in start.items():  # bit-exact fp32 values: a bf16-built model would have lost them
        assert before["model"][name].dtype == torch.float32
        assert torch.equal(before["model"][name], want), name
        assert torch.equal(before["optimizer"][name]["master"], want), name
    assert any(not torch.equal(w.bfloat16().float(), w) for w in start.values())  # the test can tell the two apart
    losses = [engine.train_step(x, y).float().item() for _ in range(4)]
    state = engine.state_dict()
    assert losses == pytest.approx(ref_losses, abs=2e-3)
    for (name, _), mp in zip(model.named_parameters(), masters):
        torch.testing.assert_close(state["optimizer"][name]["master"], mp, atol=2e-4, rtol=0, msg=name)
    engine.load_state_dict(state)
    again = engine.state_dict()
    for name, t in state["model"].items():
        assert t.dtype == torch.float32 and torch.equal(again["model"][name], t), name
    engine.close()


def test_compute_dtype_refuses_bad_input_before_touching_the_model(cpu_backend):
    model = TinyGPT()
    with pytest.raises(ValueError, match="floating torch.dtype"):
        MemFerry(model, compute_dtype=torch.int32, backend=cpu_backend)
    half = TinyGPT().half()
    with pytest.raises(ValueError, match="needs fp32"):
        MemFerry(half, compute_dtype=torch.bfloat16, backend=cpu_backend)
    assert {p.dtype for p in half.parameters()} == {torch.float16}  # untouched
    # Refused later (a budget below what the plan keeps resident): the cast is undone too.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="below"):
        MemFerry(model, plan="resident4", device_budget=1024, compute_dtype=torch.bfloat16, backend=cpu_backend)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("rows", [128, 32])  # above and below host_linear's in-place threshold (64)
def test_dha_blocks_stream_their_linears_and_write_gradients_home(cpu_backend, rows):
    """A block planned DHA runs its large linears through host_linear (weights streamed at
    large M, read in place at small M), and their gradients are written straight into host
    memory: training is still exact, and the gradient copies skip those weights."""
    torch.manual_seed(0)
    model = TinyGPT(d=128, layers=3)  # 128 x 512 fp32 MLP weights: 256 KB, above DHA_LINEAR_MIN_BYTES
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 64, (rows // 16, 16), generator=g), torch.randint(0, 64, (rows // 16, 16), generator=g))
            for _ in range(4)]
    ref_losses, ref_params = reference(model, data, cfg)
    plan = Plan([UnitPlan("dha", "dha"), UnitPlan("dha", "prefetch", recompute=True), UnitPlan("prefetch", "prefetch")])
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, loss_fn=lm_loss, backend=cpu_backend)
    losses = [engine.train_step(x, y).item() for x, y in data]
    state = engine.state_dict()["model"]
    ex = engine.executor
    counter, d2h = ex.dha_counter, ex.bytes_d2h
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=1e-5, msg=name)
    routed = sum(m.weight.numel() * 4 for b in model.blocks[:2] for m in b.modules()
                 if isinstance(m, nn.Linear) and m.weight.numel() * 4 >= 64 << 10)
    assert routed > 0
    mode = "stream" if rows > 64 else "dha"
    assert counter.modes.get(f"{mode}/forward", 0) > 0 and counter.modes.get(f"{mode}/backward", 0) > 0
    if rows > 64:  # each routed weight streamed in once per forward (and recompute) and once per backward
        assert counter.h2d_bytes >= 4 * 2 * routed
    # routed gradients were written home by the device; the copies moved everything else
    all_grads = sum(p.numel() * 4 for p in model.parameters())
    assert d2h == 4 * (all_grads - routed)


def test_offloaded_activations_leave_the_device_and_come_back(cpu_backend):
    """Blocks planned ``offload`` keep their saved activations in host memory between forward
    and backward: bytes go out and all come back, the device's peak falls below the same plan
    keeping them, and training stays exact (the parametrized test above checks numerics)."""
    torch.manual_seed(0)
    model = TinyGPT(d=64, layers=4)
    x, y = batches(1)[0]
    x, y = x.repeat(4, 1), y.repeat(4, 1)  # 16 x 16 tokens: activations well above the swapper's 64 KiB floor
    peaks, engines = {}, {}
    for off in (False, True):
        plan = Plan.uniform(4, UnitPlan("prefetch", "prefetch", offload=off))
        engine = MemFerry(copy.deepcopy(model), plan=plan, loss_fn=lm_loss, backend=cpu_backend)
        engine.train_step(x, y)  # warm-up: allocations settle
        engine.synchronize()
        cpu_backend.reset_peak_memory(0)
        engine.executor.swapper.stats.reset()
        loss = engine.train_step(x, y).item()
        engine.synchronize()
        peaks[off] = cpu_backend.memory_stats(0).peak_allocated
        engines[off] = (loss, engine.executor.swapper.stats.as_dict())
        engine.close()
    stats = engines[True][1]
    assert stats["bytes"].get("host", 0) > 0
    assert stats["swapped_in"] == stats["bytes"]["host"]
    assert engines[False][1]["bytes"].get("host", 0) == 0
    assert peaks[True] < peaks[False]
    assert engines[True][0] == pytest.approx(engines[False][0], abs=1e-6)


def test_offload_and_recompute_together_are_refused():
    with pytest.raises(ValueError, match="either recomputes its activations or offloads them"):
        UnitPlan("prefetch", "prefetch", recompute=True, offload=True)
    assert Plan.from_spec("device2+offload", 4).units[0] == UnitPlan("resident", "resident", optimizer="device", offload=True)


def test_budgets_below_the_minimum_and_too_little_host_memory_are_refused_before_anything_changes(cpu_backend):
    from xpu.errors import HostMemoryBudgetError

    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    resident = sum(p.numel() * 4 for p in model.parameters())  # fp32: every unit resident
    with pytest.raises(ValueError, match=r"device_budget .* is below the .* this plan needs before any activation: "
                                         r".* kept on the device between steps") as err:
        MemFerry(model, plan="resident4", loss_fn=lm_loss, backend=cpu_backend, device_budget=resident // 2)
    assert "give at least" in str(err.value) and err.value.minimum == resident
    block = max(u.numel * 4 for u in split_units(TinyGPT()) if u.is_block)
    with pytest.raises(ValueError, match=r" for its largest block loaded whole; give at least"):
        MemFerry(model, plan="prefetch", loss_fn=lm_loss, backend=cpu_backend, device_budget=block)
    cpu_backend.host_arena.budget = 10_000  # far below the shadow model's buffers
    try:
        with pytest.raises(HostMemoryBudgetError, match="the shadow model needs .* of pinned host memory"):
            # a valid device budget: the cap it sets must be taken back with the refusal
            MemFerry(model, plan="prefetch", loss_fn=lm_loss, backend=cpu_backend, device_budget=resident * 4)
        assert cpu_backend.host_arena.stats().in_use == 0  # nothing was allocated
    finally:
        cpu_backend.host_arena.budget = None
    assert cpu_backend.memory_cap(0) is None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_close_gives_back_the_cap_the_engine_found_and_its_device_memory(cpu_backend):
    """``device_budget`` caps the device while the engine runs; closing it puts back the cap it
    found (none, or the caller's), so a second engine or plain torch after it is not held to it,
    and gives back its device memory at once (the engine's reference cycles held it until a
    garbage collection ran). Its model is spent: a new engine refuses it in one line."""
    resident = sum(p.numel() * 4 for p in TinyGPT().parameters())
    for outer in (None, resident * 8):
        cpu_backend.set_memory_cap(0, outer)
        engine = MemFerry(TinyGPT(), plan="prefetch", loss_fn=lm_loss, backend=cpu_backend, device_budget=resident * 2)
        assert cpu_backend.memory_cap(0) == resident * 2
        engine.close()
        assert cpu_backend.memory_cap(0) == outer
        assert cpu_backend.memory_stats(0).allocated == 0  # its device memory given back now, not at a collection
    cpu_backend.set_memory_cap(0, None)
    spent = TinyGPT()
    MemFerry(spent, plan="resident4", loss_fn=lm_loss, backend=cpu_backend).close()
    with pytest.raises(ValueError, match="point at memory a closed MemFerry engine gave back: build the model again"):
        MemFerry(spent, plan="prefetch", loss_fn=lm_loss, backend=cpu_backend)


def test_llama_style_model_trains_exactly(cpu_backend):
    """The harness's Llama variant (RMSNorm, SwiGLU, rotary, grouped-query attention), its
    blocks found automatically, under a plan mixing every mode: as plain PyTorch AdamW."""
    from strategies.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=64, seq=16)
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(6, seed=7)
    ref_losses, ref = reference_self_loss(model, data, cfg)
    plan = Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("dha", "dha", offload=True),
                 UnitPlan("prefetch", "dha", recompute=True), UnitPlan("prefetch", "prefetch")], rest_optimizer="host")
    assert_engine_matches(model, cfg, plan, data, cpu_backend, ref_losses, ref)


def test_hugging_face_causal_lm_trains_exactly(cpu_backend):
    """A transformers causal LM built from a config (no download): its decoder layers are the
    blocks; trained as plain PyTorch AdamW would."""
    pytest.importorskip("transformers")
    from strategies.models import build_model

    torch.manual_seed(0)
    model = build_model("hf", config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "vocab_size": 64}, seq=16)
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(4, seed=8)
    ref_losses, ref = reference_self_loss(model, data, cfg)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan="prefetch+recompute", backend=cpu_backend)
    losses = [engine.train_step(x, y).item() for x, y in data]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("plan", ["prefetch", "dha", "resident2"])
def test_a_weight_tied_between_two_blocks_trains_exactly(cpu_backend, plan):
    """A tensor shared by blocks 0 and 1 lives in the always-resident rest unit (an offloaded
    block would leave the other block a tensor of no storage), and training equals torch's AdamW."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.blocks[1].proj.weight = model.blocks[0].proj.weight
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
    data = batches(4)
    ref_losses, ref_params = reference(model, data, cfg)
    assert_engine_matches(model, cfg, plan, data, cpu_backend, ref_losses, ref_params, loss_fn=lm_loss)
