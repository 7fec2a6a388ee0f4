"""Hugging Face models through the product: load by path, sliced loss, LoRA through peft, export to HF format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.models import build_model, flops_per_token, param_count  # noqa: E402
from strategies.training import TrainConfigError, load_config, read_checkpoint, train  # noqa: E402


def _llama_cfg():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _gpt2_cfg():
    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)


def _save(tmp_path, cfg, name):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    out = tmp_path / name
    model.save_pretrained(out, safe_serialization=True)
    return out, model


@pytest.fixture(params=["llama", "gpt2"])
def saved(request, tmp_path):
    """(folder, the HF model saved there) for a tiny Llama and a tiny tied GPT-2."""
    return _save(tmp_path, _llama_cfg() if request.param == "llama" else _gpt2_cfg(), request.param)


def _run_config(path, tmp_path, steps=3, **model_extra):
    return {"model": {"family": "hf", "path": str(path), **model_extra}, "strategy": "torch", "steps": steps,
            "batch": 2, "seq": 16, "log_every": 1, "dtype": "fp32", "optimizer": {"lr": 1e-2},
            "data": {"kind": "synthetic", "branching": 4},
            "checkpoint": {"dir": str(tmp_path / "run"), "every": 0}}


# ---------------------------------------------------------------------------------- pretrained in
def test_load_by_path_gives_the_saved_weights(saved):
    path, ref = saved
    m = build_model("hf", path=str(path), seq=16)
    assert len(m.blocks) == 2 and m.hf.config.use_cache is False
    ours = {k[len("hf."):]: v for k, v in m.state_dict().items() if k.startswith("hf.")}  # not the blocks.* aliases
    theirs = ref.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k
    assert param_count("hf", path=str(path), seq=16) == sum(p.numel() for p in ref.parameters())
    assert flops_per_token("hf", path=str(path), seq=16) > 6 * (param_count("hf", path=str(path), seq=16) - 128 * 32 * 2)


def test_train_config_reads_vocab_and_blocks_from_path(saved, tmp_path):
    config = load_config(_run_config(saved[0], tmp_path))
    assert config.vocab() == 128 and config.n_blocks() == 2


@pytest.mark.parametrize("model,match", [
    ({"path": "gpt2"}, "must be a local folder with config.json"),
    ({"path": "meta-llama/Llama-2-7b-hf"}, "never downloaded"),
    ({"config": {"model_type": "llama", "hiden_size": 32, "vocab_size": 128}}, r"\['hiden_size'\] are not fields"),
    ({"config": {"model_type": "lama", "vocab_size": 128}}, "not a transformers model type"),
    ({}, "either path"),
    ({"config": {"model_type": "gpt2", "vocab_size": 128}, "lora": {"r": 4, "rank": 2}}, r"lora has no key\(s\) \['rank'\]"),
    ({"config": {"model_type": "gpt2", "vocab_size": 128}, "lora": {"r": 0}}, "lora.r must be a positive integer"),
])
def test_bad_hf_model_sections_are_one_line_errors(model, match):
    model = dict(model)
    strategy = model.pop("_strategy", "torch")
    with pytest.raises(TrainConfigError, match=match) as err:
        load_config({"model": {"family": "hf", **model}, "strategy": strategy, "seq": 16})
    assert "\n" not in str(err.value)


def test_path_and_config_together_are_refused(saved):
    with pytest.raises(TrainConfigError, match="not both"):
        load_config({"model": {"family": "hf", "path": str(saved[0]), "config": {"model_type": "llama"}},
                     "strategy": "torch", "seq": 16})


def test_gpt2_aliases_and_common_fields_are_known_config_keys():
    cfg = {"model_type": "gpt2", "hidden_size": 32, "num_hidden_layers": 2, "n_head": 4, "vocab_size": 128,
           "tie_word_embeddings": True, "pad_token_id": 0}
    config = load_config({"model": {"family": "hf", "config": cfg}, "strategy": "torch", "seq": 16})
    assert config.n_blocks() == 2 and config.vocab() == 128


# ---------------------------------------------------------------------------------- sliced loss
def test_chunked_loss_equals_the_whole_loss(saved):
    m = build_model("hf", path=str(saved[0]), seq=16, dtype=torch.float32)
    idx, tgt = torch.randint(0, 128, (3, 16)), torch.randint(0, 128, (3, 16))
    tgt[0, :3] = -100

    def run():
        m.zero_grad(set_to_none=True)
        loss = m(idx, tgt)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    whole, g_whole = run()
    ref = torch.nn.functional.cross_entropy(m.hf(input_ids=idx).logits.reshape(-1, 128), tgt.reshape(-1))
    torch.testing.assert_close(whole, ref.detach(), rtol=1e-6, atol=1e-6)
    m.loss_chunks = 4
    sliced, g_sliced = run()
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_whole, g_sliced):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- train and export
def _final_state(tmp_path):
    ckpts = sorted((tmp_path / "run").glob("step-*.pt"))
    return read_checkpoint(ckpts[-1])


def test_train_then_export_loads_with_the_trained_weights(saved, tmp_path, cpu_backend):
    from strategies.training.export import export_hf

    path, ref = saved
    (path / "tokenizer.json").write_text('{"fake": true}')
    config = load_config(_run_config(path, tmp_path))
    result = train(config)
    assert result.losses[-1] < result.losses[0]
    state = _final_state(tmp_path)["engine"]["model"]
    if "hf.lm_head.weight" in state and ref.config.tie_word_embeddings:
        del state["hf.lm_head.weight"]  # a tied head may be missing: export ties it
    state = {k: v for k, v in state.items() if k.startswith("hf.")}  # the blocks.* aliases may be missing too
    out = export_hf(state, config, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and json.loads((out / "tokenizer.json").read_text()) == {"fake": True}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    theirs = loaded.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(theirs[k[len("hf."):]], v, rtol=1e-6, atol=1e-6)
    import strategies.training.export_cli  # noqa: F401 - registers `xpu export`
    from xpu.cli import main

    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "a"), "--adapter"]) == 2  # no LoRA here
    if ref.config.tie_word_embeddings:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    # trained: the weights moved away from the saved ones
    assert not torch.equal(theirs["model.norm.weight" if "model.norm.weight" in theirs else "transformer.ln_f.weight"],
                           ref.state_dict()["model.norm.weight" if "model.norm.weight" in theirs else "transformer.ln_f.weight"])


LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def test_lora_wrapping_hides_only_pefts_deprecated_property_warning(tmp_path, recwarn, monkeypatch):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` while it wraps a model
    (a FutureWarning the user cannot act on): hidden; any other warning peft raises still shows."""
    import warnings

    import peft

    wrap = peft.get_peft_model

    def noisy(*args, **kwargs):
        warnings.warn("another peft warning", FutureWarning)
        return wrap(*args, **kwargs)

    monkeypatch.setattr(peft, "get_peft_model", noisy)
    path, _ = _save(tmp_path, _llama_cfg(), "llama")
    warnings.simplefilter("always")
    build_model("hf", path=str(path), seq=16, lora={**LORA, "target_modules": ["q_proj"]})
    messages = [str(w.message) for w in recwarn]
    assert not [m for m in messages if "is_gradient_checkpointing" in m]
    assert "another peft warning" in messages


