"""``accumulation_steps`` in bench scenarios, the local-HF-folder model source, MemFerry LoRA and export rows (cpu backend)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from bench.scenario import ScenarioError, SystemEntry, load_scenario
from bench.systems.rank_pool import split_batch
from bench.worker import run_spec

ROOT = Path(__file__).resolve().parent.parent
_TINY = {"model": {"family": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 128}, "batch": 2, "seq": 16,
         "steps": 2, "warmup": 1, "dtype": "fp32", "seed": 0, "timeline": False,
         "optimizer": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}


def _scenario(systems, **over):
    return load_scenario({**_TINY, "systems": systems, **over})


def _run(scenario, label):
    row = run_spec({"scenario": scenario.to_dict(), "label": label, "timeline_path": None}, in_process=True)
    assert row["status"] == "ok", row["reason"]
    return row


def _reference_losses(scenario) -> list[float]:
    """Plain PyTorch: N micro-batches of loss / N, one AdamW step (no decay for biases and norm weights)."""
    from strategies.models import build_model
    from strategies.weight_decay import param_groups

    n, b = scenario.accumulation_steps, scenario.batch
    gen = torch.Generator().manual_seed(scenario.seed)
    vocab = scenario.model["vocab"]
    tokens = torch.randint(0, vocab, (n * b, scenario.seq + 1), generator=gen)
    torch.manual_seed(scenario.seed)
    model = build_model("gpt", dtype=torch.float32, **scenario.model_dims())
    o = scenario.optimizer
    opt = torch.optim.AdamW(param_groups(model, o["weight_decay"]), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
    out = []
    for _ in range(scenario.warmup + scenario.steps):
        losses = []
        for i in range(n):
            x, y = tokens[i * b:(i + 1) * b, :-1], tokens[i * b:(i + 1) * b, 1:]
            loss = model(x, y)
            (loss / n).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(sum(losses) / n)
    return out


@pytest.mark.parametrize("system", ["torch", "memferry"])
def test_accumulation_matches_a_plain_reference(cpu_backend, system, tmp_path, monkeypatch):
    from strategies.memferry.host_budget import update_bytes
    from xpu.probe import save_cached

    monkeypatch.setenv("XPU_CACHE_DIR", str(tmp_path))
    save_cached(cpu_backend, {"host": {"triad_GBps": 10.0}})  # a probe's host figure, for the row's floor
    options = {"plan": "prefetch+devacc"} if system == "memferry" else {}  # blocks sum on the device, rest on the host
    scenario = _scenario([{"name": system, "options": options}], accumulation_steps=3)
    row = _run(scenario, system)
    ref = _reference_losses(scenario)
    assert row["losses"] == pytest.approx(ref, abs=2e-5)
    assert row["accumulation_steps"] == 3
    # tokens per second count every micro-batch of the step
    assert row["tokens_per_s"] == pytest.approx(3 * 2 * 16 / row["step_s"], rel=1e-3)
    if system == "memferry":  # the host optimizer's rate beside the floor host memory sets (fp32, 3 micro-batches)
        from strategies.models import build_model

        model = build_model("gpt", dtype=torch.float32, **scenario.model_dims())
        share = sum(p.numel() for p in model.blocks.parameters()) / sum(p.numel() for p in model.parameters())
        # rest sums on the host, its first two micro-batches in one pass (4 + 4 + 4), the third alone (4 + 4 + 4)
        assert update_bytes(4, 3, paired=True).timed == 28 + 12 + 12 and update_bytes(4, 3, device_sum=True).timed == 28
        nbytes = round((1 - share) * update_bytes(4, 3, paired=True).timed + share * 28, 1)  # blocks: one fp32 sum read
        assert row["host_bytes_per_param"] == nbytes
        assert "2 of 2 blocks sum micro-batches on the device" in row["notes"]
        assert row["host_floor_ns_per_param"] == pytest.approx(nbytes / 10.0)
        assert row["host_over_floor"] == pytest.approx(row["host_ns_per_param"] / (nbytes / 10.0), rel=1e-2)
        assert f"host AdamW {row['host_ns_per_param']:.3f} ns/param" in row["notes"]
        assert row["predicted_step_s"] is None and row["predicted_peak_gb"] is None  # a named plan: nothing predicted
        # the host's work in two parts: rest's pair of earlier micro-batches summed, then the updates
        assert row["host_earlier_ns_per_param"] > 0 and row["host_update_ns_per_param"] > 0
        assert row["host_update_ns_per_param"] + row["host_earlier_ns_per_param"] == pytest.approx(
            row["host_ns_per_param"], abs=2e-3)
        assert "host_planned_update_ns_per_param" not in row  # nothing priced


def test_accumulated_micro_batches_train_as_one_large_batch(cpu_backend):
    # Two micro-batches of 2 rows see the same 4 rows as one batch of 4 (same seed): equal means, equal updates.
    acc = _run(_scenario(["torch"], accumulation_steps=2), "torch")
    whole = _run(_scenario(["torch"], batch=4), "torch")
    assert acc["losses"] == pytest.approx(whole["losses"], abs=1e-5)
    assert acc["losses"][-1] < acc["losses"][0]


def _counting_forwards(cls, fn):
    """``fn()`` and how many forward calls modules of ``cls`` began meanwhile (recomputes included: a
    pre-hook, as checkpoint's recompute stops early, before a forward hook would run)."""
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: calls.append(1) if isinstance(m, cls) else None)
    try:
        return fn(), len(calls)
    finally:
        hook.remove()


