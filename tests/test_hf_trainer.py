"""transformers.Trainer drives MemFerry (strategies/memferry/hf_trainer.py) exactly as it drives torch AdamW:
the same weights, logged losses, gradient norms and eval losses; its checkpoints resume a run exactly."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan  # noqa: E402
from strategies.memferry.accumulation import AccumulationError  # noqa: E402
from strategies.memferry.hf_trainer import MemFerryModel, memferry_trainer  # noqa: E402
from strategies.models.hf_sliced_loss import slice_hf_loss  # noqa: E402

LR, WD, STEPS, BATCH = 3e-3, 0.1, 4, 2

PLANS = {
    "prefetch": Plan.uniform(2, UnitPlan("prefetch", "prefetch")),
    "device": Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch", recompute=True)],
                   rest_optimizer="device"),
}


def tiny_llama(tied=False, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, initializer_range=0.1)  # gradient norms above the clip
    return transformers.LlamaForCausalLM(cfg).float()


class FixedBatches(torch.utils.data.IterableDataset):
    """The same token rows in the same order on every pass (no sampler: Trainer reads them in order)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 128, (16,), generator=g) for _ in range(n)]
        for i, row in enumerate(self.rows):
            if i % 3 == 0:
                row[:4] = -100  # some masked labels: the token count Trainer scales by differs from the mean
        self.rows = [(r.clamp(min=0), r) for r in self.rows]

    def __iter__(self):
        for ids, labels in self.rows:
            yield {"input_ids": ids, "labels": labels}


class Snapshots(transformers.TrainerCallback):
    """Keeps the engine's weights at each checkpoint Trainer saves, by step."""

    def __init__(self, engine, out):
        self.engine, self.out = engine, out

    def on_save(self, args, state, control, **kwargs):
        self.out[state.global_step] = self.engine.state_dict()["model"]


def _args(tmp_path, ga, clip, **extra):
    kw = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
              gradient_accumulation_steps=ga, learning_rate=LR, weight_decay=WD, lr_scheduler_type="linear",
              warmup_steps=0, max_grad_norm=clip, optim="adamw_torch", report_to=[], save_strategy="no", use_cpu=True,
              disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1)
    return transformers.TrainingArguments(**{**kw, **extra})


def _logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