def test_lora_freezes_the_base_and_exports_merged_and_adapter(tmp_path, cpu_backend):
    from peft import PeftModel

    from strategies.training.export_cli import add_arguments, run
    import argparse

    path, ref = _save(tmp_path, _llama_cfg(), "llama")
    lora = {**LORA, "target_modules": ["q_proj", "v_proj"]}
    m = build_model("hf", path=str(path), seq=16, lora=lora)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(m.blocks) == 2
    config = load_config(_run_config(path, tmp_path, steps=3, lora=lora))
    train(config)
    ckpt = _final_state(tmp_path)
    state = ckpt["engine"]["model"]
    # base weights unchanged by training
    base_key = "hf.base_model.model.model.layers.0.mlp.up_proj.weight"
    assert torch.equal(state[base_key], ref.state_dict()["model.layers.0.mlp.up_proj.weight"])

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "run"), "--hf", str(tmp_path / "merged")])) == 0
    assert run(parser.parse_args([str(tmp_path / "run"), "--hf", str(tmp_path / "adapter"), "--adapter"])) == 0

    # reference: peft's own merge of the trained adapter
    expect = build_model("hf", path=str(path), seq=16, lora=lora)
    expect.load_state_dict(state)
    expect = expect.hf.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert set(merged) == set(expect)
    for k, v in expect.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-6)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], ref.state_dict()[q])  # the adapter was trained and merged in

    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, state["hf." + n], rtol=0, atol=0)
    x = torch.randint(0, 128, (1, 8))
    torch.testing.assert_close(peft_model.merge_and_unload()(input_ids=x).logits,
                               transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=x).logits,
                               rtol=1e-5, atol=1e-5)


def test_xpu_export_bad_input_is_one_line_exit_2(tmp_path, capsys):
    import strategies.training.export_cli  # noqa: F401 - registers `xpu export` (as its entry point does)
    from xpu.cli import main

    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xpu export: error: no checkpoint file or folder") and "\n" not in err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main(["export", str(tmp_path / "junk.pt"), "--hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a readable xpu train checkpoint" in err and "\n" not in err


