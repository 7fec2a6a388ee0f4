"""Fine-tune a local Hugging Face model with transformers' Trainer while MemFerry keeps its weights.

    python examples/finetune/make_tiny_model.py runs/tiny-hf             # a stand-in model and text
    python examples/finetune/trainer_memferry.py runs/tiny-hf --lora     # Trainer + MemFerry (+ LoRA)

Trainer runs its loop, data, learning-rate schedule and saves; MemFerry homes the weights in host
memory, plans what the device keeps under ``--budget`` (``plan="auto"``: one batch profiled, one
step rehearsed), sums the ``--accum`` micro-batches, clips and runs AdamW; ``slice_hf_loss``
computes the loss over token slices, so no whole logits take device memory. The result is a
``save_pretrained`` folder (an adapter with ``--lora``) that ``from_pretrained`` loads: the script
loads it back and prints its loss on the first batch beside the engine's. Point it at your own
folder (``model/`` from ``save_pretrained`` with its tokenizer, ``train.jsonl`` with a ``"text"``
field per line) and raise ``--budget`` to what your device has.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def token_blocks(folder: Path, tokenizer, seq: int) -> list[dict[str, torch.Tensor]]:
    """The jsonl's texts, joined and tokenized, cut into ``seq``-token training rows (labels = inputs)."""
    texts = [json.loads(line)["text"] for line in (folder / "train.jsonl").read_text().splitlines() if line.strip()]
    ids = torch.tensor(tokenizer(tokenizer.eos_token.join(texts))["input_ids"])
    rows = ids[: len(ids) // seq * seq].view(-1, seq)
    if not len(rows):
        raise SystemExit(f"error: {folder / 'train.jsonl'} has fewer than --seq {seq} tokens; give more text or a smaller --seq")
    return [{"input_ids": r, "labels": r} for r in rows]


def main(argv: list[str] | None = None) -> None:
    """Train, save, reload and compare (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="holds model/ (save_pretrained, with its tokenizer) and train.jsonl")
    ap.add_argument("--out", type=Path, help="where Trainer writes (default: FOLDER/trainer-out)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--budget", default="64MB", help="device memory MemFerry may use")
    ap.add_argument("--chunks", type=int, default=4, help="token slices of the loss")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters on q_proj and v_proj, base frozen")
    args = ap.parse_args(argv)

    import transformers

    import xpu
    from strategies.memferry import AdamW, MemFerry
    from strategies.memferry.hf_trainer import memferry_trainer
    from strategies.models import slice_hf_loss

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.folder / "model", local_files_only=True)
    rows = token_blocks(args.folder, tokenizer, args.seq)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder / "model", local_files_only=True)
    if args.lora:
        import peft  # optional: only for --lora

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           task_type=peft.TaskType.CAUSAL_LM))
    model = slice_hf_loss(model, args.chunks)
    first = torch.stack([r["input_ids"] for r in rows[: args.batch]])
    backend = xpu.get_backend()
    engine = MemFerry(model, optim=AdamW(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0), device_budget=args.budget,
                      plan="auto", sample=(first, first), accumulation_steps=args.accum, backend=backend)
    out = args.out or args.folder / "trainer-out"
    targs = transformers.TrainingArguments(
        str(out), max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        max_grad_norm=0, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=max(1, args.steps // 4),
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=backend.device_type == "cpu")  # Trainer's own placement: the engine's device kind
    trainer = memferry_trainer(engine, targs, train_dataset=rows)
    trainer.train()
    trainer.save_model(str(out / "final"))
    with torch.no_grad():
        ours = float(engine(input_ids=first, labels=first).loss)
    engine.close()

    base = transformers.AutoModelForCausalLM.from_pretrained(args.folder / "model", local_files_only=True)
    reloaded = (peft.PeftModel.from_pretrained(base, out / "final") if args.lora else
                transformers.AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True))
    with torch.no_grad():
        theirs = float(reloaded.eval()(input_ids=first, labels=first).loss)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(f"trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved to {out / 'final'}; "
          f"reloaded with from_pretrained: loss {theirs:.4f} on the first batch (the engine's: {ours:.4f})")


if __name__ == "__main__":
    main()