def _assert_close_but_for_rounding(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within 1e-5 but for at most 0.1 % of the elements, each within the LR * STEPS that AdamW can
    move it: an element whose gradient is rounding noise (a token's output row the batches never
    name; a loss summed over slices rounds it otherwise) is normalised by AdamW to a step of up to
    lr (one such element of 4096 differed by 3.5e-5 on python 3.11 with transformers 5.25)."""
    off = (got - want).abs() > 1e-5 + 1e-5 * want.abs()
    assert off.float().mean().item() <= 1e-3, f"{name}: {int(off.sum())} of {off.numel()} elements differ"
    torch.testing.assert_close(got, want, atol=LR * STEPS, rtol=0, msg=name)


def _compare(backend, tmp_path, plan, ga, use_cpu=True, sliced=False):
    model = tiny_llama()
    data, held_out = FixedBatches(STEPS * ga * BATCH), FixedBatches(6, seed=2)
    evals = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)  # evaluate() amid training
    if sliced == "eval-too":  # evaluation of the loss alone, sliced as well
        evals["prediction_loss_only"] = True
    ref = copy.deepcopy(model)
    theirs = transformers.Trainer(model=ref, args=_args(tmp_path / "ref", ga, 1.0, use_cpu=use_cpu, **evals),
                                  train_dataset=data, eval_dataset=held_out)
    theirs.train()
    mine = slice_hf_loss(copy.deepcopy(model), 3, eval_logits=sliced != "eval-too") if sliced else copy.deepcopy(model)
    engine = MemFerry(mine, optim=AdamW(lr=LR, weight_decay=WD, max_grad_norm=1.0), plan=PLANS[plan],
                      backend=backend, accumulation_steps=ga)
    ours = memferry_trainer(engine, _args(tmp_path / "mf", ga, 0.0, use_cpu=use_cpu, **evals), train_dataset=data,
                            eval_dataset=held_out)
    ours.train()
    assert ours.state.global_step == theirs.state.global_step == STEPS
    assert ours.lr_scheduler.get_last_lr() == theirs.lr_scheduler.get_last_lr()
    # Trainer's logged grad_norm is MemFerry's pre-clip norm: torch's clip_grad_norm_ value in the reference
    norms = _logged(ours, "grad_norm")
    assert len(norms) == STEPS and max(norms) > 1.0  # the clip was active
    torch.testing.assert_close(norms, _logged(theirs, "grad_norm"), rtol=1e-5, atol=0)
    torch.testing.assert_close(_logged(ours, "loss"), _logged(theirs, "loss"), rtol=1e-5, atol=1e-6)
    eval_losses = _logged(ours, "eval_loss")
    assert len(eval_losses) == STEPS // 2
    final = ours.evaluate()["eval_loss"], theirs.evaluate()["eval_loss"]
    torch.testing.assert_close(eval_losses + [final[0]], _logged(theirs, "eval_loss")[:STEPS // 2] + [final[1]],
                               rtol=1e-5, atol=0)
    state = engine.state_dict()
    engine.close()
    assert {v["step"] for v in state["optimizer"].values()} == {STEPS}
    for name, p in ref.named_parameters():
        _assert_close_but_for_rounding(state["model"][name], p.detach().cpu(), name)


@pytest.mark.parametrize("plan, ga, sliced", [("prefetch", 2, False), ("device", 4, False), ("prefetch", 2, "train"),
                                            ("device", 4, "eval-too")])
def test_trainer_with_memferry_equals_trainer_with_torch_adamw(cpu_backend, tmp_path, plan, ga, sliced):
    """``sliced``: the MemFerry side's training loss over token slices (``slice_hf_loss``),
    Trainer's ``num_items_in_batch`` scaling included, against the reference's whole logits;
    ``eval-too``: its loss-only evaluation sliced as well (``eval_logits=False``)."""
    _compare(cpu_backend, tmp_path, plan, ga, sliced=sliced)


@pytest.mark.gpu
def test_trainer_with_memferry_on_the_accelerator(gpu_backend, tmp_path):
    """Trainer on the device (its args.device, accelerate's placement) with the engine on device 0."""
    _compare(gpu_backend, tmp_path, "device", 2, use_cpu=False)


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_checkpoints_resume_a_memferry_run_exactly(cpu_backend, tmp_path, lora):
    """6 steps saving at 3; a fresh Trainer and engine (other initial weights, or adapters) resumed from
    checkpoint-3 end where the uninterrupted run does; checkpoint-3's model folder (a LoRA model's adapter)
    loads with from_pretrained as the engine's weights at step 3."""
    peft = pytest.importorskip("peft") if lora else None
    steps, ga = 6, 2
    data = FixedBatches(steps * ga * BATCH)

    def build(seed):
        if not lora:
            return tiny_llama(tied=True, seed=seed)
        base = tiny_llama(tied=True)  # the frozen base is the same model in both runs
        torch.manual_seed(seed)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def run(out, seed, resume=None):
        engine = MemFerry(build(seed), optim=AdamW(lr=LR, weight_decay=WD, max_grad_norm=1.0), plan=PLANS["prefetch"],
                          backend=cpu_backend, accumulation_steps=ga)
        saved = {}
        args = _args(out, ga, 0.0, max_steps=steps, save_strategy="steps", save_steps=3)
        if lora and resume is None:
            best = _args(out, ga, 0.0, save_strategy="steps", eval_strategy="steps", load_best_model_at_end=True)
            with pytest.raises(ValueError, match=r"load_best_model_at_end=True: .* PEFT adapter .*leave it False"):
                memferry_trainer(engine, best, train_dataset=data)
        trainer = memferry_trainer(engine, args, train_dataset=data, callbacks=[Snapshots(engine, saved)])
        try:
            trainer.train(resume_from_checkpoint=resume)
            return engine.state_dict(), saved, trainer
        finally:
            engine.close()

    whole, saved, _ = run(tmp_path / "whole", 0)
    assert sorted(saved) == [3, 6]
    resumed, _, trainer = run(tmp_path / "resumed", 1, resume=str(tmp_path / "whole" / "checkpoint-3"))
    assert trainer.state.global_step == steps
    assert {v["step"] for v in resumed["optimizer"].values()} == {steps}
    for name, w in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], w, atol=1e-6, rtol=0, msg=name)
    for name, moments in whole["optimizer"].items():
        torch.testing.assert_close(resumed["optimizer"][name]["exp_avg_sq"], moments["exp_avg_sq"], atol=1e-9, rtol=1e-6)
    folder = tmp_path / "whole" / "checkpoint-3"
    if lora:
        loaded = peft.PeftModel.from_pretrained(tiny_llama(tied=True), folder)
        (tmp_path / "whole" / "checkpoint-6" / "optimizer.pt").unlink()  # as save_only_model=True leaves it
        with pytest.raises(ValueError, match="checkpoint-6 has no optimizer.pt: a MemFerry PEFT model resumes its"):
            run(tmp_path / "unused", 1, resume=str(tmp_path / "whole" / "checkpoint-6"))
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert loaded.config.use_cache  # as a loaded model generates; the engine's model trains without
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # tied again
    assert {n for n, _ in loaded.named_parameters()} == set(saved[3])
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), saved[3][name], atol=0, rtol=0, msg=name)


