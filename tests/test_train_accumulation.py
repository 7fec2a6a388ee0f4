"""Gradient accumulation in ``xpu train``: N micro-batches per update equal plain PyTorch summing ``loss / N`` (cpu backend, fp32)."""
from __future__ import annotations

import pytest
import torch

from strategies.training import load_config, lr_at, read_checkpoint, train
from strategies.training.data import make_datasets
from strategies.weight_decay import param_groups

MICRO = {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256}


def _config(**extra):
    cfg = {"model": dict(MICRO), "steps": 3, "batch": 2, "seq": 16, "log_every": 1, "dtype": "fp32",
           "optimizer": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-4},
           "data": {"kind": "synthetic", "branching": 2}, "strategy": "torch"}
    cfg.update(extra)
    return load_config(cfg)


def _reference_losses(config, n_micro):
    """Plain PyTorch: the same seeded model and batches, ``(loss / N).backward()`` per micro-batch, one AdamW step."""
    from strategies.models import build_model

    windows, _, _ = make_datasets(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config.family, dtype=torch.float32, **config.model_dims())
    o = config.optimizer
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)  # HF Trainer's groups
    losses = []
    for i in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(o, i, config.steps)
        total = 0.0
        for _ in range(n_micro):
            x, y = windows.next()
            loss = model(x, y)
            (loss / n_micro).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / n_micro)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_torch_accumulation_equals_plain_torch_summing_micro_batch_gradients(cpu_backend, tmp_path):
    config = _config(accumulation_steps=4, checkpoint={"every": 3, "dir": str(tmp_path / "ck")})
    result = train(config, backend=cpu_backend)
    ref_losses, ref_weights = _reference_losses(_config(accumulation_steps=4), 4)
    assert result.losses == pytest.approx(ref_losses, abs=1e-6)
    assert result.info.tokens_per_step == 2 * 16 * 4
    saved = read_checkpoint(result.checkpoints[-1])["engine"]["model"]
    for name, ref in ref_weights.items():
        torch.testing.assert_close(saved[name], ref, atol=1e-6, rtol=0)


def test_one_micro_batch_is_unchanged_and_accumulation_is_refused_on_resume(cpu_backend, tmp_path):
    plain = train(_config(), backend=cpu_backend)
    ref, _ = _reference_losses(_config(), 1)
    assert plain.losses == pytest.approx(ref, abs=1e-6)
    ck = tmp_path / "ck"
    train(_config(steps=2, checkpoint={"every": 2, "dir": str(ck)}), backend=cpu_backend)
    from strategies.training import TrainConfigError

    with pytest.raises(TrainConfigError, match="accumulation_steps=1, the config says accumulation_steps=2"):
        train(_config(accumulation_steps=2, resume=str(ck)), backend=cpu_backend)


def _split_runs(strategy, backend):
    """The same rows as 2 full batches of 8 (N=1) and as 4 micro-batches of 2 (N=4), through ``train(data=...)``."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 256, (8, 17), generator=g) for _ in range(2)]
    full = [(r[:, :-1], r[:, 1:]) for r in rows]
    micro = [{"input_ids": r[j:j + 2]} for r in rows for j in range(0, 8, 2)]  # input_ids only: targets are the shift
    whole = train(_config(strategy=strategy, steps=2, batch=8), data=full, backend=backend)
    split = train(_config(strategy=strategy, steps=2, batch=2, accumulation_steps=4), data=micro, backend=backend)
    return whole, split


def test_torch_four_micro_batches_equal_one_batch_of_their_rows(cpu_backend):
    whole, split = _split_runs("torch", cpu_backend)
    assert split.losses == pytest.approx(whole.losses, abs=1e-5)
    assert whole.info.tokens_per_step == split.info.tokens_per_step == 8 * 16


def test_memferry_four_micro_batches_equal_one_batch_of_their_rows(cpu_backend):
    whole, split = _split_runs("memferry", cpu_backend)
    assert split.losses == pytest.approx(whole.losses, abs=1e-5)


def test_memferry_accumulation_equals_plain_torch(cpu_backend):
    result = train(_config(strategy="memferry", accumulation_steps=4), backend=cpu_backend)
    ref, _ = _reference_losses(_config(accumulation_steps=4), 4)
    assert result.losses == pytest.approx(ref, abs=1e-5)


def test_memferry_accumulation_with_clipping_equals_torch(cpu_backend):
    opts = {"max_grad_norm": 0.05}
    ref = train(_config(strategy={"name": "torch", "options": opts}, accumulation_steps=2), backend=cpu_backend)
    got = train(_config(strategy={"name": "memferry", "options": opts}, accumulation_steps=2), backend=cpu_backend)
    assert got.losses == pytest.approx(ref.losses, abs=1e-5)


def test_memferry_one_micro_batch_matches_torch(cpu_backend):
    result = train(_config(strategy="memferry"), backend=cpu_backend)
    ref, _ = _reference_losses(_config(), 1)
    assert result.losses == pytest.approx(ref, abs=1e-5)
