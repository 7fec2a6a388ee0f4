"""`xpu train` under torchrun: ranks train data-parallel MemFerry on LOCAL_RANK, and N ranks with
`batch: B` equal one process with `batch: N*B` (cpu backend, gloo; torchrun's environment set by hand)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from strategies.training import load_config, read_checkpoint, train
from xpu.dist import free_port

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


GPT = {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256}


def _config(tmp_path: Path, name: str, batch: int, model: dict | None = None, **extra) -> Path:
    cfg = {"name": name, "model": model or GPT,
           "steps": 4, "batch": batch, "seq": 16, "log_every": 1, "accumulation_steps": 2, "dtype": "fp32",
           "strategy": {"name": "memferry", "options": {"plan": "prefetch", "max_grad_norm": 0.5}},
           "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-4},
           "data": {"kind": "synthetic", "branching": 2, "eval_fraction": 0.1}, "eval_every": 2, "eval_batches": 2,
           "checkpoint": {"dir": str(tmp_path / name), "every": 4}}
    cfg.update(extra)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _lora_llama(tmp_path: Path) -> dict:
    """A tiny Hugging Face Llama saved in ``tmp_path``, trained through LoRA (its base weights frozen)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama", safe_serialization=True)
    return {"family": "hf", "path": str(tmp_path / "llama"),
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(XPU_BACKEND="cpu", XPU_CPU_DEVICES="2", PYTHONPATH=str(ROOT), XPU_COLLECTIVE_TIMEOUT_S="60", **extra)
    return env


def _start(config: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xpu", "train", str(config), "--no-progress", "--json"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:  # a rank that hangs must not outlive the test
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.mark.parametrize("model", ["gpt", "llama-lora"])
def test_two_ranks_equal_one_process_with_the_doubled_batch(tmp_path, model, cpu_backend):
    dims = GPT if model == "gpt" else _lora_llama(tmp_path)
    port = str(free_port())
    procs = [_start(_config(tmp_path, "dp", batch=2, model=dims),
                    _env(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port)) for r in range(WORLD)]
    try:  # the one-process reference meanwhile, in this process
        ref = train(load_config(_config(tmp_path, "one", batch=2 * WORLD, model=dims))).to_dict()
    finally:
        ranks = _finish(procs)
    for rc, stdout, stderr in ranks:
        assert rc == 0, stdout + stderr
    lead, other = ranks
    dp = json.loads(lead[1].strip().splitlines()[-1])
    assert other[1] == "" and "step" not in other[2] and "done" not in other[2]  # rank 1 reports nothing
    assert "data-parallel over 2 ranks (torchrun): batch 2 per rank, 4 in all" in lead[2]
    assert dp["info"]["world"] == WORLD and dp["info"]["tokens_per_step"] == ref["info"]["tokens_per_step"]
    assert dp["info"]["device"] == 0
    assert dp["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert [e for _, e in dp["eval_losses"]] == pytest.approx([e for _, e in ref["eval_losses"]], abs=1e-5)
    files = sorted((tmp_path / "dp").glob("step-*.pt"))
    assert [f.name for f in files] == ["step-0000004.pt"]  # written once, by rank 0
    got = read_checkpoint(files[0])["engine"]
    want = read_checkpoint(tmp_path / "one" / "step-0000004.pt")["engine"]
    assert set(got["model"]) == set(want["model"]) and set(got["optimizer"]) == set(want["optimizer"])
    if model == "llama-lora":  # frozen base weights: in the checkpoint, without optimizer state
        assert set(got["optimizer"]) < set(got["model"]) and all("lora_" in n for n in got["optimizer"])
    for name, value in want["model"].items():  # the whole model, shards gathered
        torch.testing.assert_close(got["model"][name], value, atol=1e-5, rtol=1e-5, msg=name)
    for name, state in want["optimizer"].items():
        torch.testing.assert_close(got["optimizer"][name]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-7, rtol=1e-4,
                                   msg=name)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """The outcomes of the refused launches below, started together (each is a process start
    and a refusal: they need not wait for one another)."""
    tmp_path = tmp_path_factory.mktemp("refused")
    bad = _start(_config(tmp_path, "bad", batch=2), _env(RANK="1", WORLD_SIZE="8", LOCAL_RANK="7",
                                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    torch_ = _start(_config(tmp_path, "torch", batch=2, strategy={"name": "torch", "options": {}}),
                    _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    return dict(zip(("local_rank", "torch"), _finish([bad, torch_])))


def test_local_rank_with_no_device_is_a_one_line_error(refusals):
    rc, stdout, stderr = refusals["local_rank"]
    assert rc == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        "xpu train: error: LOCAL_RANK=7 names no device: the cpu backend has 2 device(s) (0, 1); start at most "
        "--nproc_per_node 2 processes per node"]


def test_strategy_torch_under_torchrun_is_refused(refusals):
    rc, stdout, stderr = refusals["torch"]
    assert rc == 2 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xpu train: error: strategy: torch does not train data-parallel")


def test_two_ranks_resume_a_one_process_checkpoint_and_finish_as_it_would(tmp_path, cpu_backend):
    """The checkpoint is the whole state: ranks resume from it (each takes its shards) and end where one process does."""
    ref = train(load_config(_config(tmp_path, "one", batch=2 * WORLD, checkpoint={"dir": str(tmp_path / "one"),
                                                                                  "every": 2})))
    config = _config(tmp_path, "dp", batch=2, resume=str(tmp_path / "one" / "step-0000002.pt"))
    port = str(free_port())
    ranks = _finish([_start(config, _env(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(WORLD)])
    for rc, stdout, stderr in ranks:
        assert rc == 0, stdout + stderr
    dp = json.loads(ranks[0][1].strip().splitlines()[-1])
    assert dp["steps"] == [3, 4] and dp["losses"] == pytest.approx(ref.losses[2:], abs=1e-5)
    got = read_checkpoint(tmp_path / "dp" / "step-0000004.pt")["engine"]["model"]
    for name, value in read_checkpoint(tmp_path / "one" / "step-0000004.pt")["engine"]["model"].items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=name)