@pytest.mark.parametrize("recompute", [False, True])
def test_fsdp2_offload_accumulates_like_the_reference(cpu_backend, recompute):
    """Also with option recompute (activation checkpointing per block, on before fully_shard): the
    same losses, each block's forward run again in backward (counted by a global forward hook)."""
    from strategies.models.gpt import GPTBlock

    scenario = _scenario([{"name": "fsdp2-offload", "options": {"recompute": recompute}}], accumulation_steps=2)
    row, calls = _counting_forwards(GPTBlock, lambda: _run(scenario, "fsdp2-offload"))
    assert row["losses"] == pytest.approx(_reference_losses(scenario), abs=2e-5)
    forwards = scenario.model["layers"] * 2 * (scenario.warmup + scenario.steps)  # blocks x micro-batches x steps
    assert calls == forwards * (2 if recompute else 1)
    assert ("recompute per block (torch.utils.checkpoint, non-reentrant)" in row["notes"]) == recompute
    assert not row["notes"].startswith("ranks=")  # ranks 1 (the default): the single-process system, unchanged


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_accumulation_steps_must_be_a_positive_int(value):
    with pytest.raises(ScenarioError, match=r"accumulation_steps must be a positive integer .*got"):
        _scenario(["torch"], accumulation_steps=value)


def test_mpress_refuses_accumulation_with_what_to_write_instead():
    with pytest.raises(ScenarioError, match=r"system 'mpress' does not take accumulation_steps > 1 .*microbatches"):
        _scenario([{"name": "mpress", "options": {"stages": 2, "microbatches": 2}}], accumulation_steps=2)
    _scenario([{"name": "mpress", "options": {"stages": 2, "microbatches": 2}}])  # N = 1 is fine


def test_split_batch_gives_each_rank_its_rows_of_every_micro_batch():
    rows = torch.arange(12).reshape(12, 1)  # 3 micro-batches x 2 ranks x 2 rows
    parts = split_batch(rows, rows + 100, ranks=2, micro_batch=2, accumulation=3)
    assert parts[0][0].flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert parts[1][0].flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert parts[1][1].flatten().tolist() == [102, 103, 106, 107, 110, 111]
    assert split_batch(rows[:4], rows[:4], 2, 2)[1][0].flatten().tolist() == [2, 3]  # N = 1 as before


def test_deepspeed_config_carries_the_accumulation_steps(cpu_backend):
    import xpu
    from bench.systems.base import SystemContext
    from bench.systems.deepspeed_offload import ds_config

    ctx = SystemContext(backend=xpu.get_backend(), device_index=0, family="gpt", dims={}, dtype=torch.bfloat16,
                        batch=4, seq=16, optimizer=dict(_TINY["optimizer"]), options={"config": {}},
                        accumulation_steps=8)
    cfg = ds_config("z3", ctx)
    assert cfg["gradient_accumulation_steps"] == 8 and cfg["train_micro_batch_size_per_gpu"] == 4