def test_path_without_safetensors_or_too_short_for_seq_is_refused(saved):
    path = saved[0]
    base = {"strategy": "torch", "data": {"kind": "synthetic"}}
    with pytest.raises(TrainConfigError, match="exceeds the model's max_position_embeddings 64"):
        load_config({**base, "model": {"family": "hf", "path": str(path)}, "seq": 65})
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(TrainConfigError, match=r"holds no \*.safetensors weights"):
        load_config({**base, "model": {"family": "hf", "path": str(path)}, "seq": 16})


def test_memferry_trains_an_hf_model_with_the_same_losses_sliced(tmp_path, cpu_backend):
    path, _ = _save(tmp_path, _llama_cfg(), "llama")
    losses = []
    for chunks in (1, 4):
        cfg = {"model": {"family": "hf", "path": str(path)}, "steps": 3, "batch": 2, "seq": 16, "dtype": "fp32",
               "strategy": {"name": "memferry", "options": {"loss_chunks": chunks}}, "data": {"kind": "synthetic"}}
        losses.append(torch.tensor(train(load_config(cfg)).losses))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_export_copies_the_tokenizer_of_data_tokenizer_and_refuses_other_families(tmp_path):
    from strategies.training.export import export_hf

    path, ref = _save(tmp_path, _gpt2_cfg(), "gpt2")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    state = {"hf." + k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    config = {"model": {"family": "hf", "path": str(path)}, "seq": 16, "data": {"kind": "text", "tokenizer": str(tok)}}
    out = export_hf(state, config, tmp_path / "out")
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "tokenizer_config.json").is_file()
    with pytest.raises(TrainConfigError, match="needs a model of family hf"):
        export_hf({}, {"model": {"family": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64}}, tmp_path / "x")
    with pytest.raises(TrainConfigError, match="do not match the config's model: missing"):
        export_hf({k: v for k, v in state.items() if "h.0." not in k}, config, tmp_path / "y")


def test_recompute_uses_hf_checkpointing_with_equal_grads(tmp_path):
    path, _ = _save(tmp_path, _llama_cfg(), "llama")
    m = build_model("hf", path=str(path), seq=16, lora={"r": 2, "target_modules": ["q_proj"]})
    m.train()
    idx = torch.randint(0, 128, (2, 16))

    def grads():
        m.zero_grad(set_to_none=True)
        m(idx, idx).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = grads()
    m.recompute = True
    assert m.recompute and any(getattr(x, 'gradient_checkpointing', False) for x in m.modules())
    again = grads()
    assert set(again) == set(plain) and plain
    for n, g in plain.items():
        torch.testing.assert_close(again[n], g, rtol=1e-6, atol=1e-7)
    m.recompute = False
    assert not any(getattr(x, 'gradient_checkpointing', False) for x in m.modules())