# Its name in the installed transformers (activation_checkpointing since 5.x; the old one an alias, gone in v6).
_CHECKPOINTING = ("activation_checkpointing"
                  if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
                  else "gradient_checkpointing")


def _engine(cpu_backend, ga=2):
    return MemFerry(tiny_llama(), optim=AdamW(lr=LR, max_grad_norm=1.0), plan=PLANS["prefetch"], backend=cpu_backend,
                    accumulation_steps=ga)


@pytest.mark.parametrize("change, match", [
    ({"clip": 1.0}, r"max_grad_norm=1.0 would clip nothing .*AdamW\(max_grad_norm=...\)"),
    ({"ga": 4}, "gradient_accumulation_steps=4 differs from the engine's accumulation_steps=2"),
    ({_CHECKPOINTING: True}, rf"{_CHECKPOINTING}=True: MemFerry's plan recomputes blocks itself"),
    ({"optim": "adafactor"}, r"optim='adafactor' would not be used: MemFerry runs its own AdamW"),
    ({"learning_rate": 2e-5}, r"learning_rate=2e-05 differs from the engine's AdamW lr=0.003, which is the one used"),
    ({"weight_decay": 0.05}, r"weight_decay=0.05 differs from the engine's AdamW weight_decay=0.01"),
    ({"adam_beta2": 0.95}, r"adam_beta2=0.95 differs from the engine's AdamW betas\[1\]=0.999"),
])
def test_misfitting_training_arguments_are_refused(cpu_backend, tmp_path, change, match):
    engine = _engine(cpu_backend)
    kw = {"ga": 2, "clip": 0.0, "weight_decay": 0.0, **change}  # weight decay: Trainer's default, not asked for
    args = _args(tmp_path, kw.pop("ga"), kw.pop("clip"), **kw)
    with pytest.raises(ValueError, match=match) as err:
        memferry_trainer(engine, args, train_dataset=FixedBatches(4))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"makes \['optimizers'\] from the engine"):
        memferry_trainer(engine, _args(tmp_path, 2, 0.0, weight_decay=0.0), optimizers=(None, None))
    engine.close()