# ---------------------------------------------------------------------------------- local HF folder
def _make_tiny_qwen2(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_hf_model", ROOT / "bench" / "scripts" / "make_hf_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fields = mod.hf_config_fields("qwen2", 32, 2, 4, 2, 64, 128, True, 64)
    return mod.make_hf_model(fields, out, dtype="fp32")


def test_tiny_finetune_scenario_from_a_local_hf_folder(cpu_backend, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    folder = _make_tiny_qwen2(tmp_path / "qwen2")
    scenario = load_scenario("qwen2-finetune-tiny", {"model.path": str(folder), "steps": 1, "warmup": 1,
                                                     "loss_after": 2})
    scenario.systems.append(SystemEntry("fsdp2-offload", "fsdp2-recompute", {"recompute": True}))
    scenario.validate()
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP  # HF checkpoints a layer's forward, hooks outside

    rows = {label: _run(scenario, label) for label in ("torch", "memferry", "memferry-lora", "fsdp2-offload")}
    rows["fsdp2-recompute"], calls = _counting_forwards(Qwen2MLP, lambda: _run(scenario, "fsdp2-recompute"))
    assert calls == 2 * 2 * 2 * 2  # layers x micro-batches x steps, each run again in backward
    # The same folder, the same data: full MemFerry and FSDP2 (with HF's checkpointing too) train as torch does.
    assert rows["memferry"]["losses"] == pytest.approx(rows["torch"]["losses"], abs=2e-5)
    assert rows["fsdp2-offload"]["losses"] == pytest.approx(rows["torch"]["losses"], abs=2e-5)
    assert rows["fsdp2-recompute"]["losses"] == pytest.approx(rows["torch"]["losses"], abs=2e-5)
    assert "recompute per block (HF gradient checkpointing, non-reentrant)" in rows["fsdp2-recompute"]["notes"]
    assert rows["memferry"]["losses"][-1] < rows["memferry"]["losses"][0]
    assert rows["memferry-lora"]["losses"][0] == pytest.approx(rows["torch"]["losses"][0], abs=2e-5)
    assert rows["memferry-lora"]["losses"][-1] < rows["memferry-lora"]["losses"][0]
    assert rows["memferry-lora"]["params"] == rows["torch"]["params"]  # counted without adapters
    for label in ("memferry", "memferry-lora"):
        notes = rows[label]["notes"]
        m = re.search(r"export reloads \(from_pretrained, [\d.]+ M params(, LoRA merged)?\): loss ([\d.]+) vs engine "
                      r"([\d.]+)", notes)
        assert m, notes
        assert bool(m.group(1)) == (label == "memferry-lora")
        assert float(m.group(2)) == pytest.approx(float(m.group(3)), abs=1e-4)
        assert "loss " in notes and " -> " in notes
    assert "LoRA" in rows["memferry-lora"]["notes"] and "trainable" in rows["memferry-lora"]["notes"]


def test_memferry_lora_needs_an_hf_model(cpu_backend):
    scenario = _scenario([{"name": "memferry", "options": {"lora": {"r": 4}}}])
    row = run_spec({"scenario": scenario.to_dict(), "label": "memferry", "timeline_path": None}, in_process=True)
    assert row["status"] == "error" and "options lora and export_hf need a model of family hf" in row["reason"]


@pytest.mark.parametrize("system", ["memferry-dp", "fsdp2-offload"])
def test_two_ranks_accumulate_like_the_reference(system, monkeypatch):
    """Two ranks train as one process on the whole batch does (the plain reference, which the
    single-process rows match too); fsdp2-offload's row says so in its notes and counts the
    global batch's tokens."""
    # As in a bench worker: one virtual device here; the system gives its ranks one each. Batch 4 over
    # 2 ranks, 2 accumulated micro-batches: each rank gets its 2 rows of each micro-batch.
    import xpu

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    monkeypatch.setenv("XPU_CPU_DEVICES", "1")
    xpu.reset_backend()
    options = {"ranks": 2, "plan": "prefetch"} if system == "memferry-dp" else {"ranks": 2}
    try:
        scenario = _scenario([{"name": system, "options": options}], batch=4, accumulation_steps=2)
        row = run_spec({"scenario": scenario.to_dict(), "label": system, "timeline_path": None}, in_process=True)
    finally:
        xpu.reset_backend()
    assert row["status"] == "ok", row["reason"]
    assert row["losses"] == pytest.approx(_reference_losses(scenario), abs=2e-5)
    assert row["losses"][-1] < row["losses"][0]  # it trains
    if system == "fsdp2-offload":  # (test_bench_multirank's toy system covers ranks without accumulation)
        assert row["notes"].startswith("ranks=2 (micro-batch 2 per rank); param_dtype=float32"), row["notes"]
        assert row["peak_device_gb"] is None  # the ranks' memory is not the worker's
        assert row["tokens_per_s"] == pytest.approx(2 * 4 * 16 / row["step_s"], rel=1e-3)  # every rank's micro-batches


def test_memferry_lora_plan_auto_under_a_cap(cpu_backend, tmp_path):
    # The scheduler profiles a LoRA model whose embedding and tied head are frozen (no backward there).
    pytest.importorskip("peft")
    folder = _make_tiny_qwen2(tmp_path / "qwen2")
    scenario = load_scenario("qwen2-finetune-tiny", {
        "model.path": str(folder), "steps": 1, "warmup": 1, "loss_after": 2, "device_mem_gb": 0.02,
        "systems": [{"name": "memferry", "options": {"plan": "auto", "loss_chunks": 2, "lora": {"r": 4}}}]})
    row = _run(scenario, "memferry")
    assert row["losses"][-1] < row["losses"][0] and row["peak_device_gb"] <= 0.02
    # the plan's predicted peak (margin included) fits the cap and bounds what the steps measured
    assert row["peak_device_gb"] <= row["predicted_peak_gb"] <= 0.02


def test_memferry_allocator_cap_option(cpu_backend):
    """``allocator_cap: budget`` runs as the plan's hold does; anything else is refused, with the
    values that work, before a model is built."""
    row = _run(_scenario([{"name": "memferry", "device_mem_gb": 1,
                           "options": {"plan": "prefetch", "allocator_cap": "budget"}}]), "memferry")
    assert row["options"]["allocator_cap"] == "budget"
    bad = run_spec({"scenario": _scenario([{"name": "memferry", "options": {"allocator_cap": "all"}}]).to_dict(),
                    "label": "memferry", "timeline_path": None}, in_process=True)
    assert bad["status"] != "ok" and "allocator_cap must be 'plan' or 'budget', got 'all'" in bad["reason"]


def test_memferry_gil_switch_option_holds_for_the_row_and_is_put_back(cpu_backend, monkeypatch):
    """``gil_switch_s`` sets the interpreter's switch interval while the row's engine lives and puts
    the one before back when it closes; a value that is not seconds in (0, 1] is refused first."""
    import sys

    from bench.systems.memferry import MemFerrySystem

    seen = []
    real_close = MemFerrySystem.close

    def close(self):
        seen.append(sys.getswitchinterval())
        real_close(self)

    monkeypatch.setattr(MemFerrySystem, "close", close)
    before = sys.getswitchinterval()
    row = _run(_scenario([{"name": "memferry", "device_mem_gb": 1,
                           "options": {"plan": "prefetch", "gil_switch_s": 0.0005}}]), "memferry")
    assert row["status"] == "ok" and seen == [pytest.approx(0.0005)] and sys.getswitchinterval() == before
    bad = run_spec({"scenario": _scenario([{"name": "memferry", "options": {"gil_switch_s": 5}}]).to_dict(),
                    "label": "memferry", "timeline_path": None}, in_process=True)
    assert bad["status"] != "ok" and "gil_switch_s must be seconds in (0, 1]" in bad["reason"]
    assert sys.getswitchinterval() == before


def test_memferry_host_piece_option_reaches_the_host_kernel(cpu_backend, monkeypatch):
    """``host_piece`` is the single-pass loop's parameters per call for the row (``AdamW.host_piece``);
    a value under 2**16 is refused with the one-line reason."""
    from bench.systems.memferry import MemFerrySystem

    seen = []
    real_close = MemFerrySystem.close

    def close(self):
        kernel = self.engine.optimizer.kernel
        seen.append((kernel.name, getattr(kernel, "piece", None)))
        real_close(self)

    monkeypatch.setattr(MemFerrySystem, "close", close)
    row = _run(_scenario([{"name": "memferry", "device_mem_gb": 1,
                           "options": {"plan": "prefetch", "host_piece": 1 << 18}}]), "memferry")
    assert row["status"] == "ok" and len(seen) == 1
    if seen[0][0] == "single-pass":  # the torch fallback (no compiler) has chunks of its own
        assert seen[0][1] == 1 << 18
    bad = run_spec({"scenario": _scenario([{"name": "memferry", "options": {"host_piece": 4096}}]).to_dict(),
                    "label": "memferry", "timeline_path": None}, in_process=True)
    assert bad["status"] != "ok" and "host_piece must be a whole number of parameters, at least 65536" in bad["reason"]