@pytest.mark.parametrize("cfg", ["llama", "gpt2"])
def test_lora_with_memferry_equals_peft_with_torch_adamw(tmp_path, cpu_backend, cfg):
    """The frozen base is homed with no optimizer state; the adapters train as under torch's AdamW."""
    if cfg == "llama":
        hf_cfg = _llama_cfg()
    else:  # GPT-2's dropout would draw different masks in two engines
        hf_cfg = _gpt2_cfg()
        hf_cfg.resid_pdrop = hf_cfg.embd_pdrop = hf_cfg.attn_pdrop = 0.0
    path, _ = _save(tmp_path, hf_cfg, cfg)
    lora = {**LORA, "target_modules": ["q_proj", "v_proj"] if cfg == "llama" else ["c_attn"]}
    states = {}
    for strategy in ("torch", "memferry"):
        run = _run_config(path, tmp_path / strategy, steps=3, lora=lora)
        run["strategy"] = {"name": strategy, "options": {"max_grad_norm": 1.0}}
        run["accumulation_steps"] = 2
        train(load_config(run))
        states[strategy] = _final_state(tmp_path / strategy)["engine"]["model"]
    ours, ref = states["memferry"], states["torch"]
    trained = [k for k in ref if "lora_" in k]
    assert trained
    for k in trained:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def _jsonl_and_tokenizer(tmp_path, vocab):
    """A jsonl file of local text and a byte-level BPE tokenizer trained on it (nothing downloaded)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (Path(__file__).resolve().parents[1] / "examples" / "train" / "data" / "tiny.txt").read_text()
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() <= vocab
    tok.save(str(tmp_path / "tokenizer.json"))
    return data, tmp_path / "tokenizer.json"


def plain_adamw_losses(ref, config, max_grad_norm):
    """Plain PyTorch on ``config``'s batches: per step its micro-batches' mean losses over counted
    targets (-100 left out), summed gradients clipped at ``max_grad_norm``, one torch AdamW step."""
    import torch.nn.functional as F

    from strategies.training.data import make_datasets
    from strategies.weight_decay import param_groups

    windows, _, _ = make_datasets(config)
    o, accum = config.optimizer, config.accumulation_steps
    opt = torch.optim.AdamW(param_groups(ref, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)
    losses = []
    for _ in range(config.steps):
        total = 0.0
        for _ in range(accum):
            x, y = windows.next()
            logits = ref(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            loss = loss / (y != -100).sum().clamp(min=1)
            (loss / accum).backward()
            total += float(loss.detach()) / accum
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.mark.parametrize("cfg", ["llama", "gpt2"])
def test_finetune_with_memferry_accumulation_and_clipping_exports_plain_adamw_weights(tmp_path, cpu_backend, cfg):
    """Load a saved model, train 20 steps of 4 accumulated micro-batches with clipping on jsonl text,
    export, and ``from_pretrained`` gives the weights plain PyTorch AdamW reaches (the GPT-2 one tied)."""
    from strategies.training.export import export_hf

    hf_cfg = _llama_cfg() if cfg == "llama" else _gpt2_cfg()
    hf_cfg.vocab_size = 300  # the byte-level alphabet (256) and some merges
    if cfg == "gpt2":  # dropout would draw different masks in the two loops
        hf_cfg.resid_pdrop = hf_cfg.embd_pdrop = hf_cfg.attn_pdrop = 0.0
    path, _ = _save(tmp_path, hf_cfg, cfg)
    data, tokenizer = _jsonl_and_tokenizer(tmp_path, 300)
    run = {"model": {"family": "hf", "path": str(path)}, "steps": 20, "batch": 2, "seq": 16, "dtype": "fp32",
           "accumulation_steps": 4, "log_every": 10,
           "strategy": {"name": "memferry", "options": {"max_grad_norm": 0.5}},
           "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
           "data": {"kind": "jsonl", "path": str(data), "field": "text", "tokenizer": str(tokenizer)},
           "checkpoint": {"dir": str(tmp_path / "run"), "every": 0}}
    config = load_config(run)
    result = train(config)
    export_hf(_final_state(tmp_path)["engine"]["model"], config, tmp_path / "out")
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert (tmp_path / "out" / "tokenizer.json").is_file()

    # plain PyTorch: the same model from disk, batches, groups, clipping and AdamW
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses = plain_adamw_losses(ref, config, max_grad_norm=0.5)
    assert result.losses == pytest.approx(losses, abs=1e-5)
    assert losses[-1] < losses[0]
    theirs = ref.state_dict()
    assert set(got.state_dict()) == set(theirs)
    for k, v in got.state_dict().items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-5, msg=k)
    if cfg == "gpt2":
        assert got.lm_head.weight.data_ptr() == got.transformer.wte.weight.data_ptr()  # still tied


def test_export_writes_the_base_models_dtype_unless_told(tmp_path, cpu_backend, capsys):
    """A bfloat16 base trained with fp32 masters comes back as bfloat16 (its LoRA merged in fp32,
    then cast); ``--dtype float32`` keeps the masters; an adapter alone stays as trained; a bad name
    is a one-line error (exit 2) before anything is written."""
    import strategies.training.export_cli  # noqa: F401 - registers `xpu export`
    from xpu.cli import main

    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_config(_llama_cfg()).to(torch.bfloat16)
    path = tmp_path / "bf16"
    base.save_pretrained(path)
    lora = {**LORA, "target_modules": ["q_proj", "v_proj"]}
    train(load_config(_run_config(path, tmp_path, steps=2, lora=lora)))
    state = _final_state(tmp_path)["engine"]["model"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())  # fp32 masters

    run = str(tmp_path / "run")
    assert main(["export", run, "--hf", str(tmp_path / "auto")]) == 0
    assert main(["export", run, "--hf", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert main(["export", run, "--hf", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert "(bfloat16)" in capsys.readouterr().out
    expect = build_model("hf", path=str(path), seq=16, lora=lora)
    expect.load_state_dict(state)
    expect = expect.hf.merge_and_unload().state_dict()  # merged in fp32
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "auto")
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert auto.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    for k, v in expect.items():
        assert torch.equal(auto.state_dict()[k], v.to(torch.bfloat16)), k
        assert torch.equal(fp32.state_dict()[k], v), k
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert adapter and all(v.dtype == torch.float32 for v in adapter.values())

    capsys.readouterr()
    assert main(["export", run, "--hf", str(tmp_path / "bad"), "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown dtype 'fp8'; valid: auto, float32, bfloat16, float16" in err and "\n" not in err
    assert not (tmp_path / "bad").exists()