def test_plain_loss_backward_is_the_engine_s_backward(cpu_backend):
    """What Trainer does by hand: model(**batch).loss.backward() per micro-batch, then step."""
    model = tiny_llama()
    rows = FixedBatches(4).rows
    batches = [(torch.stack([rows[2 * i][0], rows[2 * i + 1][0]]), torch.stack([rows[2 * i][1], rows[2 * i + 1][1]]))
               for i in range(2)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for x, y in batches:
        (ref(input_ids=x, labels=y).loss / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=LR, weight_decay=0.0, max_grad_norm=1.0),
                      plan=PLANS["prefetch"], backend=cpu_backend, accumulation_steps=2)
    wrapped = MemFerryModel(engine)
    assert list(wrapped.parameters()) == [] and wrapped.to("cpu") is wrapped
    for x, y in batches:
        (wrapped(input_ids=x, labels=y).loss / 2).backward()
    with pytest.raises(AccumulationError, match="call engine.step\\(\\) before the next forward"):
        wrapped(input_ids=batches[0][0], labels=batches[0][1])
    engine.step()
    state = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)
    loss = wrapped(input_ids=batches[0][0], labels=batches[0][1]).loss
    loss.backward(retain_graph=True)
    with pytest.raises(AccumulationError, match="backward\\(\\) with no forward before it"):
        loss.backward()  # a plain second backward of one forward is refused as engine.backward's is
    engine.step()
    # Trainer's loads: a whole state, or part of one (a shard) with strict=False
    with pytest.raises(RuntimeError, match=r"missing \[\], unexpected \['extra'\]"):
        wrapped.load_state_dict({**ref.state_dict(), "extra": torch.zeros(1)})
    assert wrapped.load_state_dict(ref.state_dict()) == ([], [])
    part = wrapped.load_state_dict({"model.norm.weight": torch.zeros(32)}, strict=False)
    assert "lm_head.weight" in part.missing_keys and not part.unexpected_keys
    state = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], torch.zeros(32) if name == "model.norm.weight" else p.detach(),
                                   atol=0, rtol=0, msg=name)
    engine.close()


def test_engine_backward_of_a_loss_from_elsewhere_is_refused(cpu_backend):
    engine = _engine(cpu_backend)
    x = FixedBatches(1).rows[0][0][None]
    engine(input_ids=x)
    with pytest.raises(AccumulationError, match="does not come from the engine's grad-enabled forward"):
        engine.backward(torch.ones(2, requires_grad=True).sum())
    engine.close()


def test_the_trainer_example_trains_saves_and_reloads_equal(cpu_backend, tmp_path, capsys):
    """examples/finetune/trainer_memferry.py on make_tiny_model.py's stand-in, LoRA: the adapter
    folder it saves, loaded with ``from_pretrained``, gives the engine's loss."""
    import importlib.util
    import re
    from pathlib import Path

    def example(name):
        path = Path(__file__).resolve().parents[1] / "examples" / "finetune" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    pytest.importorskip("peft")
    example("make_tiny_model").main([str(tmp_path / "tiny"), "--layers", "2"])
    example("trainer_memferry").main([str(tmp_path / "tiny"), "--steps", "2", "--accum", "2", "--lora"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    theirs, ours = re.search(r"loss (\S+) on the first batch \(the engine's: (\S+)\)", line).groups()
    assert theirs == ours and (tmp_path / "tiny" / "trainer-out" / "final" / "adapter_config.json").is_file()


class VaryingRows(torch.utils.data.IterableDataset):
    """Rows of different lengths, in order: a collator pads each batch to its longest."""

    LENGTHS = (8, 8, 8, 6, 16, 8, 40, 8, 8, 12, 8, 8, 40, 40, 8, 8)

    def __iter__(self):
        g = torch.Generator().manual_seed(3)
        for n in self.LENGTHS:
            yield {"input_ids": torch.randint(1, 128, (n,), generator=g).tolist()}


def test_batches_padded_to_their_longest_are_fitted_before_each_step(cpu_backend, tmp_path, caplog):
    """With a collator padding each batch to its longest row, Trainer's steps meet longer batches
    than the sample MemFerry planned with; under a budget that the sample's plan does not hold at
    the longest, the engine plans again before the step (Trainer hands over the step's
    micro-batches first: ``get_batch_samples``), no step runs out of memory, and the weights are
    Trainer + torch AdamW's."""
    from strategies.memferry.batch_growth import scaled_profile
    from strategies.memferry.cost import links_from_probe, predict
    from strategies.memferry.planning import plan_for
    from strategies.memferry.scheduler import min_budget
    from tests.test_memferry_batch_growth import keeping

    collate = transformers.DataCollatorForLanguageModeling(_PadOnly(), mlm=False)
    first = collate([{"input_ids": r["input_ids"]} for r in list(VaryingRows())[:BATCH]])["input_ids"]
    model = slice_hf_loss(tiny_llama(), 2)
    links = links_from_probe(cpu_backend, 0)
    profile = plan_for(copy.deepcopy(model), (first, first), None, backend=cpu_backend, memory_margin=0.0).profile
    budget = int(1.3 * min_budget(scaled_profile(profile, BATCH, max(VaryingRows.LENGTHS)), links, margin=0.0))
    # every activation kept: what a roomy budget picks for the sample, fixed (test_memferry_batch_growth.keeping)
    plan = keeping(cpu_backend, budget, 2, make=lambda: copy.deepcopy(model), sample=(first, first))
    assert plan.predicted_peak_bytes <= budget < predict(
        plan, scaled_profile(plan.profile, BATCH, max(VaryingRows.LENGTHS)), links, 0.0).peak_bytes

    ref = tiny_llama()
    theirs = transformers.Trainer(model=ref, args=_args(tmp_path / "ref", 2, 1.0), train_dataset=VaryingRows(),
                                  data_collator=collate)
    theirs.train()
    engine = MemFerry(model, optim=AdamW(lr=LR, weight_decay=WD, max_grad_norm=1.0), plan=plan, sample=(first, first),
                      device_budget=budget, backend=cpu_backend, accumulation_steps=2, memory_margin=0.0)
    peak_after = _PeakAfter(cpu_backend, engine, 2)  # step 2: the first at the longest rows
    ours = memferry_trainer(engine, _args(tmp_path / "mf", 2, 0.0), train_dataset=VaryingRows(), data_collator=collate,
                            callbacks=[peak_after])
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        ours.train()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"micro-batches of {BATCH} x {max(VaryingRows.LENGTHS)} tokens" in m and "planned again" in m
               for m in said), said
    assert peak_after.measured and cpu_backend.memory_stats(0).peak_allocated <= budget
    torch.testing.assert_close(_logged(ours, "loss"), _logged(theirs, "loss"), rtol=1e-5, atol=1e-6)
    state = engine.state_dict()["model"]
    engine.close()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


class _PeakAfter(transformers.TrainerCallback):
    """Resets the device's peak once Trainer's ``step``-th step and any step measured with the cap
    lifted after it are done (the first at a new, longer shape, and a re-plan's after a miss, may
    pass the budget: ``batch_growth.settle_watch``); ``measured``: steps ran after that."""

    def __init__(self, backend, engine, step):
        self.backend, self.engine, self.step = backend, engine, step
        self.reset_at = None
        self.measured = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.reset_at is None and state.global_step >= self.step and "watch" not in self.engine._setup:
            self.backend.reset_peak_memory(0)
            self.reset_at = state.global_step
        elif self.reset_at is not None:
            self.measured = True


class _PadOnly:
    """What DataCollatorForLanguageModeling asks of a tokenizer to pad ids (pad id 0, right side)."""

    pad_token_id, pad_token, padding_side = 0, "<pad>", "right"

    def pad(self, features, return_tensors="pt", pad_to_multiple_of=None, **kwargs):
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, :len(f["input_ids"])] = 1
        return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})
